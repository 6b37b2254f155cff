# Builds the thin C++ device glue (csrc/) against the installed torch.
# Install with `pip install --no-build-isolation -e .` so it links to that torch.
import os

# Building must not autoload a previously installed (maybe stale) torchneuron.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup  # noqa: E402
import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

setup(
    ext_modules=[
        CppExtension(
            "torchneuron._C",
            sources=[
                "csrc/allocator.cpp",
                "csrc/autocast.cpp",
                "csrc/device_addresses.cpp",
                "csrc/distributed.cpp",
                "csrc/draws.cpp",
                "csrc/guard.cpp",
                "csrc/hooks.cpp",
                "csrc/kernels.cpp",
                "csrc/pinned_memory.cpp",
                "csrc/memory_guards.cpp",
                "csrc/module.cpp",
                "csrc/pending_graph.cpp",
                "csrc/profiler.cpp",
                "csrc/recording.cpp",
            ],
            # The kineto plugin (csrc/profiler.cpp) builds against torch's kineto headers.
            include_dirs=[os.path.join(os.path.dirname(torch.__file__), "include", "kineto")],
            define_macros=[("USE_KINETO", None), ("FMT_HEADER_ONLY", "1")],
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

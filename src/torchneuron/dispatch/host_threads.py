"""Host kernels run off the program's thread use one OpenMP thread.

The host path runs PyTorch's CPU kernels (on the CPU target, on the device's
own memory). Backward ops of neuron tensors run on autograd's device thread,
which PyTorch starts for the device; a parallel CPU kernel there (MKL's
sgemm in `mm`'s backward, say) makes that thread the master of a second
OpenMP team that lives as long as the thread. libgomp then manages more
threads than there are CPUs and throttles its spin-wait: every parallel
region of the program's own thread sleeps and wakes its workers through the
kernel. Measured on 2 cores: CPU eager's `mm` 208 -> 444 us and the demo's
CPU eager step 9.1 -> 17.3 ms, for the rest of the process, once one neuron
backward had run on the host path.

So threads the program did not start as Python threads (autograd's device
threads) and torchneuron's background threads set their own OpenMP and MKL
thread counts to one before their first host kernel. Both settings are per
thread: `torch.set_num_threads` is not used, because it also changes the
count new threads start with and resizes the process-wide pthreadpool.
The program's own threads keep PyTorch's settings.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from ..compiler.pool import in_background

_state = threading.local()
_setters = None


def _thread_count_setters() -> list:
    """omp_set_num_threads and MKL's per-thread thread count setter, as
    libtorch_cpu resolves them (dlsym through its handle searches the
    libraries it loaded: the libgomp and MKL PyTorch uses, not another copy).
    Empty where PyTorch was built without them."""
    global _setters
    if _setters is None:
        found = []
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        except OSError:
            lib = None
        # mkl.h maps mkl_set_num_threads_local to MKL_Set_Num_Threads_Local;
        # the lowercase symbol is the Fortran entry, which takes a pointer.
        for name in ("omp_set_num_threads", "MKL_Set_Num_Threads_Local"):
            fn = getattr(lib, name, None) if lib is not None else None
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                found.append(fn)
        _setters = found
    return _setters


def confine() -> None:
    """Call before running a host kernel: once per thread, a thread Python did
    not start (autograd's device threads) or a background thread drops to one
    OpenMP and MKL thread."""
    if getattr(_state, "checked", False):
        return
    _state.checked = True
    if isinstance(threading.current_thread(), threading._DummyThread) or in_background():
        for set_count in _thread_count_setters():
            set_count(1)

"""Data tiling is kept only for modules with a large matmul (data_tiling.py):
the decision is read from the lowered module's own matmul shapes."""

import torch

from torchneuron.compiler import data_tiling
from torchneuron.compiler.iree_compile import target_flags


def _mlir(fn, *args) -> str:
    from iree.compiler.extras.fx_importer import FxImporter

    class Module(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    importer = FxImporter()
    importer.import_frozen_program(torch.export.export(Module(), args).run_decompositions())
    return str(importer.module)


def test_matmul_sizes_are_read_from_the_module():
    small = _mlir(torch.mm, torch.randn(256, 64), torch.randn(64, 192))
    assert data_tiling.largest_matmul_macs(small) == 256 * 64 * 192
    batched = _mlir(torch.bmm, torch.randn(4, 8, 16), torch.randn(4, 16, 32))
    assert data_tiling.largest_matmul_macs(batched) == 4 * 8 * 16 * 32
    # addmm's first operand is the bias: the reduced dimension is the second's last.
    addmm = _mlir(torch.addmm, torch.randn(1), torch.randn(8, 512), torch.randn(512, 4))
    assert data_tiling.largest_matmul_macs(addmm) == 8 * 512 * 4
    assert data_tiling.largest_matmul_macs(_mlir(torch.tanh, torch.randn(8))) == 0


def test_small_matmuls_compile_without_data_tiling_large_ones_with_it():
    target = target_flags()
    assert data_tiling.ON in target[1]  # the CPU target asks for data tiling
    small = _mlir(torch.mm, torch.randn(256, 64), torch.randn(64, 192))
    assert data_tiling.ON not in data_tiling.for_module(small, target)[1]
    assert data_tiling.OFF in data_tiling.for_module(small, target)[1]
    large = _mlir(torch.mm, torch.randn(1024, 1024), torch.randn(1024, 1024))
    assert data_tiling.for_module(large, target) == target
    assert data_tiling.without(data_tiling.without(target)) is None


def test_a_module_data_tiling_fails_on_is_compiled_without_it_and_remembered(monkeypatch):
    # A large batched matmul feeding a broadcasting where: IREE 3.13's data
    # tiling fails to compile it ("load_from_buffer op buffer and tensor shapes
    # must be compatible"). The first request tries with it and then without;
    # a later request goes straight to the executable that compiled.
    from torchneuron.cache import executables

    def scores(q, k, mask):
        s = torch.bmm(q, k).view(2, 16, 256, 256) * 0.375
        return torch.where(mask, s, torch.tensor(float("-inf")))

    mlir = _mlir(scores, torch.randn(32, 256, 128), torch.randn(32, 128, 256),
                 torch.ones(1, 1, 256, 256, dtype=torch.bool))
    tried = []
    compile_one = executables._executable_for

    def spy(mlir, what, target, *rest):
        tried.append(data_tiling.ON in target[1])
        return compile_one(mlir, what, target, *rest)

    monkeypatch.setattr(executables, "_executable_for", spy)
    first = executables.executable_for(mlir, "attention scores", target_flags())
    assert tried == [True, False]
    tried.clear()
    again = executables.executable_for(mlir, "attention scores", target_flags())
    assert tried == [False] and again.key == first.key

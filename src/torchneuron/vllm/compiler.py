"""vLLM's compilation on neuron: vLLM's own backend (VLLM_COMPILE) traces the
model with Dynamo and splits its graph at the attention and KV-cache ops;
each piece between them comes here and is compiled by torchneuron's
torch.compile backend. The attention ops stay outside the pieces: they take
per-step Python metadata and the layer's name (an opaque value no
executable can take)."""

from __future__ import annotations

from typing import Any

from vllm.compilation.compiler_interface import CompilerInterface

from ..dynamo import neuron


class NeuronCompiler(CompilerInterface):
    name = "neuron"

    def compile(self, graph, example_inputs: list[Any], compiler_config: dict[str, Any], compile_range,
                key: str | None = None):
        # No handle: torchneuron's executable cache (memory, disk, the
        # compile service) is what a restarted server reuses.
        return neuron(graph, example_inputs), None

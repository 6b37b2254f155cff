"""Lightning's `Trainer(accelerator="neuron")`.

Lightning knows its accelerators by name through a registry it fills with
its own classes, and offers no entry point for others: so when Lightning's
accelerator module is imported (after_import.py), a neuron Accelerator is
built for that namespace (`lightning.pytorch` or the standalone
`pytorch_lightning`, two class hierarchies) and registered as "neuron".

Three of Lightning's choices assume that a device which is not CUDA or MPS
is the CPU; on a neuron accelerator they are made for neuron instead:
- one device: `SingleDeviceStrategy(device="cpu")`, which would train on the
  host; here the accelerator's device;
- `precision="16-mixed"` / `"bf16-mixed"`: autocast (and the fp16 grad
  scaler) on "cuda", a no-op without CUDA; here on "neuron";
- DDP wraps the model under a `torch.cuda.Stream()`, which fails without
  CUDA; here under none (the device's streams order the work).
Each is a wrapper around Lightning's own method that changes nothing for
other accelerators; tests/test_training_libraries.py checks all three, so a
Lightning release that changes them fails there.
"""

from __future__ import annotations

import importlib

import torch

NAME = "neuron"
# Where each namespace keeps what is wrapped here.
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _device_indices(devices) -> list:
    """Lightning's `devices`: a count, -1 or "auto" for all, a list of indices, or "0,1"."""
    count = torch.neuron.device_count()
    if devices in ("auto", -1, "-1"):
        return list(range(count))
    if isinstance(devices, str):
        devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
    indices = list(range(devices)) if isinstance(devices, int) else [int(d) for d in devices]
    if not indices or any(not 0 <= i < count for i in indices):
        raise ValueError(f"neuron: devices={devices!r} asks for neuron devices {indices}, but there are {count} "
                         f"(TORCHNEURON_DEVICE_COUNT sets how many)")
    return indices


def accelerator_class(namespace: str) -> type:
    """The neuron Accelerator of one of Lightning's namespaces."""
    base = importlib.import_module(namespace + ".accelerators.accelerator").Accelerator

    class NeuronAccelerator(base):
        """The neuron device in Lightning: `Trainer(accelerator="neuron")`."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != NAME:
                raise ValueError(f"neuron: the neuron accelerator was given the device {device}")
            torch.neuron.set_device(device)

        def teardown(self) -> None:
            pass

        def get_device_stats(self, device) -> dict:
            return torch.neuron.memory_stats(device)

        @staticmethod
        def parse_devices(devices) -> list:
            return _device_indices(devices)

        @staticmethod
        def get_parallel_devices(devices) -> list:
            return [torch.device(NAME, i) for i in _device_indices(devices)]

        @staticmethod
        def auto_device_count() -> int:
            return torch.neuron.device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.neuron.is_available()

        @staticmethod
        def name() -> str:
            return NAME

        @classmethod
        def register_accelerators(cls, registry) -> None:
            registry.register(NAME, cls, description=cls.__name__, override=True)

    NeuronAccelerator.__module__ = __name__
    NeuronAccelerator.__qualname__ = "NeuronAccelerator"
    return NeuronAccelerator


def _on_neuron(connector) -> bool:
    return getattr(getattr(connector, "accelerator", None), "name", lambda: None)() == NAME


def _wrap(cls, method: str, wrapper) -> None:
    original = getattr(cls, method)
    if getattr(original, "_neuron_wrapped", False):
        return
    wrapped = wrapper(original)
    wrapped._neuron_wrapped = True
    setattr(cls, method, wrapped)


def register(namespace: str) -> None:
    """Register the neuron accelerator in `namespace`'s registry and make
    Lightning's three CUDA-or-CPU choices for neuron (see the module's doc)."""
    accelerators = importlib.import_module(namespace + ".accelerators")
    accelerator_class(namespace).register_accelerators(accelerators.AcceleratorRegistry)
    connector = importlib.import_module(namespace + ".trainer.connectors.accelerator_connector")
    strategies = importlib.import_module(namespace + ".strategies")
    precision = importlib.import_module(namespace + ".plugins.precision")

    def choose_strategy(original):
        def _choose_strategy(self):
            strategy = original(self)
            if _on_neuron(self) and isinstance(strategy, strategies.SingleDeviceStrategy) \
                    and strategy.root_device.type == "cpu":
                return strategies.SingleDeviceStrategy(device=self._parallel_devices[0])
            return strategy
        return _choose_strategy

    def init_precision(original):
        def _check_and_init_precision(self):
            plugin = original(self)
            if _on_neuron(self) and type(plugin) is precision.MixedPrecision and plugin.device == "cuda":
                return precision.MixedPrecision(plugin.precision, NAME)
            return plugin
        return _check_and_init_precision

    def ddp_model(original):
        def _setup_model(self, model):
            if self.root_device.type != NAME:
                return original(self, model)
            return torch.nn.parallel.DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(),
                                                             **self._ddp_kwargs)
        return _setup_model

    _wrap(connector._AcceleratorConnector, "_choose_strategy", choose_strategy)
    _wrap(connector._AcceleratorConnector, "_check_and_init_precision", init_precision)
    _wrap(strategies.DDPStrategy, "_setup_model", ddp_model)


def register_when_imported() -> None:
    """Register in each Lightning namespace once its Trainer's connector
    (which imports the accelerators, strategies and precision plugins) loads."""
    from .after_import import when_imported

    for namespace in NAMESPACES:
        when_imported(namespace + ".trainer.connectors.accelerator_connector",
                      lambda _module, namespace=namespace: register(namespace))

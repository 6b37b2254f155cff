"""Random number generation on neuron: one generator per device, with the CPU
generator's algorithm, so a seeded run draws the same numbers as on CPU."""

from __future__ import annotations

import random as _py_random

import torch

from .. import _C
from ..hal.index import device_index

_default_generators: dict = {}


def default_generator(index: int | None = None) -> torch.Generator:
    if index is None:
        index = _C.current_device()
    gen = _default_generators.get(index)
    if gen is None:
        gen = _default_generators[index] = _C.default_generator(index)
    return gen


def default_generators() -> tuple:
    return tuple(default_generator(i) for i in range(_C.device_count()))


def manual_seed(seed: int) -> None:
    default_generator(_C.current_device()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in default_generators():
        g.manual_seed(int(seed))


def seed() -> None:
    default_generator(_C.current_device()).seed()


def seed_all() -> None:
    s = _py_random.getrandbits(63)
    manual_seed_all(s)


def initial_seed() -> int:
    return default_generator(_C.current_device()).initial_seed()


def get_rng_state(device="neuron") -> torch.Tensor:
    return default_generator(device_index(device)).get_state()


def set_rng_state(new_state: torch.Tensor, device="neuron") -> None:
    default_generator(device_index(device)).set_state(new_state)


def get_rng_state_all() -> list:
    return [g.get_state() for g in default_generators()]


def set_rng_state_all(new_states) -> None:
    for g, s in zip(default_generators(), new_states):
        g.set_state(s)

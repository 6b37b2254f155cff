"""An op signature's plan (which executable, its results' shapes, what it
writes back) and the records that keep plans on disk, so a restarted
process lowers nothing it lowered before (eager.py builds plans;
warm_start.py preloads a program's plans from their records)."""

from __future__ import annotations

import torch

from ..cache import executable_cache, layers
from ..runtime import LoadedExecutable


class Plan:
    __slots__ = ("executable", "flag", "out_specs", "returns", "what", "largest", "carriers", "write_back")

    def __init__(self, executable, out_specs, flag, returns, what, write_back=()):
        self.executable = executable
        self.out_specs = out_specs
        self.flag = flag
        self.returns = returns
        self.what = what
        self.largest = None  # elements of the largest tensor it reads or writes (picks the lane)
        self.carriers = None  # {input index: dtype it is bound as} (lowering/carriers.py)
        # ((j, i), ...): after the launch, output j is copied into input i (lowering/aliasing.py)
        self.write_back = tuple(tuple(p) for p in write_back)


class Rejected:
    """A signature the compiler (or lowering) said no to: not retried."""

    __slots__ = ("reason",)

    def __init__(self, reason):
        self.reason = reason


def record_of(plan, op) -> dict:
    if type(plan) is Rejected:
        return {"kind": "rejected", "reason": plan.reason, "op": op.name()}
    return {
        "kind": "plan",
        "op": op.name(),
        "executable": plan.executable.key if plan.executable is not None else None,
        "out_specs": [[list(shape), str(dtype).replace("torch.", "")] for shape, dtype in plan.out_specs],
        "flag": plan.flag,
        "returns": plan.returns,
        "what": plan.what,
        "write_back": [list(p) for p in plan.write_back],
    }


class Bake:
    """Stored verdict: this op's scalars must be constants (see eager._build_plan)."""


def plan_from_record(record, disk):
    """The plan a stored record describes; None when it cannot be used (its
    executable was evicted, or the record is malformed): lower again."""
    if record is None:
        return None
    try:
        kind = record["kind"]
        if kind == "rejected":
            return Rejected(str(record["reason"]))
        if kind == "bake":
            return Bake()
        out_specs = tuple((tuple(shape), getattr(torch, dtype)) for shape, dtype in record["out_specs"])
        key, what = record["executable"], str(record["what"])
        if key is None:
            return Plan(None, out_specs, None, record["returns"], what)
        executable = executable_cache().get(key)
        if executable is None:
            vmfb = disk.get_executable(key)
            if vmfb is None:
                return None
            executable, inserted = executable_cache().put(key, LoadedExecutable(vmfb, key, what), len(vmfb))
            if inserted:  # the warm-start thread and the first step may both load it
                layers.stats.add("disk")
        return Plan(executable, out_specs, record["flag"], record["returns"], what, record.get("write_back", ()))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None

"""Keeping IREE from writing into inputs an op only reads.

IREE lowers some ops (sort, topk, the scatter and index_put families) to
operations that work in place on their operand. When that operand is a
function input imported from the caller's buffer and this is its last use,
IREE 3.13 updates the imported buffer in place instead of copying it first
(iree-org/iree#24665), so `x.sort()` left `x` sorted. Such inputs are found in
the flow-level program, where in-place updates are visible as tied results
(`flow.dispatch @f(%0) : (...) -> (%0)`, `flow.tensor.update %u, %0[...]`),
and are then marked as written back with their own value at the end of the
torch-level function: IREE has to keep the original contents until then, so
the in-place operation works on a copy. Only the affected executables pay
for that copy.
"""

from __future__ import annotations

import re

_IMPORT = re.compile(r"^\s*(%[\w$.\-#]+) = hal\.tensor\.import (?!consume)[^\n]*?=> %arg(\d+) ")
_ALIAS = re.compile(r"^\s*(%[\w$.\-#]+) = flow\.tensor\.(?:reshape|bitcast|clone|transfer) (%[\w$.\-#]+)")
_VALUE = re.compile(r"%[\w$.\-]+(?:#\d+)?")
_BRACES = re.compile(r"\{[^{}]*\}")


def inputs_written_in_place(flow_mlir: str) -> set:
    """Indices of the entry's read-only inputs that some operation updates in place.

    Clones and reshapes of an input count as the input: IREE may elide a clone
    whose source it considers dead, and a reshape is the same buffer.
    """
    origin: dict = {}  # SSA value -> input index
    written: set = set()
    for line in flow_mlir.splitlines():
        m = _IMPORT.match(line)
        if m:
            origin[m.group(1)] = int(m.group(2))
            continue
        m = _ALIAS.match(line)
        if m and m.group(2) in origin:
            origin[m.group(1)] = origin[m.group(2)]
            continue
        if " -> " not in line or "flow." not in line:
            continue
        # Tied results name their operand in the result types: "-> (%0, tensor<...>)".
        tail = _BRACES.sub("", line.rsplit(" -> ", 1)[1].split(" loc(")[0])
        for value in _VALUE.findall(tail):
            if value in origin:
                written.add(origin[value])
    return written


_SIGNATURE = re.compile(r"func\.func @main\((.*?)\)( attributes \{[^\n]*\})? \{\n")


def protect_inputs(torch_mlir: str, indices) -> str:
    """The torch-dialect module with inputs `indices` turned into arguments
    that are written back with their own, original value at the end."""
    m = _SIGNATURE.search(torch_mlir)
    if m is None:
        raise ValueError("no @main function in the lowered module")
    params = _split_params(m.group(1))
    prologue, epilogue = [], []
    for i in sorted(indices):
        name, _, vtype = params[i].partition(": ")
        if not vtype.startswith("!torch.vtensor<"):
            continue  # already an argument the op writes
        ttype = "!torch.tensor<" + vtype[len("!torch.vtensor<"):]
        params[i] = f"{name}_in: {ttype}"
        prologue.append(_read_of_argument(name, vtype))
        epilogue.append(f"    torch.overwrite.tensor.contents {name} overwrites {name}_in : {vtype}, {ttype}\n")
    head = f"func.func @main({', '.join(params)}){m.group(2) or ''} {{\n"
    body_start = m.end()
    body_end = torch_mlir.index("    return\n", body_start)
    return (torch_mlir[: m.start()] + head + "".join(prologue) + torch_mlir[body_start:body_end]
            + "".join(epilogue) + torch_mlir[body_end:])


_VTENSOR = re.compile(r"!torch\.vtensor<\[([^\]]*)\],([su]i\d+)>$")


def _read_of_argument(name: str, vtype: str) -> str:
    """The torch-level value of argument `name`_in. IREE 3.13 imports a
    signed or unsigned integer argument the function writes as a tensor of
    that type and then finds no conversion to the signless type everything
    else uses ("unresolved target materialization from tensor<4xsi32> to
    tensor<4xi32>"); a bitcast to the signless type gives it one."""
    m = _VTENSOR.match(vtype)
    if m is None:
        return f"    {name} = torch.copy.to_vtensor {name}_in : {vtype}\n"
    dims, element = m.group(1), m.group(2)
    shape = "".join(f"{d.strip()}x" for d in dims.split(",") if d.strip())
    signed, signless = f"tensor<{shape}{element}>", f"tensor<{shape}i{element[2:]}>"
    return (f"    {name}_raw = torch.copy.to_vtensor {name}_in : {vtype}\n"
            f"    {name}_signed = torch_c.to_builtin_tensor {name}_raw : {vtype} -> {signed}\n"
            f"    {name}_signless = tensor.bitcast {name}_signed : {signed} to {signless}\n"
            f"    {name} = torch_c.from_builtin_tensor {name}_signless : {signless} -> {vtype}\n")


def _split_params(text: str) -> list:
    """Split 'a: T<[2,3],f32>, b: U' at top-level commas."""
    params, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        elif ch == "," and depth == 0:
            params.append(text[start:i].strip())
            start = i + 1
    if text.strip():
        params.append(text[start:].strip())
    return params

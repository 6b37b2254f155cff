"""The layers of torchneuron, written once, and the real imports of src/ read
with `ast` (every import: at module level or inside a function).

A room is a folder of src/torchneuron (or a top-level module). `LAYERS` lists
the rooms from the ground up; a room may import rooms of lower layers only.
Rooms of one layer stand side by side and import nothing of each other.
tests/test_layers.py checks the real imports against it;
`python tests/layers.py` prints the picture docs/architecture.md shows.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "torchneuron"

# From the ground up. "torchneuron" is the package's __init__: the public API.
LAYERS = (
    ("_C", "config", "trace", "version"),  # leaves: the C++ glue, settings, profiler sink
    ("hal",),  # IREE HAL devices per index, device indices
    ("memory",),  # storage statistics, dtypes, zero-copy buffer views
    ("runtime",),  # launch queues, streams, generators, async errors
    ("compiler",),  # MLIR -> vmfb, per-target flags, the compile pool
    ("cache",),  # every cache layer, the compile service's client, the compile path
    ("lowering",),  # op calls and graphs -> MLIR
    ("dispatch",),  # the one entry point, op mode, the host path, shape recording
    ("adaptive", "dynamo", "kernel"),  # the modes over dispatch's entry point
    ("kernels",),  # the kernel library
    ("device", "profiler", "distributed", "service", "models", "libraries"),  # surfaces
    ("registration",),  # the composition root: registers the device, wires the layers
    ("torchneuron",),  # the public API
    ("demo", "eval", "vllm"),  # programs over the public API: the demo, the evaluation system, vLLM's platform
    ("cli",),
)

LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def modules() -> dict:
    """{module name: path} of every Python module of the package."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _exists(module: str, known: dict) -> bool:
    return module in known or module == "torchneuron._C"


def _source_of(node, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _longest_module(name: str, known: dict) -> str:
    parts = name.split(".")
    while parts and not _exists(".".join(parts), known):
        parts.pop()
    return ".".join(parts)


class Import(collections.namedtuple("Import", "source target line names")):
    """`source` imports `target` at `line`. `names`: (name, local name) of
    each name it takes; the local name only where the name is a module."""


def imports_of(module: str, tree, path: pathlib.Path, known: dict) -> list:
    """The package's modules one module's import statements name."""
    found = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torchneuron":
                    target = _longest_module(a.name, known)
                    found.append(Import(module, target, node.lineno, ((a.name, a.asname),)))
        elif isinstance(node, ast.ImportFrom):
            source = _source_of(node, module, is_package)
            if source.split(".")[0] != "torchneuron":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                if _exists(sub, known):
                    found.append(Import(module, sub, node.lineno, ((a.name, a.asname or a.name),)))
                else:
                    found.append(Import(module, _longest_module(source, known), node.lineno, ((a.name, None),)))
    return found


def imports() -> list:
    """Every import of a package module by a package module."""
    known = modules()
    found = []
    for module, path in known.items():
        found += imports_of(module, ast.parse(path.read_text(), str(path)), path, known)
    return found


def room_edges(found=None) -> dict:
    """{(room, room it imports): [Import, ...]} between different rooms."""
    edges = collections.defaultdict(list)
    for imp in found if found is not None else imports():
        a, b = room_of(imp.source), room_of(imp.target)
        if a != b:
            edges[(a, b)].append(imp)
    return dict(edges)


def cycles(edges) -> list:
    """Strongly connected groups of more than one node in a graph given as
    an iterable of (a, b) edges (Tarjan's algorithm)."""
    graph = collections.defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return groups


def picture(edges=None) -> str:
    """The layers from the top down, each room with the rooms it imports."""
    edges = room_edges() if edges is None else edges
    uses = collections.defaultdict(set)
    for a, b in edges:
        uses[a].add(b)
    lines = []
    for rooms in reversed(LAYERS):
        for room in rooms:
            below = sorted(uses[room], key=lambda r: (-LAYER_OF.get(r, -1), r))
            lines.append(f"{room:13s} -> {', '.join(below) if below else '(nothing of the package)'}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(picture())

"""The house stays straight: every import of src/ points down the layers
written in tests/layers.py, no cycle joins rooms or modules, no private name
crosses a room, and no module outgrows 1000 lines."""

import ast

import layers


def _where(imps) -> str:
    return "; ".join(f"{i.source}:{i.line} imports {i.target}" for i in imps)


def test_every_room_is_on_a_layer():
    rooms = {layers.room_of(m) for m in layers.modules()}
    assert rooms - set(layers.LAYER_OF) == set(), "add the new room to LAYERS in tests/layers.py"
    assert set(layers.LAYER_OF) - rooms - {"_C"} == set(), "LAYERS names a room that is gone"


def test_imports_point_down_the_layers():
    wrong = []
    for (a, b), imps in sorted(layers.room_edges().items()):
        if layers.LAYER_OF[b] > layers.LAYER_OF[a]:
            wrong.append(f"{a} (layer {layers.LAYER_OF[a]}) imports {b} (layer {layers.LAYER_OF[b]}): {_where(imps)}")
        elif layers.LAYER_OF[b] == layers.LAYER_OF[a]:
            wrong.append(f"{a} and {b} stand side by side: {_where(imps)}")
    assert wrong == [], "\n".join(wrong)


def test_no_cycle_between_rooms_or_modules():
    found = layers.imports()
    rooms = layers.cycles(layers.room_edges(found))
    modules = layers.cycles((i.source, i.target) for i in found if i.source != i.target
                            and not i.source.startswith(i.target + "."))  # a package's modules import their __init__
    assert rooms == [] and modules == [], f"rooms: {rooms}\nmodules: {modules}"


def test_the_checker_sees_a_wrong_import():
    # The checks above pass because the imports are right, not because they see nothing.
    fake = [layers.Import("torchneuron.runtime.queue", "torchneuron.dispatch.entry", 1, ()),
            layers.Import("torchneuron.dispatch.entry", "torchneuron.runtime.queue", 2, ())]
    assert list(layers.room_edges(fake)) == [("runtime", "dispatch"), ("dispatch", "runtime")]
    assert layers.cycles(layers.room_edges(fake)) == [["dispatch", "runtime"]]
    assert layers.LAYER_OF["dispatch"] > layers.LAYER_OF["runtime"]


def _private_uses(path, module) -> list:
    """Private names another room's module gives this one: `from x import _y`
    and `x._y` where x names a module of another room."""
    tree = ast.parse(path.read_text())
    known = layers.modules()
    other_room = {}
    found = []
    room = layers.room_of(module)
    for imp in layers.imports_of(module, tree, path, known):
        if layers.room_of(imp.target) == room:
            continue
        for name, bound in imp.names:
            if name.startswith("_") and not name.startswith("__") and name != "_C":
                found.append(f"{module}:{imp.line} takes {name} from {imp.target}")
            elif bound:
                other_room[bound] = imp.target
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in other_room
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{module}:{node.lineno} reads {other_room[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_room():
    found = []
    for module, path in layers.modules().items():
        found += _private_uses(path, module)
    assert found == [], "\n".join(found)


def test_no_module_over_1000_lines():
    long = {m: n for m, p in layers.modules().items() if (n := len(p.read_text().splitlines())) > 1000}
    assert long == {}

"""The import graph keeps its shape: rooms point one way, node's subpackages have floors, no circle.

Rooms: node → swarm → gossip → compression → protocol (an import may only point right). Inside
``node/``, a subpackage imports only from lower floors or from itself:

    cli → {zo, replica, pipeline, ops} → runtime → config → checkpoints → data → {errors, logs, node}

Kinds of node (zo, replica, pipeline) and the operators' tools (ops) never import each other; the
CLI is the one place that picks a kind. ``swarm.models`` imports only torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("node", "swarm", "gossip", "compression", "protocol")
ROOM_RANK = {room: i for i, room in enumerate(ROOMS)}  # may import rooms of a higher rank
NODE_FLOORS = {
    "node.cli": 6,
    "node.zo": 5, "node.replica": 5, "node.pipeline": 5, "node.ops": 5,
    "node.runtime": 4,
    "node.config": 3,  # validates against what a checkpoint holds
    "node.checkpoints": 2,  # an export writes the tokenizer of the data
    "node.data": 1,
    "node.errors": 0, "node.logs": 0, "node": 0, "node.__main__": 7,
}


def modules() -> dict[str, Path]:
    found = {}
    for room in ROOMS:
        for f in (ROOT / room).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = f
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every project module each module imports (function-level and TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def node_room(module: str) -> str:
    """The floor-table key of a node module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else module


def test_rooms_point_one_way() -> None:
    graph = imports(modules())
    wrong = [f"{m} imports {t}" for m, ts in graph.items() for t in ts
             if ROOM_RANK[t.split(".")[0]] < ROOM_RANK[m.split(".")[0]]]
    assert not wrong, "imports must point node → swarm → gossip → compression → protocol:\n" + "\n".join(wrong)


def test_node_subpackages_have_floors() -> None:
    graph = imports(modules())
    wrong = []
    for m, ts in graph.items():
        if not m.startswith("node"):
            continue
        here = node_room(m)
        assert here in NODE_FLOORS, f"{m}: a new room of node/ needs a floor in this test"
        for t in ts:
            there = node_room(t) if t.startswith("node") else None
            if there is None or there == here:
                continue
            if NODE_FLOORS[there] >= NODE_FLOORS[here]:
                wrong.append(f"{m} (floor {NODE_FLOORS[here]}) imports {t} (floor {NODE_FLOORS[there]})")
    assert not wrong, "node/ imports must point down a floor:\n" + "\n".join(wrong)


def test_models_import_only_torch() -> None:
    graph = imports(modules())
    wrong = [f"{m} imports {t}" for m, ts in graph.items() if m.startswith("swarm.models")
             for t in ts if not t.startswith("swarm.models")]
    assert not wrong, "swarm.models is a leaf: " + "; ".join(wrong)


def test_no_import_circle() -> None:
    graph = imports(modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_layering_check_can_fail() -> None:
    """The floor rule really rejects an upward arrow (a check that cannot fail checks nothing)."""
    assert NODE_FLOORS[node_room("node.runtime.base")] < NODE_FLOORS[node_room("node.replica.node")]
    assert node_room("node.config.loading") == "node.config" and node_room("node.data.bytes") == "node.data"

"""No module of extproc/ imports itself back, through any chain.

Read from the source (Python's `ast`), not by importing: every `import` / `from ... import`
of an extproc module counts, at the top of a file or inside a function (a lazy import that
closes a circle is still a circle: it only hides it until the call). Imports under
`if TYPE_CHECKING:` do not count (they never run). A package's `__init__` loading its own
submodules is not an edge (Python does that whatever the code says). The circles this broke:
telemetry.decision_log ↔ bench.traces, config.schema ↔ scheduling.registry ↔ config.diagnose,
agent.devices ↔ agent.nvml / agent.sim_gpu.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "extproc"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module name → the extproc modules it imports (generated protobuf code left out)."""
    files = {_module_name(p, package): p for p in package.rglob("*.py") if "_proto" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import submodule`
        # A module's own package (its __init__) is loaded by Python before it: not an edge.
        graph[name] = {d for d in deps if d in files and d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_a_circle(tmp_path: Path):
    pkg = tmp_path / "extproc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from extproc.sub import a\n")
    (pkg / "sub" / "a.py").write_text("from extproc.sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from extproc.d import x\n")
    (pkg / "d.py").write_text("from extproc import c\n")
    assert cycles(import_graph(pkg)) == [["extproc.sub.a", "extproc.sub.b"]]


def test_extproc_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules importing one another): " + "; ".join(" ↔ ".join(c) for c in found)


def test_runtime_telemetry_imports_no_benchmark_tooling():
    graph = import_graph()
    reached: set[str] = set()
    todo = [m for m in graph if m.startswith("extproc.telemetry")]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(graph[m])
    assert not {m for m in reached if m.startswith("extproc.bench")}

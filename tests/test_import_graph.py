"""The four layers' imports (issue #65): no cycle between our modules, counting imports inside
functions, and counting the package inits an import runs first."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("raggym", "envs", "actors", "experiments")


def our_modules() -> dict[str, Path]:
    modules = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(tree: ast.AST) -> set[str]:
    """Every absolute import anywhere in the file (module level, in functions, under TYPE_CHECKING)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours its imports execute: each imported module and the package
    inits above it (Python runs those first), except the importer's own packages, which are
    already running when it is."""
    graph = {}
    for name, path in modules.items():
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges = set()
        for target in imported_names(ast.parse(path.read_text(encoding="utf-8"))):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                module = ".".join(parts[:i])
                if module in modules and module != name and module not in own_packages:
                    edges.add(module)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_our_modules():
    assert cycles(import_graph(our_modules())) == []


def test_the_graph_sees_a_cycle_through_a_package_init_and_a_function_level_import(tmp_path):
    # the shape raggym.judge and raggym.rewards had: the judge imported a rewards module inside a
    # function, and the rewards package's init imports the module that imports the judge
    files = {"raggym/__init__.py": "", "raggym/judge.py": "def f():\n    from raggym.rewards.metrics import em\n",
             "raggym/rewards/__init__.py": "from raggym.rewards.lws import reward\n",
             "raggym/rewards/lws.py": "import raggym.judge\n", "raggym/rewards/metrics.py": "em = 1\n"}
    modules = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        parts = Path(rel).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    assert cycles(import_graph(modules)) == [["raggym.judge", "raggym.rewards", "raggym.rewards.lws"]]
    (tmp_path / "raggym/judge.py").write_text("from raggym.text_metrics import em\n", encoding="utf-8")
    assert cycles(import_graph(modules)) == []

"""Import direction and import circles, read from the source with `ast` (nothing is imported).

The rule is docs/layout.md's ("Imports run one way"): `dipaco/cli/` (the commands, their flags, quickstart) sits on top and calls every stage;
`sharding` and `eval` use `routing` and the core; `routing` uses the core; the core (the rest of `dipaco/`, its
subpackages included) never imports a stage. One more edge is established and kept: eval reads the tokenizer
through `dipaco.sharding.tokenizer` (eval/documents.py, eval/window_router.py), so eval stands above sharding and
sharding never imports eval. And dipaco/training/comm.py is the only file that imports torch.distributed; ray is
imported in three, all in dipaco/taskqueue/: ray_cluster.py (connecting, and the local Ray kept to 127.0.0.1, for
every engine that uses Ray), ray_engine.py (the training task queue) and ray_tasks.py (the shard stage's plain
retried tasks).

Every import counts, also one inside a function (a lazy import hides a circle from Python, not from a reader);
only imports under `if TYPE_CHECKING:` are left out, as they never run. Circles are refused between modules and
between packages (the folders right under dipaco/, a stage's subfolders counted as the stage): two packages that
import each other are one part in two folders, even when no two of their modules form a circle.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = "dipaco.cli"  # the package and everything in it
FLOORS = {"core": 0, "routing": 1, "sharding": 2, "eval": 3, "top": 4}  # a module imports its floor or below

# Circles that exist and are accepted for now (none: the test fails on any circle, and on a listed one that is gone)
KNOWN_CYCLES: set[frozenset[str]] = set()


def modules() -> dict[str, Path]:
    """{dotted name: file} of every project module, subpackages included, from pyproject's package-dir map."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in package_dir.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = f
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo += child.orelse
            else:
                todo.append(child)


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """({module: project modules it imports}, {module: every imported name, project or not})."""
    graph, raw = {}, {}
    for name, f in mods.items():
        targets, names = set(), set()
        package = name if f.stem == "__init__" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    names.add(alias.name)
                    parts = alias.name.split(".")
                    targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & mods.keys()
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package upwards
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names.add(base)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    names.add(full)
                    targets.add(full if full in mods else base)
        graph[name] = {t for t in targets if t in mods} - {name}
        raw[name] = names
    return graph, raw


def floor(module: str) -> str:
    if module == TOP or module.startswith(TOP + "."):
        return "top"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "core"


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_parser_sees_every_kind_of_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    files = {"pkg.a": "import pkg.b\nfrom pkg import c\n", "pkg.b": "def f():\n    from pkg.c import x\n",
             "pkg.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nfrom . import d\n",
             "pkg.d": "import torch.distributed as dist\n"}
    mods = {}
    for name, text in files.items():
        mods[name] = tmp_path / "pkg" / f"{name.split('.')[1]}.py"
        mods[name].write_text(text)
    graph, raw = imports(mods)
    assert graph == {"pkg.a": {"pkg.b", "pkg.c"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.d"}, "pkg.d": set()}
    assert "torch.distributed" in raw["pkg.d"]
    mods_cycle = dict(mods)
    (tmp_path / "pkg" / "d.py").write_text("def g():\n    import pkg.a\n")  # a lazy import closes a circle
    assert cycles(imports(mods_cycle)[0]) == [{"pkg.a", "pkg.b", "pkg.c", "pkg.d"}]


def test_imports_run_one_way():
    graph, _ = imports(modules())
    wrong = sorted(f"{m} ({floor(m)}) imports {t} ({floor(t)})" for m, ts in graph.items() for t in ts
                   if FLOORS[floor(t)] > FLOORS[floor(m)])
    assert not wrong, "imports against the layering (docs/layout.md, 'Imports run one way'):\n" + "\n".join(wrong)


def test_no_import_circles():
    graph, _ = imports(modules())
    found = {frozenset(c) for c in cycles(graph)}
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not new, f"import circles: {new}; break them (move the shared piece down a floor)"
    assert not gone, f"fixed, so remove from KNOWN_CYCLES in tests/test_imports.py: {gone}"
    assert not any("dipaco.config" in c for c in found)


def package(module: str, mods: dict[str, Path]) -> str:
    """The package a module belongs to: ``dipaco.<folder>`` for a folder right under dipaco/ (or a stage: routing,
    sharding, eval), with everything below it; ``dipaco`` for the files at the top."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    return top if len(parts) > 1 and mods.get(top, Path()).stem == "__init__" else parts[0]


def package_graph(graph: dict[str, set[str]], mods: dict[str, Path]) -> dict[str, set[str]]:
    """{package: the other packages its modules import}."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(package(m, mods), set()).update(package(t, mods) for t in targets)
    return {p: targets - {p} for p, targets in out.items()}


def test_a_package_circle_without_a_module_circle_is_seen(tmp_path):
    files = {"dipaco/__init__.py": "", "dipaco/config.py": "", "dipaco/a/__init__.py": "", "dipaco/b/__init__.py": "",
             "dipaco/a/x.py": "from dipaco.b import y\n", "dipaco/a/w.py": "import dipaco.config\n",
             "dipaco/b/y.py": "", "dipaco/b/z.py": "from dipaco.a.w import f\n"}
    mods = {}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
        name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        mods[name] = tmp_path / rel
    graph, _ = imports(mods)
    assert cycles(graph) == []
    assert package_graph(graph, mods) == {"dipaco": set(), "dipaco.a": {"dipaco", "dipaco.b"}, "dipaco.b": {"dipaco.a"}}
    assert cycles(package_graph(graph, mods)) == [{"dipaco.a", "dipaco.b"}]


def test_no_package_circles():
    mods = modules()
    graph, _ = imports(mods)
    found = [sorted(c) for c in cycles(package_graph(graph, mods))]
    edges = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts for c in found
                   if package(m, mods) in c and package(t, mods) in c and package(m, mods) != package(t, mods))
    assert not found, f"package circles {found}: " + "; ".join(edges) + " (move the shared piece into one of them)"


def test_config_imports_only_leaf_modules():
    """config.py is the bottom of the core: what it imports of the project imports nothing of the project."""
    graph, _ = imports(modules())
    assert all(not graph[t] or graph[t] == {"dipaco"} for t in graph["dipaco.config"]), graph["dipaco.config"]


def test_only_comm_imports_torch_distributed():
    _, raw = imports(modules())
    users = sorted(m for m, names in raw.items() if any(n == "torch.distributed" or n.startswith("torch.distributed.")
                                                        for n in names))
    assert users == ["dipaco.training.comm"], users


def longest_chain(graph: dict[str, set[str]], among: set[str]) -> list[str]:
    """The longest import chain among ``among`` (no circles, so it ends): its length is the number of floors."""
    memo: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in memo:
            memo[m] = [m] + max((chain(t) for t in sorted(graph[m] & among)), key=len, default=[])
        return memo[m]

    return max((chain(m) for m in sorted(among)), key=len, default=[])


def test_core_stands_on_at_most_six_floors():
    """A module that imports no other core module is on floor 1; one that imports floor-n modules is on n + 1."""
    graph, _ = imports(modules())
    chain = longest_chain(graph, {m for m in graph if floor(m) == "core"})
    assert len(chain) <= 6, f"dipaco/ stands on {len(chain)} floors: {' -> '.join(chain)}; flatten that chain"


def test_ray_is_imported_in_three_files_only():
    """Ray is an optional extra: ray_cluster.py connects (importing ray lazily, inside connect()), the train engine
    (ray_engine.py) and the shard stage's plain retried tasks (ray_tasks.py: a core file, so the stage hands it
    functions and it imports no stage) use it, and each engine is imported only by its one caller, for --engine ray."""
    _, raw = imports(modules())
    users = sorted(m for m, names in raw.items() if any(n == "ray" or n.startswith("ray.") for n in names))
    assert users == ["dipaco.taskqueue.ray_cluster", "dipaco.taskqueue.ray_engine", "dipaco.taskqueue.ray_tasks"], users
    graph, _ = imports(modules())
    importers = {engine: [m for m, ts in graph.items() if f"dipaco.taskqueue.{engine}" in ts]
                 for engine in ("ray_engine", "ray_tasks")}
    assert importers == {"ray_engine": ["dipaco.cli.train_engines"],  # lazily, for --engine ray
                         "ray_tasks": ["dipaco.sharding.engines"]}, importers
    tree = ast.parse((ROOT / "dipaco" / "taskqueue" / "ray_cluster.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("ray" == getattr(n, "module", None) or any(a.name.split(".")[0] == "ray" for a in n.names)
                   for n in top), "ray_cluster imports ray inside connect() only: importing it needs no Ray"

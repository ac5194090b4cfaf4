"""The package's import structure, read statically from the source (nothing is imported):
only ds_ppo/engine/ talks to DeepSpeed, and no two ds_ppo modules import each other."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ds_ppo"


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package's __init__.py
    under the package's own name)."""
    found = {}
    for f in sorted(package.rglob("*.py")):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = f
    return found


def _imports(name: str, file: Path) -> list[tuple[str, int]]:
    """(imported name, line) of every import statement in the file, at any depth (module level,
    inside functions, classes and `try` blocks); relative imports resolved to absolute names.
    `from X import n` yields X.n (which may be a module or a name inside X)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def deepspeed_imports(package: Path = PACKAGE) -> list[str]:
    """`file:line module` of every deepspeed import in a module outside ds_ppo/engine/."""
    bad = []
    for name, file in _modules(package).items():
        if name == "ds_ppo.engine" or name.startswith("ds_ppo.engine."):
            continue
        for target, line in _imports(name, file):
            if target.split(".")[0] == "deepspeed":
                bad.append(f"{file.relative_to(package.parent)}:{line} {target}")
    return bad


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """ds_ppo module -> the ds_ppo modules it imports (function-level imports included).
    `from X import n` is an edge to X.n when that is a module, else to X."""
    modules = _modules(package)
    graph = {}
    for name, file in modules.items():
        edges = set()
        for target, _ in _imports(name, file):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_only_the_engine_package_imports_deepspeed():
    """engine/__init__.py promises that nothing outside ds_ppo/engine/ imports deepspeed; any
    `import deepspeed` / `from deepspeed... import` elsewhere, even inside a function, breaks it."""
    assert deepspeed_imports() == []


def test_no_import_cycle_inside_ds_ppo():
    """No two ds_ppo modules import each other, directly or through others.

    Function-level (lazy) imports count as edges, not only module-level ones: a lazy import
    still makes one module depend on the other, and a cycle through one works only because of
    the order in which the functions happen to be called (say a checkpoint module exporting
    through an export module that reads the checkpoint module back). Imports under
    `if TYPE_CHECKING:` count as well: a cycle of type-only imports is still a tangle."""
    assert import_cycles(import_graph()) == []


def test_the_scans_see_lazy_imports(tmp_path):
    """The two scans are not vacuous: a function-local deepspeed import outside engine/ and a
    cycle of lazy imports in a small package are both found."""
    pkg = tmp_path / "ds_ppo"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("import deepspeed\n")
    (pkg / "engine" / "store.py").write_text("def save():\n    from ds_ppo import export\n")
    (pkg / "export.py").write_text(
        "def run():\n    from ds_ppo.engine.store import save\n"
        "    from deepspeed.utils import zero_to_fp32\n")
    (pkg / "util.py").write_text("from . import export\n")  # imports into the cycle, not in it
    assert deepspeed_imports(pkg) == ["ds_ppo/export.py:3 deepspeed.utils.zero_to_fp32"]
    assert import_cycles(import_graph(pkg)) == [["ds_ppo.engine.store", "ds_ppo.export"]]


def test_the_guides_system_section_names_files_that_exist():
    """docs/GUIDE.md "The system": every `file.py` / `package/` it names is there (a rename or a
    split that forgets the map fails here)."""
    import re

    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "GUIDE.md").read_text()
    section = guide[guide.index("\n## The system"):guide.index("\n## Tests")]
    names = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+(?:\.py|/))`", section))
    assert len(names) > 30, names
    missing = sorted(n for n in names if not (root / "ds_ppo" / n).exists()
                     and not (root / n).exists())
    assert not missing, missing


def layering_violations(package: Path = PACKAGE) -> list[str]:
    """`module -> import` pairs that break the layering:
    - ds_ppo.algo imports nothing but torch, the standard library and itself;
    - ds_ppo.ppo (the PPO stages) never imports ds_ppo.run (the run around a job);
    - ds_ppo.engine never imports the stages or the run (ppo, run)."""
    import sys

    bad = []
    for name, file in _modules(package).items():
        for target, line in _imports(name, file):
            top = target.split(".")[0]
            where = f"{file.relative_to(package.parent)}:{line} {target}"
            if name.startswith("ds_ppo.algo"):
                if top not in ("torch", "__future__") and top not in sys.stdlib_module_names \
                        and not target.startswith("ds_ppo.algo"):
                    bad.append(where)
            if name.startswith("ds_ppo.ppo") and target.startswith("ds_ppo.run"):
                bad.append(where)
            if name.startswith("ds_ppo.engine") and \
                    target.startswith(("ds_ppo.run", "ds_ppo.ppo")):
                bad.append(where)
    return bad


def test_the_layers_import_downwards_only():
    assert layering_violations() == []


def _package(root: Path, subpackages: tuple[str, ...]) -> Path:
    """An empty ds_ppo package under `root` with these subpackages, for the scans' own tests."""
    pkg = root / "ds_ppo"
    for sub in subpackages:
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    return pkg


def test_the_layering_scan_finds_violations(tmp_path):
    pkg = _package(tmp_path, ("algo", "ppo", "engine", "run"))
    (pkg / "algo" / "kl.py").write_text("import torch\nimport numpy\nfrom . import stats\n")
    (pkg / "ppo" / "update.py").write_text("def f():\n    from ds_ppo.run.loop import train\n")
    (pkg / "engine" / "roles.py").write_text("from ds_ppo.ppo import scoring\n")
    assert layering_violations(pkg) == ["ds_ppo/algo/kl.py:2 numpy",
                                        "ds_ppo/engine/roles.py:1 ds_ppo.ppo.scoring",
                                        "ds_ppo/ppo/update.py:2 ds_ppo.run.loop.train"]


def test_test_files_have_unique_names():
    """pytest imports test modules by their file name (no packages under tests/): two files of
    one name in different folders stop the run ("import file mismatch", under xdist a crashed
    worker)."""
    from collections import Counter

    names = Counter(p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1]


# The floors of the package, lowest first: a ds_ppo package or top-level module imports only
# from its own floor or below (docs/GUIDE.md "The system"). The jobs sit above the run that
# drives them, and the registry of jobs (jobs/) above the jobs' packages; engine sits below the
# reward sources and the planner, which may use it.
FLOORS = [
    {"", "algo", "role_names", "errors", "progress", "thread_pools", "http_deadline",
     "abandon", "redaction", "watchdog", "metric_names"},
    {"containers"},
    {"config"},
    {"data"},
    {"engine"},
    {"rewards", "envs"},
    {"metrics"},
    {"plan"},
    {"run"},
    {"ppo", "sft", "rm"},
    {"jobs"},
    {"trainer", "bench"},
    {"cli"},
    {"__main__"},
]
# `importer -> imported` package pairs allowed to go up a floor, each with its reason; empty
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


def _part(module: str) -> str:
    """ds_ppo.engine.roles -> engine; ds_ppo.cli -> cli; ds_ppo (its __init__) -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_edges(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package pairs -> the `module -> module` imports behind them, from
    the module graph (imports inside functions and under TYPE_CHECKING included)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in import_graph(package).items():
        for target in sorted(targets):
            a, b = _part(module), _part(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return edges


def package_layer_problems(package: Path = PACKAGE,
                           allowed: dict[tuple[str, str], str] | None = None) -> list[str]:
    """Packages that import each other, imports that go up a floor (outside `allowed`), parts
    without a floor, and allowed pairs that no longer occur (the list must not go stale)."""
    allowed = UPWARD_ALLOWED if allowed is None else allowed
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    edges = package_edges(package)
    problems = [f"{a} <-> {b}: {edges[(a, b)][0]}; {edges[(b, a)][0]}"
                for a, b in sorted(edges) if a < b and (b, a) in edges]
    parts = {_part(m) for m in _modules(package)}
    problems += [f"{p}: no floor in FLOORS" for p in sorted(parts - floor.keys())]
    problems += [f"{a} -> {b} goes up a floor: {edges[(a, b)][0]}" for a, b in sorted(edges)
                 if a in floor and b in floor and floor[b] > floor[a] and (a, b) not in allowed]
    problems += [f"{a} -> {b} is allowed but no longer imported" for a, b in sorted(allowed)
                 if (a, b) not in edges]
    return problems


def test_packages_import_down_only():
    """At the package level too (file-level cycles are 0 even where two packages import each
    other): no pair of packages imports each other, and no import goes up a floor."""
    assert package_layer_problems() == []


def test_the_package_scan_finds_an_upward_import(tmp_path):
    """The scan is not vacuous: an import from engine up into plan inside a function, a pair of
    packages importing each other, a part with no floor and a stale allowance are all found."""
    pkg = _package(tmp_path, ("engine", "plan", "config", "data"))
    (pkg / "plan" / "phases.py").write_text("from ds_ppo.engine import forward\n")
    (pkg / "engine" / "forward.py").write_text("def f():\n    from ds_ppo.plan import job\n")
    (pkg / "plan" / "job.py").write_text("")
    (pkg / "config" / "checks.py").write_text("from ds_ppo.data import rows\n")
    (pkg / "data" / "rows.py").write_text("")
    (pkg / "newpart.py").write_text("")
    assert package_layer_problems(pkg, {("data", "rm"): "stale"}) == [
        "engine <-> plan: ds_ppo.engine.forward -> ds_ppo.plan.job; "
        "ds_ppo.plan.phases -> ds_ppo.engine.forward",
        "newpart: no floor in FLOORS",
        "config -> data goes up a floor: ds_ppo.config.checks -> ds_ppo.data.rows",
        "engine -> plan goes up a floor: ds_ppo.engine.forward -> ds_ppo.plan.job",
        "data -> rm is allowed but no longer imported"]


def tools_problems(tools: Path = PACKAGE.parent / "tools") -> list[str]:
    """The maintainers' measurement scripts import the installed package: no `sys.path` edit,
    no import of the tests' modules (conftest, support)."""
    bad = []
    for file in sorted(tools.glob("*.py")):
        text = file.read_text()
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{file.name}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in ("conftest", "support")]
        bad += [f"{file.name}: edits sys.path" for _ in [1] if "sys.path." in text]
    return bad


def test_tools_import_the_package_not_the_tests(tmp_path):
    assert tools_problems() == []
    (tmp_path / "measure_x.py").write_text(
        "import sys\nsys.path.insert(0, 'tests')\nfrom support.rollouts import fake\n")
    assert tools_problems(tmp_path) == ["measure_x.py:3 imports support.rollouts",
                                        "measure_x.py: edits sys.path"]

"""Layering: who imports whom, read from the source (every import statement, lazy ones included).

* the core (`hicache_gds`) never imports an engine adapter or the engine it adapts to
  (`hicache_gds_sglang`, `hicache_gds_vllm`, `sglang`, `vllm`): adapters sit on top;
* an adapter (`hicache_gds_sglang`, `hicache_gds_vllm`) imports of the core only its public
  namespace `hicache_gds` (what its `__all__` lists) and the conformance helpers
  `hicache_gds.testing`: the store's internals (its index, slabs, engine) are the store's;
* no import circles, except the ones listed in `KNOWN_CIRCLES` (each with its owner's reason);
* none between the core's parts either (`hicache_gds.store`, `hicache_gds.index`, ... and each
  top-level module such as `hicache_gds.config`): each part sits above or below another, never both;
* none between the benchmark scripts (`benchmarks/`, `benchmarks/e2e/`, which import each other by
  file name);
* no file of the core longer than `MAX_CORE_LINES` (one implementation per file: a longer one is
  split along a seam).

Imports under ``if TYPE_CHECKING:`` count too: a circle that exists only for the type checker is
still a circle in the design.
"""

from __future__ import annotations

import ast
import os
from typing import Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"hicache_gds": ROOT, "hicache_gds_sglang": os.path.join(ROOT, "plugins", "sglang"),
            "hicache_gds_vllm": os.path.join(ROOT, "plugins", "vllm")}
ADAPTERS = ("hicache_gds_sglang", "hicache_gds_vllm", "sglang", "vllm")
KNOWN_CIRCLES: list[set[str]] = []  # none today; an entry needs its owner's reason beside it
MAX_CORE_LINES = 500
BENCH_DIRS = ("benchmarks", os.path.join("benchmarks", "e2e"))


def _modules() -> dict[str, str]:
    """Module name -> source path for every module of the three packages."""
    out = {}
    for pkg, base in PACKAGES.items():
        for d, _dirs, files in os.walk(os.path.join(base, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), base)[:-3].replace(os.sep, ".")
                    out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """Every module `name` imports, resolved to absolute names (submodules of `from X import y` too)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts if is_pkg else parts[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names} & known
            out |= subs
            if len(subs) < len(node.names):  # names taken from `mod` itself, not only its submodules
                out.add(mod)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan), in-repo edges only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in graph or w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_core_never_imports_an_adapter_or_its_engine(graph):
    bad = sorted((m, i) for m, imps in graph.items() if m.split(".")[0] == "hicache_gds"
                 for i in imps if i.split(".")[0] in ADAPTERS)
    assert not bad, f"core modules importing adapters or SGLang/vLLM: {bad}"


def _adapter_imports_of_the_core(path: str) -> list[tuple[int, str]]:
    """(line, what) for every import in `path` of the core beyond `hicache_gds` and `hicache_gds.testing`,
    names taken from `hicache_gds` outside its `__all__` included."""
    import hicache_gds
    public = set(hicache_gds.__all__)
    bad = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            bad += [(node.lineno, n) for n in names if n.split(".")[0] == "hicache_gds" and n != "hicache_gds"
                    and not (n + ".").startswith("hicache_gds.testing.")]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "hicache_gds":
            mod = node.module or ""
            if mod == "hicache_gds":
                bad += [(node.lineno, f"hicache_gds.{a.name}") for a in node.names if a.name not in public]
            elif not (mod + ".").startswith("hicache_gds.testing."):
                bad.append((node.lineno, mod))
    return sorted(bad)


def test_adapters_import_only_the_public_package_and_its_testing_helpers():
    mods = _modules()
    bad = {p: b for m, p in mods.items() if m.split(".")[0] in ("hicache_gds_sglang", "hicache_gds_vllm")
           for b in [_adapter_imports_of_the_core(p)] if b}
    assert not bad, f"adapters reaching past the public API (`hicache_gds` and `hicache_gds.testing`): {bad}"


def test_the_adapter_rule_catches_a_reach_around(tmp_path):
    p = tmp_path / "adapter.py"
    p.write_text("import hicache_gds\nfrom hicache_gds import PageStore, open_store\n"
                 "from hicache_gds.testing.cases import Case\n"
                 "def f():\n    from hicache_gds.index import Index\n    import hicache_gds.slabs.capacity\n"
                 "from hicache_gds import _nixl\n")
    assert [w for _, w in _adapter_imports_of_the_core(str(p))] == ["hicache_gds.index", "hicache_gds.slabs.capacity",
                                                                    "hicache_gds._nixl"]


def test_no_import_circles_but_the_known_ones(graph):
    circles = _circles(graph)
    unknown = [sorted(c) for c in circles if c not in KNOWN_CIRCLES]
    assert not unknown, f"import circles: {unknown}"


@pytest.mark.parametrize("a,b", [("hicache_gds.engines.gds_probe", "hicache_gds.engines.nixl_file"),
                                 ("hicache_gds_vllm.spec", "hicache_gds_vllm.manager"),
                                 ("hicache_gds_vllm.spec", "hicache_gds_vllm.worker")])
def test_named_pairs_import_one_way_at_most(graph, a, b):
    assert not (b in graph[a] and a in graph[b]), f"{a} and {b} import each other"


def test_the_graph_sees_lazy_and_relative_imports(graph):
    # The reader of this test's results depends on it: a function-level relative import is an edge.
    assert "hicache_gds.engines.cufile_env" in graph["hicache_gds.engines.gds_probe"]
    assert "hicache_gds.bench.jobs" in graph["hicache_gds.bench.runner"]  # `from .jobs import ...` in a method


@pytest.mark.parametrize("module", ["hicache_gds/engines/select.py", "hicache_gds/tools/doctor.py",
                                    "hicache_gds/engines/diagnose.py",
                                    "hicache_gds/bench/runner.py", "hicache_gds/bench/cli.py"])
def test_engine_choice_and_diagnosis_never_name_an_engine(module):
    """`auto`, `doctor` and the benchmark's engine checks go by declared traits: no engine name is
    compared with, listed, or passed as an argument there (so a new engine needs no edit there).
    (A subscript such as ``rep["cufile"]``, the cufile.json section, is not an engine name.)"""
    from hicache_gds.engines import registry
    tree = ast.parse(open(os.path.join(ROOT, module)).read())
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            used += [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            used += node.elts
        elif isinstance(node, ast.Call):
            used += [*node.args, *(k.value for k in node.keywords)]
    named = sorted({n.value for n in used if isinstance(n, ast.Constant) and n.value in registry})
    assert not named, f"{module} names engines {named}"


def test_importing_the_package_and_its_testing_helpers_imports_no_pytest():
    import subprocess
    import sys
    code = ("import sys, hicache_gds, hicache_gds.testing, hicache_gds.testing.targets, hicache_gds.testing.cases; "
            "assert 'pytest' not in sys.modules, 'pytest imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_core_file_is_longer_than_500_lines():
    long = {}
    for d, _dirs, files in os.walk(os.path.join(ROOT, "hicache_gds")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    n = sum(1 for _ in fh)
                if n > MAX_CORE_LINES:
                    long[os.path.relpath(os.path.join(d, f), ROOT)] = n
    assert not long, f"core files over {MAX_CORE_LINES} lines (split each along a seam): {long}"


def _part(module: str) -> str:
    """The part of the core a module belongs to: its top-level subpackage (`hicache_gds.store` for
    `hicache_gds.store.mover`), or itself for a top-level module; `hicache_gds` for the package's
    own `__init__`."""
    return ".".join(module.split(".")[:2])


def _parts_graph(graph: dict[str, set[str]], top: str = "hicache_gds") -> dict[str, set[str]]:
    """`graph` folded onto the parts of package `top`: part -> the other parts its modules import."""
    out: dict[str, set[str]] = {}
    for m, imps in graph.items():
        if m.split(".")[0] == top:
            out.setdefault(_part(m), set()).update(_part(i) for i in imps if i.split(".")[0] == top)
    for p, deps in out.items():
        deps.discard(p)
    return out


def test_no_import_circles_between_the_cores_parts(graph):
    circles = _circles(_parts_graph(graph))
    assert not circles, (f"parts of the core that import each other, directly or around a circle (move the shared "
                         f"piece to the lower one, or above both): {[sorted(c) for c in circles]}")


def _script_graph(root: str, dirs: Sequence[str]) -> dict[str, set[str]]:
    """Scripts that import each other by file name (their folders on sys.path): path -> the paths it
    imports, every import statement counted. A name is looked up in the importer's folder first."""
    files = {d: {f[:-3]: os.path.join(d, f) for f in sorted(os.listdir(os.path.join(root, d))) if f.endswith(".py")}
             for d in dirs}
    out: dict[str, set[str]] = {}
    for d, mods in files.items():
        for rel in mods.values():
            names = set()
            for node in ast.walk(ast.parse(open(os.path.join(root, rel)).read(), rel)):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names.add(node.module.split(".")[0])
            order = [d] + [x for x in dirs if x != d]
            out[rel] = {next(files[x][n] for x in order if n in files[x]) for n in names
                        if any(n in files[x] for x in order)} - {rel}
    return out


def test_no_import_circles_between_the_benchmark_scripts():
    circles = _circles(_script_graph(ROOT, BENCH_DIRS))
    assert not circles, f"benchmark scripts that import each other: {[sorted(c) for c in circles]}"


def test_the_circle_checks_catch_a_circle_between_parts_and_between_scripts(tmp_path):
    # A lazy import up from a lower part is an edge like any other (index -> slabs -> index).
    graph = {"hicache_gds.index.index": {"hicache_gds.slabs.owners"}, "hicache_gds.slabs.owners": set(),
             "hicache_gds.slabs.namespaces": {"hicache_gds.index"}, "hicache_gds.index": {"hicache_gds.index.index"},
             "hicache_gds.config": {"hicache_gds.errors"}, "hicache_gds.errors": set()}
    assert [sorted(c) for c in _circles(_parts_graph(graph))] == [["hicache_gds.index", "hicache_gds.slabs"]]
    (tmp_path / "e2e").mkdir()
    (tmp_path / "a.py").write_text("import os\nfrom b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    import e2elib\n")
    (tmp_path / "e2e" / "e2elib.py").write_text("import a\n")
    (tmp_path / "e2e" / "b.py").write_text("")  # the importer's own folder first: a.py's `b` is ./b.py
    g = _script_graph(str(tmp_path), (".", "e2e"))
    assert [sorted(c) for c in _circles(g)] == [["./a.py", "./b.py", "e2e/e2elib.py"]]

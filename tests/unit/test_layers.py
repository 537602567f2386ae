"""The import layers, read from the source with ``ast`` (nothing is imported or executed).

The one place the allowed order is written (docs/architecture.md describes it): chunking and consensus
at the bottom, then the wire contract, then the server and the client side by side, then the
worker, then deploy. A module may import its own layer and the layers below it; the server
reaches the client stack through one peer-client factory only; no product code imports
``tests`` or ``bench``; the ``bench`` scripts may use any product layer but not ``tests`` (what
they share with the tests lives in the product, e.g. ``deploy.devcluster``); no two modules
import each other, directly or through others.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("chunking", "consensus", "paramserver", "worker", "deploy")

# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "chunking": set(),
    "consensus": set(),
    "paramserver.wire": {"chunking", "consensus"},
    "paramserver.server": {"chunking", "consensus", "paramserver.wire"},
    "paramserver.client": {"chunking", "consensus", "paramserver.wire"},
    "worker": {"chunking", "consensus", "paramserver.wire", "paramserver.client"},
    "deploy": {"chunking", "consensus", "paramserver.wire", "paramserver.server", "paramserver.client", "worker"},
}
# The server's one way into the client stack: its peer clients (channels, ParamServerClient).
PEER_FACTORY = ("paramserver.server.cluster", {"paramserver.client.rpc", "paramserver.client.channel"})
# The package's own entry points sit with the server.
TOP = {"paramserver": "paramserver.server", "paramserver.__main__": "paramserver.server"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    if module in TOP:
        return TOP[module]
    for sub in ("paramserver.wire", "paramserver.server", "paramserver.client"):
        if module == sub or module.startswith(sub + "."):
            return sub
    head = module.split(".")[0]
    if head in ("tests", "bench"):
        return head
    return head if head in PACKAGES else None


def imports(path: Path) -> Iterator[tuple[str, int]]:
    """Absolute module names ``path`` imports (relative imports resolved), with line numbers."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:  # "from pkg import module" imports the module
                yield f"{target}.{alias.name}", node.lineno


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def bench_modules() -> dict[str, Path]:
    return {module_name(p): p for p in (ROOT / "bench").rglob("*.py")}


def graph(modules: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """``module -> {imported module: line}`` for ``modules`` (default: the product), keeping the
    edges to product modules and to tests/ and bench/."""
    product = product_modules()
    out: dict[str, dict[str, int]] = {}
    for name, path in (product if modules is None else modules).items():
        deps: dict[str, int] = {}
        for target, line in imports(path):
            if target in product or layer_of(target) in ("tests", "bench"):
                deps.setdefault(target, line)
        out[name] = deps
    return out


def violations(edges: dict[str, dict[str, int]], paths: dict[str, Path]) -> list[str]:
    bad: list[str] = []
    for module, deps in sorted(edges.items()):
        mine = layer_of(module)
        assert mine is not None
        for target, line in sorted(deps.items()):
            theirs = layer_of(target)
            where = f"{paths[module].relative_to(ROOT)}:{line}: {module} imports {target}"
            if mine == "bench":
                if theirs == "tests":
                    bad.append(f"{where} (bench/ scripts must not import tests/: move what they share into the product)")
                continue
            if theirs in ("tests", "bench"):
                bad.append(f"{where} (product code must not import {theirs}/)")
            elif theirs is None or theirs == mine:
                continue
            elif mine == "paramserver.server" and theirs == "paramserver.client":
                factory, allowed = PEER_FACTORY
                if module != factory or target not in allowed:
                    bad.append(f"{where} (the server reaches the client stack only through {factory})")
            elif theirs not in ALLOWED[mine]:
                bad.append(f"{where} ({mine} may import only {', '.join(sorted(ALLOWED[mine])) or 'itself'})")
    return bad


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in edges:
                continue
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _without_parents(edges: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    # "import a.b.c" runs a/__init__ and a/b/__init__ too; those thin inits import nothing, so an
    # edge to a package's __init__ from inside it is not a cycle worth reporting.
    return {m: {t: ln for t, ln in deps.items() if not m.startswith(t + ".")} for m, deps in edges.items()}


def test_imports_only_go_down_the_layers() -> None:
    edges = graph()
    bad = violations(edges, product_modules())
    assert not bad, "imports that go up a layer or sideways:\n" + "\n".join(bad)


def test_bench_scripts_do_not_import_tests() -> None:
    modules = bench_modules()
    assert modules, "no bench/ scripts found"
    bad = violations(graph(modules), modules)
    assert not bad, "bench/ imports of tests/:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    found = cycles(_without_parents(graph()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_catches_what_it_should(tmp_path: Path) -> None:
    """The rules on a made-up graph: an upward import, a server->client import outside the
    factory, an import of tests/ (from product code and from a bench script), and a cycle are
    each reported; a bench script may import any product layer."""
    edges = {
        "chunking.a": {"worker.loader": 3},
        "paramserver.server.store": {"paramserver.client.pull": 5},
        "paramserver.server.cluster": {"paramserver.client.rpc": 7},
        "worker.loader": {"tests.helpers": 9, "paramserver.client.session": 10},
        "paramserver.client.session": {"paramserver.client.fetch": 1},
        "paramserver.client.fetch": {"paramserver.client.session": 2},
        "tests.helpers": {},
        "bench.bench_x": {"deploy.local": 1, "worker.loader": 2},
        "bench.bench_y": {"tests.integration.consensus_harness": 4},
    }
    paths = {m: ROOT / (m.replace(".", "/") + ".py") for m in edges}
    bad = violations({m: d for m, d in edges.items() if not m.startswith("tests")}, paths)
    assert any("chunking.a imports worker.loader" in b for b in bad)
    assert any("paramserver.server.store imports paramserver.client.pull" in b for b in bad)
    assert not any("paramserver.server.cluster imports" in b for b in bad)
    assert any("tests.helpers" in b for b in bad)
    assert not any("bench.bench_x" in b for b in bad)
    assert any("bench.bench_y imports tests.integration.consensus_harness" in b for b in bad)
    assert cycles(edges) == [["paramserver.client.fetch", "paramserver.client.session"]]

"""The packages by floor (issue 31, docs/ARCHITECTURE.md "Floors"): every project import,
at module level and inside functions, read with `ast` from the source (nothing imported).

- Each unit (a package, or one of the few leaf modules named in LEAVES) imports only the
  units FLOORS allows it: no lower floor imports a higher one.
- The units' import graph has no cycle.
- No function-local import of a project module in the product floors, except those in
  LAZY, each with its reason (an optional heavy dependency loaded on first use). The top
  floor (cli/, benchmarks/) may import lazily: a command loads torch and the engine only
  when it runs, so `mooncake --help` stays light.

`if TYPE_CHECKING:` imports are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> dotted package (pyproject's package-dir)
SOURCES = {"mooncaked": "mooncaked", "kernels": "mooncaked.kernels", "cli": "mooncaked.cli",
           "benchmarks": "mooncaked.benchmarks"}

# Leaf modules that are a floor of their own, below the package they live in: plain data
# and pure functions that every floor shares (they import nothing of the project above
# the base floor).
LEAVES = {
    "mooncaked.engine.types": "types",     # requests, sampling params, outputs
    "mooncaked.store.keys": "types",       # chained block keys, the engine's and the store's
    "mooncaked.store.types": "types",      # store results, locations, events
}
# Top-level modules of mooncaked/ that are not on the base floor.
APP_MODULES = {"mooncaked.daemon", "mooncaked.profile"}

# unit -> the units it may import (besides itself), bottom to top.
FLOORS: dict[str, set[str]] = {
    "base": set(),                     # config, log, lograte, utils, measures, failpoints,
                                       # roles, shutdown, stall_metrics, pdeathsig, ports
    "types": {"base"},
    "kernels": {"base"},
    "model": {"base", "types", "kernels"},
    "transfer": {"base"},
    "engine": {"base", "types", "kernels", "model"},
    "wire": {"base", "types"},
    "store": {"base", "types", "transfer", "wire"},
    "coord": {"base", "wire"},
    "conductor": {"base", "types", "wire"},
    "api": {"base", "types", "engine"},
    "sim": {"base", "types", "conductor"},
    "replay": {"base"},
    "cluster": {"base", "types", "kernels", "model", "transfer", "engine", "wire", "store",
                "coord", "conductor", "api"},
    "app": {"base", "types", "kernels", "model", "transfer", "engine", "wire", "store",
            "coord", "conductor", "api", "cluster"},
    "benchmarks": {"base", "types", "kernels", "model", "transfer", "engine", "wire", "store",
                   "coord", "conductor", "api", "cluster", "app", "sim", "replay"},
    "cli": {"base", "types", "kernels", "model", "transfer", "engine", "wire", "store",
            "coord", "conductor", "api", "cluster", "app", "sim", "replay", "benchmarks"},
}
TOP_FLOOR = {"cli", "benchmarks"}      # may import inside functions (see the module doc)

# (importing module, imported module) -> why it is imported inside a function.
LAZY = {
    ("mooncaked.kernels", "mooncaked.kernels.cpu_ops"): "numba, on first CPU kernel use",
    ("mooncaked.kernels", "mooncaked.kernels.triton_ops"): "triton, optional (CUDA only)",
    ("mooncaked.kernels.bench", "mooncaked.kernels.triton_ops"): "triton, optional",
    ("mooncaked.model.fused", "mooncaked.kernels.cpu_gemv"): "numba (the fused CPU decode step)",
    ("mooncaked.model.fused", "mooncaked.kernels.cpu_fused_decode"): "numba",
    ("mooncaked.model.fused", "mooncaked.kernels.cpu_gemm"): "numba (the int8 prompt GEMM)",
    ("mooncaked.engine.model_runner", "mooncaked.kernels.jit_watch"): "numba (the CPU warm-up's compile count)",
    ("mooncaked.coord.factory", "mooncaked.coord.etcd"): "aetcd + grpc (~0.4 s), etcd only",
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__)."""
    mods = {}
    for folder, pkg in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = (path, path.name == "__init__.py")
    return mods


MODULES = _modules()


def unit(mod: str) -> str:
    """The floor unit of a dotted module name."""
    if mod in LEAVES:
        return LEAVES[mod]
    if mod in APP_MODULES:
        return "app"
    parts = mod.split(".")
    if len(parts) == 1 or (len(parts) == 2 and not MODULES.get(mod, (None, True))[1]):
        return "base"                  # mooncaked/__init__ and its top-level modules
    return parts[1]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    """The project modules an ImportFrom names (a `from pkg import module` names the
    module; `from pkg import name` the package)."""
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def imports() -> list[tuple[str, str, int, bool]]:
    """Every project import: (importing module, imported module, line, inside a function)."""
    found = []
    for mod, (path, is_pkg) in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        local = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local.update(id(n) for n in ast.walk(fn))
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(mod, is_pkg, node)
            else:
                continue
            for t in targets:
                if t != "mooncaked" and not t.startswith("mooncaked."):
                    continue
                while t not in MODULES and "." in t:
                    t = t.rsplit(".", 1)[0]
                found.append((mod, t, node.lineno, id(node) in local))
    return found


IMPORTS = imports()


def test_the_import_reader_sees_the_project():
    # the walk found the packages and reads both kinds of import
    assert {"mooncaked.wire.rpc", "mooncaked.coord.factory", "mooncaked.cluster.cpp.cpp_node",
            "mooncaked.kernels", "mooncaked.cli.main"} <= MODULES.keys()
    assert ("mooncaked.store.remote", "mooncaked.wire.rpc") in {(a, b) for a, b, _, _ in IMPORTS}
    assert any(lazy for a, b, _, lazy in IMPORTS if a == "mooncaked.coord.factory")
    assert unit("mooncaked.config") == "base" and unit("mooncaked.daemon") == "app"
    assert unit("mooncaked.engine.types") == "types" and unit("mooncaked.cluster.cpp") == "cluster"


def test_every_unit_has_a_floor():
    units = {unit(m) for m in MODULES}
    assert units <= FLOORS.keys(), f"units without a row in FLOORS: {units - FLOORS.keys()}"


def test_no_floor_imports_a_higher_one():
    bad = sorted(f"{a}:{line} imports {b} ({unit(a)} -> {unit(b)})"
                 for a, b, line, _ in IMPORTS
                 if unit(a) != unit(b) and unit(b) not in FLOORS[unit(a)])
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_no_cycle_between_units():
    edges: dict[str, set[str]] = {}
    for a, b, _, _ in IMPORTS:
        if unit(a) != unit(b):
            edges.setdefault(unit(a), set()).add(unit(b))
    for u, allowed in FLOORS.items():     # the table itself is a DAG
        edges.setdefault(u, set()).update(allowed)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(edges.get(u, ())):
            assert state.get(v) != 1, "cycle: " + " -> ".join(path[path.index(v):] + [v])
            if v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u)


def test_no_function_local_import_outside_the_allowed_list():
    bad = sorted(f"{a}:{line} imports {b} inside a function"
                 for a, b, line, lazy in IMPORTS
                 if lazy and unit(a) not in TOP_FLOOR and (a, b) not in LAZY)
    assert not bad, ("function-local imports of project modules (hoist them, or add them "
                     "to LAZY with the heavy optional dependency they defer):\n"
                     + "\n".join(bad))
    used = {(a, b) for a, b, _, lazy in IMPORTS if lazy}
    assert not LAZY.keys() - used, f"stale LAZY entries: {sorted(LAZY.keys() - used)}"

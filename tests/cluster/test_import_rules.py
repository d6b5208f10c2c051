"""The house's rules, checked on the code: every import arrow points the allowed way, and the
tests mirror the source (the last two tests).

- ``router.kv`` (the shared kernel: key, events, ledger, tiers, stats) imports nothing else of
  orchard;
- the rest of ``router`` imports the kernel and ``router``, never ``workers`` or ``cluster``;
- ``workers`` imports the kernel and ``workers``, never the rest of ``router`` or ``cluster``;
- ``cluster`` imports all three, its rooms in one direction (below);
- tools (``router.sim``, ``workers.lab``, ``cluster.bench``) import anything; nothing that
  serves imports a tool, nor the command line (``cluster.commands``, ``cluster.cli``).

Inside ``cluster`` a room imports only rooms listed before it::

    config, rundir, tls  <  telemetry  <  backend  <  jobs  <  api  <  report  <  daemon
"""
from __future__ import annotations

from tests.support.paths import REPO

import ast
from pathlib import Path

ROOT = REPO
TOOLS = ("router.sim", "workers.lab", "cluster.bench")
ENTRY = ("cluster.commands", "cluster.cli")
CLUSTER_ORDER = ("cluster.config", "cluster.config_checks", "cluster.rundir", "cluster.tls",
                 "cluster.telemetry",
                 "cluster.backend", "cluster.jobs", "cluster.api", "cluster.report",
                 "cluster.daemon")
BASE_ROOMS = 4  # config (with its checks), rundir and tls import one another freely


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("router", "workers", "cluster"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in ("router", "workers", "cluster")}


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _cluster_room(module: str) -> tuple[str, int] | None:
    """The module's room inside ``cluster`` and its rank (the base rooms share one)."""
    for rank, room in enumerate(CLUSTER_ORDER):
        if _within(module, (room,)):
            return room, max(rank, BASE_ROOMS - 1)
    return None


def wrong_way(importer: str, imported: str, known: set[str]) -> str | None:
    """Why ``importer`` may not import ``imported`` (None: it may)."""
    if imported not in known and imported.rsplit(".", 1)[0] in known:
        imported = imported.rsplit(".", 1)[0]  # ``from pkg import name``: a name, not a module
    if imported not in known or _within(importer, TOOLS + ENTRY):
        return None
    if _within(imported, TOOLS):
        return "serving code imports a tool"
    if _within(imported, ENTRY):
        return "serving code imports the command line"
    if _within(importer, ("router.kv",)):
        return None if _within(imported, ("router.kv",)) else "the kernel imports outside it"
    if _within(importer, ("router",)):
        return None if _within(imported, ("router",)) else "router imports workers or cluster"
    if _within(importer, ("workers",)):
        if _within(imported, ("workers", "router.kv")):
            return None
        return "workers imports router beyond the kernel, or cluster"
    mine, theirs = _cluster_room(importer), _cluster_room(imported)
    if mine is not None and theirs is not None and theirs[1] > mine[1]:
        return f"{mine[0]} sits below {theirs[0]}"
    return None


def test_every_import_points_the_allowed_way():
    modules = _modules()
    known = set(modules)
    bad = sorted({f"{m} -> {i.rsplit('.', 1)[0] if i not in known else i}: {why}"
                  for m, path in modules.items() for i in _imports(path)
                  if (why := wrong_way(m, i, known))})
    assert bad == []


def test_the_rule_catches_each_kind_of_wrong_arrow():
    known = {"router.kv.key", "router.policy", "router.sim.simulator", "workers.engine.engine",
             "workers.lab.verify", "cluster.api.edge", "cluster.backend.local",
             "cluster.config", "cluster.tls", "cluster.commands.up", "cluster.bench.api"}
    assert wrong_way("router.kv.key", "router.policy", known) == "the kernel imports outside it"
    assert wrong_way("router.policy", "workers.engine.engine", known) == (
        "router imports workers or cluster")
    assert wrong_way("workers.engine.engine", "router.policy", known) == (
        "workers imports router beyond the kernel, or cluster")
    assert wrong_way("workers.engine.engine", "workers.lab.verify", known) == (
        "serving code imports a tool")
    assert wrong_way("cluster.backend.local", "cluster.api.edge", known) == (
        "cluster.backend sits below cluster.api")
    assert wrong_way("cluster.api.edge", "cluster.commands.up", known) == (
        "serving code imports the command line")
    assert wrong_way("cluster.config", "cluster.tls", known) is None
    assert wrong_way("cluster.config", "cluster.api.edge", known) == (
        "cluster.config sits below cluster.api")
    assert wrong_way("router.sim.simulator", "workers.engine.engine", known) is None
    assert wrong_way("cluster.bench.api", "cluster.commands.up", known) is None
    assert wrong_way("workers.engine.engine", "router.kv.key", known) is None


def test_no_test_module_imports_another():
    """Tests mirror the source; what several test modules share lives in ``tests/support/``:
    no test module imports another (a test file, moved or split, breaks nothing else). A
    module may name itself, as a process it starts does (``test_blas.py``'s probe)."""
    wrong = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            wrong += [f"{own} imports {n}" for n in names
                      if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_")
                      and n != own]
    assert wrong == []


# Test files named for a behaviour that crosses modules, each with the module it enters by,
# and the checks of the whole repository.
NOT_MIRRORS = {
    "tests/cluster/jobs/test_cache_diagnosis.py": "cluster/jobs/direct.py",
    "tests/workers/cache/test_identity.py": "workers/cache/store.py",
    "tests/cluster/test_docs_limits.py": None, "tests/cluster/test_import_rules.py": None,
    "tests/cluster/test_one_source.py": None, "tests/cluster/test_proto.py": None,
}


def test_every_module_has_its_tests_and_every_test_file_its_module():
    """``<room>/<module>.py``'s tests are ``tests/<room>/test_<module>.py``: a newcomer finds a
    module's tests by its name, and a test file's module by its own."""
    modules = [p for top in ("router", "workers", "cluster", "infra")
               for p in sorted((ROOT / top).rglob("*.py")) if p.name != "__init__.py"]
    untested = [str(p.relative_to(ROOT)) for p in modules
                if not (ROOT / "tests" / p.relative_to(ROOT).parent / f"test_{p.name}").exists()]
    tests = sorted((ROOT / "tests").rglob("test_*.py"))
    unmirrored = [str(t.relative_to(ROOT)) for t in tests
                  if not (ROOT / t.relative_to(ROOT / "tests").parent / t.name[5:]).exists()
                  and str(t.relative_to(ROOT)) not in NOT_MIRRORS]
    assert (untested, unmirrored) == ([], [])
    assert all((ROOT / m).exists() for m in NOT_MIRRORS.values() if m)

"""The edge's boundaries, read from the source: ``cluster/api`` reaches the jobs room through
public names only (a request outside a job through ``cluster.jobs.direct``), and the server
never loads the client SDK (an HTTP body is converted once, not rebuilt as protobuf)."""
from __future__ import annotations

from tests.support.paths import REPO

import ast
import os
import subprocess
import sys
from pathlib import Path

API = REPO / "cluster" / "api"
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public despite the underscore


def _private_uses(path: Path) -> list[str]:
    """``_``-prefixed names that ``path`` imports from ``cluster.jobs`` or reads off an object
    other than ``self``/``cls``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cluster.jobs")
                and any(a.name.startswith("_") for a in node.names)):
            found.append(f"{path.name}:{node.lineno}: from {node.module} import "
                         + ", ".join(a.name for a in node.names))
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in NAMEDTUPLE_API
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_edge_touches_no_private_name_of_another_object():
    files = sorted(API.glob("*.py"))
    assert files
    assert [use for path in files for use in _private_uses(path)] == []


def test_work_reaches_the_jobs_room_through_its_public_interfaces_only():
    tree = ast.parse((API / "work.py").read_text())
    imported = {(node.module, a.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module.startswith("cluster.jobs")
                for a in node.names}
    assert imported == {("cluster.jobs.direct", "DirectRequests"),
                        ("cluster.jobs.store", "JobRecord"), ("cluster.jobs.store", "StoredResult")}


def test_the_server_never_imports_the_client_sdk():
    root = API.parent.parent
    probe = ("import sys, cluster.api.frontend; "
             "print(sorted(m for m in sys.modules if m == 'cluster.api.client'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=root, check=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "[]"

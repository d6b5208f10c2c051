"""Hosts for tests: ``infra/netns.py`` loaded from the repository (it is not a package), and
``netns_cluster``, its namespaces made for a test and taken down after, or the test skipped
with the reason where namespaces cannot be made here (no root, no ``ip netns``)."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Iterator

import pytest

from tests.support.paths import REPO

INFRA = REPO / "infra"


def load_infra(name: str):
    """``infra/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"infra_{name}", INFRA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


netns = load_infra("netns")


@contextlib.contextmanager
def netns_cluster(workers: int, ray: bool = False) -> Iterator:
    """A head and ``workers`` worker namespaces on a bridge (with Ray started on them when
    ``ray``), destroyed on the way out."""
    reason = netns.probe()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    cluster = netns.NetnsCluster(workers=workers, python=sys.executable)
    try:
        cluster.create()
        if ray:
            cluster.start_ray()
        yield cluster
    finally:
        cluster.destroy()

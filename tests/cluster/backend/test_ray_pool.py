"""How the Ray side of the pool is set up (``cluster.backend.ray_pool``): a launcher's actor
names, stream secret and detachment, and the room check's arithmetic over the resources a
cluster offers, with its fix in the message. The check against an embedded cluster's own
resources, and workers that start, die and are replaced, are
``tests/cluster/backend/test_ray_backend.py``'s."""
from __future__ import annotations

import re

import pytest

ray = pytest.importorskip("ray")

from cluster.backend.bootstrap import NODE_RESOURCE, Placement  # noqa: E402
from cluster.backend.ray_pool import NoRoom, RayLauncher, refuse_without_room  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402


def _launcher(placement: Placement = Placement(), address: str | None = None,
              **kwargs) -> RayLauncher:
    return RayLauncher("/models/tiny", EngineConfig(), placement, address, **kwargs)


class TestALauncher:
    def test_names_its_actors_and_keys_their_streams_afresh(self):
        first, second = _launcher(), _launcher()
        assert re.fullmatch(r"orchard-[0-9a-f]{8}-", first.names)
        assert len(first.secret()) == 32
        assert first.names != second.names and first.secret() != second.secret()
        assert (first.detached, first.owner, first.prefix) == (False, "", "w")

    def test_taking_workers_over_keeps_their_names_and_secret(self):
        launcher = _launcher(names="orchard-0badf00d-", secret=b"k" * 32)
        assert (launcher.names, launcher.secret()) == ("orchard-0badf00d-", b"k" * 32)

    def test_on_a_cluster_it_joined_its_actors_outlive_it(self):
        assert _launcher(address="10.0.0.1:6379").detached is True


class TestTheRoomCheck:
    def test_workers_that_fill_the_slots_exactly_fit(self):
        refuse_without_room({NODE_RESOURCE: 2.0}, Placement(workers_per_node=2),
                            missing=1, in_use=3)

    def test_one_more_is_refused_with_the_fix(self):
        with pytest.raises(NoRoom) as refused:
            refuse_without_room({NODE_RESOURCE: 2.0}, Placement(workers_per_node=2),
                                missing=2, in_use=3)
        assert str(refused.value) == (
            "workers: no room for 2 more worker(s): the cluster offers 2 'orchard_node' "
            "slot(s), 1.5 in use, each worker takes 0.5; add nodes (infra/README.md) or raise "
            "workers per node")

    def test_a_cluster_without_orchard_nodes_has_no_room(self):
        with pytest.raises(NoRoom, match="offers 0 'orchard_node' slot"):
            refuse_without_room({"CPU": 16.0}, Placement(), missing=1, in_use=0)

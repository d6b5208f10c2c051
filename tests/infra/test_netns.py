"""``infra/netns.py``: what a namespace cluster is named and addressed by, and the environment
its processes get, without making a namespace (that needs root: the multi-node tests in
``tests/cluster/backend/test_bootstrap.py`` make them)."""
from __future__ import annotations

import os
from pathlib import Path

from tests.support.netns_hosts import netns


def cluster(tag: str, workers: int = 2):
    return netns.NetnsCluster(workers=workers, tag=tag, root=Path("/nowhere"))


class TestNamesAndAddresses:
    def test_the_tag_names_the_hub_and_picks_the_subnet(self):
        c = cluster("12345")
        assert (c.hub, c.subnet) == ("orch12345hub", f"10.213.{12345 % 250 + 1}")
        assert cluster("249").subnet == "10.213.250"
        assert cluster("250").subnet == "10.213.1"     # 250 subnets, never .0 or past .250

    def test_the_ray_address_is_the_heads_on_rays_port(self):
        c = cluster("7")
        c.nodes = [netns.Node("h", "orch7h", "10.213.8.1", 0),
                   netns.Node("1", "orch71", "10.213.8.2", 1)]
        assert (c.head.name, c.ray_address) == ("h", "10.213.8.1:6379")


class TestTheEnvironment:
    def test_ray_fails_fast_without_auth_or_usage_stats_and_no_outer_ray_setting(
            self, monkeypatch):
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")   # the outer shell's cluster
        env = cluster("7").env()
        assert {k: v for k, v in env.items() if k.startswith("RAY_")} == {
            "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3", "RAY_AUTH_MODE": "disabled",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_worker_niceness": "0"}
        assert env.get("PATH") == os.environ.get("PATH")   # the rest passes through


"""``GET /metrics`` end to end: a real frontend over a LocalBackend (two engines, the real
router), scraped over HTTP and read with ``prometheus_client``'s text parser; the counters
must equal what the requests' own results say, exactly.

Known requests: a single request over gRPC sent twice (the second reads the first's blocks),
then a job of two requests: the same prompt again, and another behind the same system text.
"""
from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.client import chat_request
from cluster.api.http_metrics import snapshot_of
from cluster.backend.protocol import WorkerInfo
from cluster.telemetry.prometheus import TierUsage, WorkerSnapshot
from workers.messages import DiskTierStats
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import TWO_TENANTS_CONFIG, running_frontend

CONFIG = TWO_TENANTS_CONFIG + """
[metrics]
dedicated = true
port = 0
"""

SYSTEM = "You are a careful assistant who answers briefly and never rambles on. " * 4
BLOCK = 16


def chat(custom_id: str, user: str, max_tokens: int = 3):
    return chat_request(custom_id, [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": user}], max_tokens,
                        temperature=0)


def get(address: str, path: str, key: str | None = None) -> tuple[int, str, str]:
    url = urlsplit(address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", path, headers={"authorization": f"Bearer {key}"} if key else {})
        response = conn.getresponse()
        return response.status, response.getheader("content-type"), response.read().decode()
    finally:
        conn.close()


def addresses(api) -> dict:
    return json.loads((api.config.run_dir / "frontend.json").read_text())


def scrape(api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample, sorted labels): value}`` from the dedicated port (no key)."""
    status, _, body = get(addresses(api)["metrics_address"], "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def total(got: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in got.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=2, block_size=BLOCK) as harness:
        yield harness


@pytest.fixture(scope="module")
def traffic(api):
    """The known requests, and what their results say."""
    before = scrape(api)
    with api.client("acme") as acme:
        singles = [list(acme.generate(chat("", "Name three rivers.")))[-1].result
                   for _ in range(2)]
        job = acme.submit([chat("a", "Name three rivers."), chat("b", "Name two lakes.")])
        job = acme.wait(job.job_id, poll_s=0.05, timeout_s=120)
        results = list(acme.results(job.job_id))
    return before, singles, results, scrape(api)


class TestScrape:
    def test_before_any_request_every_tenant_reads_zero(self, traffic):
        before = traffic[0]
        assert total(before, "orchard_requests_finished_total") == 0
        assert before[("orchard_queue_depth", (("tenant", "acme"),))] == 0
        assert before[("orchard_queue_depth", (("tenant", "beta"),))] == 0
        assert before[("orchard_jobs", (("state", "succeeded"),))] == 0

    def test_request_and_token_counters_equal_the_results(self, traffic):
        _, singles, results, got = traffic
        served = [*singles, *results]
        assert all(r.ok for r in served)
        assert got[("orchard_requests_finished_total",
                    (("status", "OK"), ("tenant", "acme")))] == 4
        assert total(got, "orchard_requests_finished_total", tenant="beta") == 0
        for worker in {r.worker_id for r in served}:
            mine = [r for r in served if r.worker_id == worker]
            assert got[("orchard_prompt_tokens_total", (("tenant", "acme"), ("worker", worker)))
                       ] == sum(r.usage.prompt_tokens for r in mine)
            assert total(got, "orchard_cached_tokens_total", worker=worker) == sum(
                r.usage.cached_tokens for r in mine)
            assert got[("orchard_generation_tokens_total",
                        (("tenant", "acme"), ("worker", worker)))] == sum(
                r.usage.completion_tokens for r in mine)
            assert got[("orchard_time_to_first_token_seconds_count",
                        (("worker", worker),))] == len(mine)
            assert got[("orchard_e2e_request_latency_seconds_count",
                        (("worker", worker),))] == len(mine)
        assert total(got, "orchard_cached_tokens_total", tier="disk") == 0  # no disk tier
        assert singles[1].usage.cached_tokens > 0  # the repeat read the first one's blocks

    def test_router_decisions_by_outcome(self, traffic):
        got = traffic[3]
        by_outcome = {o: total(got, "orchard_router_decisions_total", outcome=o)
                      for o in ("hit", "partial", "miss")}
        # the first prompt: nobody held it; its repeat and the job's copy of it: all of its
        # full blocks; the job's other prompt: the shared system text's blocks only
        assert by_outcome == {"miss": 1, "hit": 2, "partial": 1}

    def test_jobs_queue_and_workers_after_the_job(self, api, traffic):
        got = traffic[3]
        assert got[("orchard_jobs", (("state", "succeeded"),))] == 1
        assert got[("orchard_jobs", (("state", "running"),))] == 0
        assert got[("orchard_queue_depth", (("tenant", "acme"),))] == 0
        assert got[("orchard_requests_running", (("tenant", "acme"),))] == 0
        workers = api.run(api.backend.workers())
        for info in workers:
            assert got[("orchard_prefix_store_blocks",
                        (("tier", "memory"), ("worker", info.worker_id)))] == info.cache_blocks
            assert got[("orchard_prefix_store_bytes",
                        (("tier", "memory"), ("worker", info.worker_id)))] == info.cache_bytes
        assert total(got, "orchard_prefix_store_blocks") > 0
        assert got[("orchard_effective_input_multiplier", (("tenant", "acme"),))] > 0


class TestWhoMayRead:
    def test_the_http_port_asks_for_an_admin_key(self, api):
        address = addresses(api)["http_address"]
        assert get(address, "/metrics")[0] == 401
        assert get(address, "/metrics", "key-acme")[0] == 403
        assert get(address, "/metrics", "no-such-key")[0] == 401
        status, content_type, body = get(address, "/metrics", "key-admin")
        assert status == 200
        assert content_type.startswith("text/plain")
        assert "orchard_requests_finished_total" in body

    def test_the_dedicated_port_serves_metrics_alone_without_a_key(self, api):
        address = addresses(api)["metrics_address"]
        assert urlsplit(address).hostname == "127.0.0.1"
        assert get(address, "/metrics")[0] == 200
        assert get(address, "/v1/models", "key-acme")[0] == 404


class TestSettings:
    def test_metrics_off_on_the_http_port_is_not_found_there(self, tmp_path):
        (tmp_path / "orchard.toml").write_text(TWO_TENANTS_CONFIG + "[metrics]\nhttp = false\n")
        with running_frontend(tmp_path, tiny_model(), workers=1) as off:
            assert addresses(off)["metrics_address"] == ""
            assert get(addresses(off)["http_address"], "/metrics", "key-admin")[0] == 404

    def test_a_dedicated_port_in_use_is_refused_naming_the_setting(self, tmp_path):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            (tmp_path / "orchard.toml").write_text(
                TWO_TENANTS_CONFIG + f"[metrics]\ndedicated = true\nport = {port}\n")
            with pytest.raises(ValueError, match=rf"cannot bind \[metrics\] port to "
                                                 rf"127.0.0.1:{port} .*\[metrics\] port = 0"):
                with running_frontend(tmp_path, tiny_model(), workers=1):
                    pass


def test_a_workers_stats_narrow_to_its_snapshot_with_both_tiers():
    disk = DiskTierStats(blocks=7, bytes=7000, capacity_bytes=1 << 20, free_bytes=None,
                         corrupt=0, torn=0, outdated=0, full=False, evictions=6)
    info = WorkerInfo("w3", "node", "ready", running=2, queued_tokens=5, cache_bytes=300,
                      cache_capacity_bytes=4096, cache_blocks=3, hit_ratio=0.5,
                      requests_served=9, evictions=4, expirations=1, disk=disk)
    assert snapshot_of(info) == WorkerSnapshot("w3", 2, TierUsage(300, 3, 4096, 4),
                                               TierUsage(7000, 7, 1 << 20, 6), 1)
    memory_only = snapshot_of(WorkerInfo("w4", "node", "ready", 0, 0, 0, 4096, 0, 0.0, 0))
    assert memory_only.disk is None

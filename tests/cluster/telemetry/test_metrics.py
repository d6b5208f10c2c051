"""orchard's OpenTelemetry metrics (``cluster.telemetry.metrics``): per worker and tenant
from each finished request, the gauges observed from their owners at each export, refusals,
and the GenAI token usage histogram by token type.
"""
import dataclasses

import pytest

from cluster.telemetry import attrs as A
from cluster.telemetry.metrics import Instruments, RequestUsage, SlotGauges, StoreGauges
from router.policy import Reason
from tests.support.request_traces import SYSTEM, observed, run, run_genai, traced
from tests.support.telemetry_factories import in_memory
from tests.support.telemetry_factories import decision, result
from workers.messages import LookupOutcome


@pytest.fixture
def setup(tmp_path):
    return observed(tmp_path)


class TestInstruments:
    def test_metrics_per_worker_and_tenant(self, setup):
        tel, exporter, reader, observer, clock = setup
        prompt = SYSTEM + (5,)
        run(observer, tel, "r1", prompt, decision("w0", Reason.COLD_HASH, 0, 17, {"w0": 0}),
            result("r1", 17, 0, 16, "w0", LookupOutcome.MISS))
        run(observer, tel, "r2", prompt, decision("w0", Reason.PREFIX_MATCH, 16, 17, {"w0": 16}),
            result("r2", 17, 16, 0, "w0", LookupOutcome.HIT))
        tel.instruments.watch_store("w0", lambda: StoreGauges(bytes=4096, evictions=3, expirations=2))
        tel.instruments.watch_queue(lambda: {"acme": 7})
        tel.instruments.watch_slots(lambda: {"interactive": SlotGauges(3, 14),
                                             "batch": SlotGauges(1, 2)})
        tel.instruments.record_refusal("acme", "shed")
        tel.instruments.record_refusal("acme", "shed")
        points = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        points[(m.name, tuple(sorted(p.attributes.items())))] = p
        key = (("tenant", "acme"), ("worker", "w0"))
        assert points[("orchard.cache.cached_tokens", key)].value == 16
        assert points[("orchard.cache.input_tokens", key)].value == 34
        assert points[("orchard.cache.hit_ratio", key)].value == pytest.approx(16 / 34)
        assert points[("gen_ai.server.time_to_first_token", key)].count == 2
        assert points[("orchard.store.bytes", (("worker", "w0"),))].value == 4096
        assert points[("orchard.store.evictions", (("worker", "w0"),))].value == 3
        assert points[("orchard.store.expirations", (("worker", "w0"),))].value == 2
        assert points[("orchard.queue.depth", (("tenant", "acme"),))].value == 7
        for priority, in_use, waiting in (("interactive", 3, 14), ("batch", 1, 2)):
            key = (("priority", priority),)
            assert points[("orchard.slots.in_use", key)].value == in_use
            assert points[("orchard.slots.waiting", key)].value == waiting
        refused = (("reason", "shed"), ("tenant", "acme"))
        assert points[("orchard.requests.refused", refused)].value == 2

    def test_token_usage_histogram_by_token_type(self, tmp_path):
        tracing, tel, _, reader = traced(tmp_path)
        run_genai(tracing, "t1", [7, 8, 9, 10, 11])          # 5 input tokens, 3 output
        run_genai(tracing, "t2", list(range(20, 33)))        # 13 input tokens, 3 output
        data = reader.get_metrics_data()
        points = [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                  if m.name == "gen_ai.client.token.usage" for p in m.data.data_points]
        by_type = {p.attributes[A.GEN_AI_TOKEN_TYPE]: p for p in points}
        assert set(by_type) == {"input", "output"}
        assert (by_type["input"].sum, by_type["input"].count) == (18, 2)
        assert (by_type["output"].sum, by_type["output"].count) == (6, 2)
        for p in points:
            assert p.attributes[A.GEN_AI_OPERATION] == "text_completion"
            assert p.attributes[A.GEN_AI_SYSTEM] == "orchard"
            assert p.attributes[A.GEN_AI_RESPONSE_MODEL] == "SmolLM2-135M-Instruct"


def points_of(reader) -> dict:
    """(metric name, sorted attributes) -> data point, at one collection."""
    return {(m.name, tuple(sorted(p.attributes.items()))): p
            for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics for p in m.data.data_points}


class TestObservedGauges:
    def test_a_tenant_whose_queue_emptied_reads_zero_and_queues_add_up(self, tmp_path):
        tel, _, reader = in_memory(tmp_path)
        depths = {"acme": 3, "beta": 1}
        tel.instruments.watch_queue(lambda: dict(depths))
        tel.instruments.watch_queue(lambda: {"acme": 2})
        assert points_of(reader)[("orchard.queue.depth", (("tenant", "acme"),))].value == 5
        del depths["beta"]
        queue = {k: p.value for k, p in points_of(reader).items()
                 if k[0] == "orchard.queue.depth"}
        assert queue == {("orchard.queue.depth", (("tenant", "acme"),)): 5,
                         ("orchard.queue.depth", (("tenant", "beta"),)): 0}

    def test_a_later_store_callback_replaces_the_earlier(self, tmp_path):
        tel, _, reader = in_memory(tmp_path)
        tel.instruments.watch_store("w0", lambda: StoreGauges(bytes=1, evictions=0, expirations=0))
        tel.instruments.watch_store("w0", lambda: StoreGauges(bytes=2, evictions=0, expirations=0))
        assert points_of(reader)[("orchard.store.bytes", (("worker", "w0"),))].value == 2


class TestRecordRequest:
    def test_a_request_of_one_output_token_records_no_time_per_output_token(self, tmp_path):
        tel, _, reader = in_memory(tmp_path)
        one = RequestUsage("w0", "acme", "miss", "chat", "tiny", 10, 0, 8, 1, 0.02, 0.0)
        tel.instruments.record_request(one)
        tel.instruments.record_request(dataclasses.replace(one, output_tokens=5, tpot_s=0.004))
        key = (("tenant", "acme"), ("worker", "w0"))
        points = points_of(reader)
        assert points[(A.GEN_AI_TTFT_METRIC, key)].count == 2
        assert (points[(A.GEN_AI_TPOT_METRIC, key)].count,
                points[(A.GEN_AI_TPOT_METRIC, key)].sum) == (1, 0.004)
        assert points[("orchard.cache.requests", (("outcome", "miss"), *key))].value == 2

    def test_without_a_meter_every_call_is_a_no_op(self):
        off = Instruments(None)   # telemetry disabled: no instruments were made
        off.record_request(RequestUsage("w0", "acme", "hit", "chat", "tiny", 1, 1, 0, 1, 0.1, 0.0))
        off.record_refusal("acme", "shed")

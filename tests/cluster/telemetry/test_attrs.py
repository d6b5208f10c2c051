"""The attribute names orchard writes (``cluster.telemetry.attrs``): each one distinct, the
GenAI conventions' under ``gen_ai.*``, orchard's own under ``orchard.*``, and the names
``orchard report`` reads from recorded traces unchanged (a rename is a format change).
"""
from __future__ import annotations

from cluster.telemetry import attrs as A

# Not attribute names: the values some of them take.
VALUES = {"OPERATION_CHAT": "chat", "OPERATION_TEXT": "text_completion", "PROVIDER": "orchard"}
# Semantic-convention names outside both prefixes.
STANDARD = {"HOST_NAME": "host.name", "ERROR_TYPE": "error.type"}


def names() -> dict[str, str]:
    return {k: v for k, v in vars(A).items() if k.isupper() and k not in VALUES}


class TestNames:
    def test_every_attribute_name_is_distinct(self):
        by_value: dict[str, list[str]] = {}
        for constant, name in names().items():
            by_value.setdefault(name, []).append(constant)
        assert [c for c in by_value.values() if len(c) > 1] == []

    def test_genai_names_under_gen_ai_orchards_own_under_orchard(self):
        outside = {}
        for constant, name in names().items():
            prefix = "gen_ai." if constant.startswith("GEN_AI_") else "orchard."
            if not name.startswith(prefix):
                outside[constant] = name
        assert outside == STANDARD
        assert {k: getattr(A, k) for k in VALUES} == VALUES

    def test_the_names_the_report_reads_are_the_recorded_format(self):
        assert {k: getattr(A, k) for k in (
            "SPAN_KIND", "REQUEST_ID", "JOB_ID", "TENANT", "TURN", "WORKER",
            "GEN_AI_INPUT_TOKENS", "GEN_AI_CACHE_READ", "GEN_AI_CACHE_WRITE",
            "GEN_AI_CACHE_CREATION", "GEN_AI_CONVERSATION", "GEN_AI_REQUEST_MODEL",
            "COST_FORECAST_M", "COST_MEASURED_M", "MISS_CAUSE", "CACHE_LINE",
            "CLIENT_DISCONNECTED", "SPEC_DRAFTED", "SPEC_ACCEPTED")} == {
            "SPAN_KIND": "orchard.span",
            "REQUEST_ID": "orchard.request.id",
            "JOB_ID": "orchard.job.id",
            "TENANT": "orchard.tenant",
            "TURN": "orchard.conversation.turn",
            "WORKER": "orchard.worker.id",
            "GEN_AI_INPUT_TOKENS": "gen_ai.usage.input_tokens",
            "GEN_AI_CACHE_READ": "gen_ai.usage.cache_read.input_tokens",
            "GEN_AI_CACHE_WRITE": "gen_ai.usage.cache_write.input_tokens",
            "GEN_AI_CACHE_CREATION": "gen_ai.usage.cache_creation.input_tokens",
            "GEN_AI_CONVERSATION": "gen_ai.conversation.id",
            "GEN_AI_REQUEST_MODEL": "gen_ai.request.model",
            "COST_FORECAST_M": "orchard.cost.forecast_multiplier",
            "COST_MEASURED_M": "orchard.cost.measured_multiplier",
            "MISS_CAUSE": "orchard.miss.cause",
            "CACHE_LINE": "orchard.cache.line",
            "CLIENT_DISCONNECTED": "orchard.request.client_disconnected",
            "SPEC_DRAFTED": "orchard.spec.drafted_tokens",
            "SPEC_ACCEPTED": "orchard.spec.accepted_tokens"}

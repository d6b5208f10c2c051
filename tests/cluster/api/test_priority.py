"""A request's priority at each edge: gRPC's enum, the x-orchard-priority header and OpenAI's
service_tier, every other value refused naming the field."""
from __future__ import annotations

import pytest

from cluster.api.priority import check_batch_header, http_priority, priority_from_pb
from cluster.api.validate import FieldError
from proto.orchard.v1 import orchard_pb2 as pb
from workers.messages import Priority

I, B = Priority.INTERACTIVE, Priority.BATCH


@pytest.mark.parametrize("value, priority", [
    (pb.PRIORITY_UNSPECIFIED, I), (pb.PRIORITY_INTERACTIVE, I), (pb.PRIORITY_BATCH, B)])
def test_grpc_values(value, priority):
    assert priority_from_pb(value) is priority


def test_an_unknown_grpc_number_is_refused_naming_the_field():
    with pytest.raises(FieldError) as caught:
        priority_from_pb(7)
    assert caught.value.field == "priority" and "unknown value 7" in str(caught.value)


@pytest.mark.parametrize("body, headers, priority", [
    ({}, {}, I),
    ({"service_tier": "auto"}, {}, I), ({"service_tier": "default"}, {}, I),
    ({"service_tier": "flex"}, {}, B), ({"service_tier": None}, {}, I),
    ({}, {"x-orchard-priority": "batch"}, B), ({}, {"x-orchard-priority": " Interactive "}, I),
    ({"service_tier": "flex"}, {"x-orchard-priority": "batch"}, B),
])
def test_http_values(body, headers, priority):
    assert http_priority(body, headers) is priority


@pytest.mark.parametrize("body, headers, field, words", [
    ({"service_tier": "priority"}, {}, "service_tier", "got 'priority'"),
    ({"service_tier": "scale"}, {}, "service_tier", "'flex' (batch"),
    ({"service_tier": 3}, {}, "service_tier", "got '3'"),
    ({}, {"x-orchard-priority": "urgent"}, "x-orchard-priority", "got 'urgent'"),
    ({"service_tier": "default"}, {"x-orchard-priority": "batch"}, "service_tier",
     "'default' is interactive work but the x-orchard-priority header says batch"),
])
def test_http_refusals_name_the_field(body, headers, field, words):
    with pytest.raises(FieldError) as caught:
        http_priority(body, headers)
    assert caught.value.field == field and words in str(caught.value)


def test_a_batch_may_only_ask_for_batch_work():
    check_batch_header({})
    check_batch_header({"x-orchard-priority": "Batch"})
    with pytest.raises(FieldError) as caught:
        check_batch_header({"x-orchard-priority": "interactive"})
    assert caught.value.field == "x-orchard-priority"
    assert "a batch runs as batch work: only 'batch', got 'interactive'" in str(caught.value)

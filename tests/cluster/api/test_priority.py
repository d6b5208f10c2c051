"""A request's priority at each edge: gRPC's enum, the x-orchard-priority header and OpenAI's
service_tier; a job's: gRPC's enum (unset: batch) and a batch's header; every other value
refused naming the field."""
from __future__ import annotations

import pytest

from cluster.api.priority import (batch_priority, http_priority, job_priority_from_pb,
                                   priority_from_pb)
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


@pytest.mark.parametrize("value, priority", [
    (pb.PRIORITY_UNSPECIFIED, B), (pb.PRIORITY_BATCH, B), (pb.PRIORITY_INTERACTIVE, I)])
def test_a_jobs_grpc_values_default_to_batch(value, priority):
    assert job_priority_from_pb(value) is priority


def test_an_unknown_job_priority_is_refused_naming_the_field():
    with pytest.raises(FieldError) as caught:
        job_priority_from_pb(9, "priority")
    assert caught.value.field == "priority"
    assert str(caught.value) == ("priority: unknown value 9; use PRIORITY_BATCH or "
                                 "PRIORITY_INTERACTIVE (or leave it unset: batch)")


@pytest.mark.parametrize("headers, priority", [
    ({}, B), ({"x-orchard-priority": "Batch"}, B), ({"x-orchard-priority": " interactive"}, I)])
def test_a_batchs_header_names_its_priority(headers, priority):
    assert batch_priority(headers) is priority


def test_a_batchs_unknown_header_is_refused_naming_it():
    with pytest.raises(FieldError) as caught:
        batch_priority({"x-orchard-priority": "urgent"})
    assert caught.value.field == "x-orchard-priority"
    assert "must be 'batch' (the default) or 'interactive'" in str(caught.value)
    assert "got 'urgent'" in str(caught.value)

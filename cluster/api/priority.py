"""A request's priority as each edge carries it (``workers.messages.Priority``).

    gRPC   GenerateRequest.priority       UNSPECIFIED or INTERACTIVE: interactive; BATCH: batch
    HTTP   x-orchard-priority header      "interactive" or "batch"
           service_tier (OpenAI's field)  "auto" or "default": interactive; "flex": batch

A job's priority (the lane all its requests take; ``cluster.jobs.runner``) is batch unless
asked for::

    gRPC   SubmitJobRequest.priority,     UNSPECIFIED or BATCH: batch; INTERACTIVE: interactive
           BatchFileChunk.priority        (the first chunk's; a later chunk's must be unset)
    HTTP   POST /v1/batches               x-orchard-priority header: "batch" (or none) or
                                          "interactive"

A value outside these is refused naming the field (INVALID_ARGUMENT, HTTP 400), and so are a
header and a ``service_tier`` that disagree: nothing is accepted and then ignored. OpenAI's
"priority" tier (faster than default) has no meaning here: interactive is already first.
A batch line's own ``service_tier`` may only be "auto" or "flex" (``cluster.api.openai_fields``):
the job's priority, not a line's, says which lane its requests take.
"""
from __future__ import annotations

from typing import Any, Mapping

from cluster.api.validate import FieldError
from proto.orchard.v1 import orchard_pb2 as pb
from workers.messages import Priority

PRIORITY_HEADER = "x-orchard-priority"
SERVICE_TIERS = {"auto": Priority.INTERACTIVE, "default": Priority.INTERACTIVE,
                 "flex": Priority.BATCH}
_FROM_PB = {pb.PRIORITY_UNSPECIFIED: Priority.INTERACTIVE,
            pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE, pb.PRIORITY_BATCH: Priority.BATCH}


_JOB_FROM_PB = {pb.PRIORITY_UNSPECIFIED: Priority.BATCH,
                pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE, pb.PRIORITY_BATCH: Priority.BATCH}


def job_priority_from_pb(value: int, field: str = "priority") -> Priority:
    """A job's priority (``SubmitJobRequest.priority``, ``BatchFileChunk.priority``); an
    unknown number is refused naming ``field``."""
    if value not in _JOB_FROM_PB:
        raise FieldError(field, f"unknown value {value}; use PRIORITY_BATCH or "
                         "PRIORITY_INTERACTIVE (or leave it unset: batch)")
    return _JOB_FROM_PB[value]


def priority_from_pb(value: int) -> Priority:
    """``GenerateRequest.priority``; an unknown number is refused naming the field."""
    if value not in _FROM_PB:
        raise FieldError("priority", f"unknown value {value}; use PRIORITY_INTERACTIVE or "
                         "PRIORITY_BATCH (or leave it unset: interactive)")
    return _FROM_PB[value]


def http_priority(body: Mapping[str, Any], headers: Mapping[str, str]) -> Priority:
    """The priority of an HTTP completion: its header, its ``service_tier``, or interactive."""
    header = headers.get(PRIORITY_HEADER)
    by_header = None
    if header is not None:
        try:
            by_header = Priority(header.strip().lower())
        except ValueError:
            raise FieldError(PRIORITY_HEADER, f"must be 'interactive' or 'batch', got "
                             f"{header[:32]!r}") from None
    tier = body.get("service_tier")
    by_tier = None
    if tier is not None:
        if not isinstance(tier, str) or tier not in SERVICE_TIERS:
            raise FieldError("service_tier", "must be 'auto' or 'default' (interactive) or "
                             f"'flex' (batch: never refused for load, only slowed), got "
                             f"{str(tier)[:32]!r}")
        by_tier = SERVICE_TIERS[tier]
    if by_header is not None and by_tier is not None and by_header is not by_tier:
        raise FieldError("service_tier", f"'{tier}' is {by_tier} work but the "
                         f"{PRIORITY_HEADER} header says {by_header}; send one of them")
    return by_header or by_tier or Priority.INTERACTIVE


def batch_priority(headers: Mapping[str, str]) -> Priority:
    """A ``POST /v1/batches`` job's priority: its ``x-orchard-priority`` header, or batch."""
    header = headers.get(PRIORITY_HEADER)
    if header is None:
        return Priority.BATCH
    try:
        return Priority(header.strip().lower())
    except ValueError:
        raise FieldError(PRIORITY_HEADER, f"must be 'batch' (the default) or 'interactive' "
                         f"(the job's requests served before batch work), got "
                         f"{header[:32]!r}") from None

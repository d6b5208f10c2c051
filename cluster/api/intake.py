"""Accepting a job into the store, and preparing its requests when they are dispatched.

Acceptance does what must be done before answering and no more::

    file bytes (gRPC chunks, an HTTP upload) ─► BatchIntake.feed ─► whole lines:
        line_shape (JSON, custom_id, method, url, body, messages, sampling types, fields
        orchard does not implement), roles and content kinds, the text's size
        (max_prompt_bytes), the response format compiled, a unique custom_id, the job size
        limit
        ─► StagedRequest(index, custom_id, prefix_key, b"J" + the line) ─► JobIntake.add
    ... BatchIntake.finish ─► JobIntake.commit: the job exists, queued, whole

``accept_file`` drives it from an async iterator of byte chunks, each chunk's work in a worker
thread, so a 200 MB upload never stalls the event loop; ``JobIntakeService.submit_file`` adds
the runner's admission and launches the job: the gRPC ``SubmitBatchFile`` and the HTTP Batch
API both call it. A job sent as requests (``SubmitJob``, the HTTP Batch API: the edges' typed
``RequestIn``) takes the same path (``feed_requests``) after the checks that need no
tokenizer; each is stored as ``b"P"`` + the serialized orchard.v1 ``Request``
(``cluster.api.convert.request_to_pb``): compact, and what stored jobs already hold.

Chat templating and tokenization happen in ``prepare``, when the runner dispatches a request
(in a worker thread): a request that turns out invalid then (a prompt over the context) becomes
a failed result with its reason, as OpenAI's error file does.

The prefix key orders dispatch: per leading message (at most ``PREFIX_LEVELS``), four bytes of
a running CRC-32 of (role, content), so requests that share a system prompt, then a first turn,
sort together whatever their place in the file; a token prompt gets the same per
``PREFIX_TOKENS`` tokens. Each result still carries its own ``custom_id`` and index.
"""
from __future__ import annotations

import asyncio
import json
import zlib
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import AsyncIterable, Awaitable, Callable, Sequence

from cluster.api import cache_fields, validate
from cluster.api.batchfile import line_shape, request_of
from cluster.api.convert import request_from_pb, request_to_pb
from cluster.api.incoming import Messages, RequestIn, Tokens
from cluster.api.intake_threads import (CancelledAfterCommit, CommitGate, commit_in_thread,
                                        in_thread)
from cluster.backend.protocol import ModelInfo
from cluster.jobs.runner import PREPARE_AT_INTAKE, JobRunner, Prepared
from cluster.jobs.store import JobIntake, JobRecord, JobStore, NewRequest, StagedRequest
from proto.orchard.v1 import orchard_pb2 as pb
from workers.messages import Priority

LINE_BODY = b"J"        # body = b"J" + an OpenAI Batch input line, as sent
PROTO_BODY = b"P"       # body = b"P" + a serialized orchard.v1.Request
PREFIX_LEVELS = 4
PREFIX_TOKENS = 64
ROWS_PER_WRITE = 2000   # requests per store transaction during an intake (about 2 MB)
MAX_FILE_BYTES = 200 << 20


def prefix_key(parts: Sequence[bytes]) -> bytes:
    """Four bytes per leading part of a running CRC-32: a sort key that keeps shared prefixes
    together (the order of groups is arbitrary but does not depend on the file). A collision
    only places two groups side by side; it never changes what a request computes."""
    running = 0
    key = bytearray()
    for part in parts[:PREFIX_LEVELS]:
        running = zlib.crc32(part, zlib.crc32(len(part).to_bytes(4, "little"), running))
        key += running.to_bytes(4, "big")
    return bytes(key)


def _message_parts(messages: Sequence[dict[str, str]]) -> list[bytes]:
    return [f"{m['role']}\0{m['content']}".encode() for m in messages[:PREFIX_LEVELS]]


def _token_parts(ids: Sequence[int]) -> list[bytes]:
    end = min(len(ids), PREFIX_LEVELS * PREFIX_TOKENS)
    return [json.dumps(list(ids[i:i + PREFIX_TOKENS])).encode()
            for i in range(0, end, PREFIX_TOKENS)]


def _line_messages(messages: list[dict], where: str) -> list[dict[str, str]]:
    """Roles and content kinds of a line's messages (what ``validate`` checks, on dicts)."""
    if not messages:
        raise ValueError(f"{where}: body.messages is empty; give at least one message")
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in validate.ROLES:
            raise ValueError(f"{where}: body.messages[{i}].role: unknown role {role!r}; use one "
                             f"of {', '.join(validate.ROLES)}")
        if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"{where}: body.messages[{i}].content: must be a string (or a list "
                             'of {"type": "text", "text": ...} parts)')
        out.append({"role": role, "content": content})
    return out


def _request_parts(request: RequestIn, where: str, model: ModelInfo,
                   max_prompt_bytes: int) -> list[bytes]:
    """Every check of ``validate.new_request`` that needs no tokenizer; the prefix parts."""
    prompt = request.prompt
    if isinstance(prompt, Messages):
        messages = validate.messages_to_dicts(prompt.items, f"{where}.messages")
        validate.check_prompt_bytes(messages, f"{where}.messages", max_prompt_bytes)
        validate.sampling_params(request, where, 1, model)  # the length is known at dispatch
        cache_fields.check_shape(request, where, None)
        return _message_parts(messages)
    if isinstance(prompt, Tokens):
        ids = validate.check_token_ids(
            validate.check_context(prompt.ids, where, model.max_context),
            f"{where}.tokens.ids", model.vocab_size)
        validate.sampling_params(request, where, len(ids), model)
        cache_fields.check_shape(request, where, ids)
        return _token_parts(ids)
    raise validate.FieldError(f"{where}.prompt", "missing: set messages or tokens")


def prepare(body: bytes, model: ModelInfo, render: validate.Render,
            max_prompt_bytes: int = validate.MAX_PROMPT_BYTES) -> NewRequest:
    """A stored request templated, tokenized and checked against the model (``FieldError``
    naming the field when it cannot run). Blocking: called in a worker thread."""
    kind, data = body[:1], body[1:]
    if kind == LINE_BODY:
        request = request_of(json.loads(data))
    elif kind == PROTO_BODY:
        request = request_from_pb(pb.Request.FromString(data))
    else:
        raise RuntimeError(f"a stored request has an unknown body format {kind!r}")
    return validate.new_request(request, "request", model, render, max_prompt_bytes)


@dataclass
class BatchIntake:
    """One job being accepted; ``feed`` and ``feed_requests`` may be called from a worker
    thread (one at a time). ``ValueError`` (naming the line or request) on bad input,
    ``LimitExceeded`` past ``max_requests``; nothing is stored unless ``commit`` returns."""

    intake: JobIntake
    model: ModelInfo
    max_requests: int
    name: str = "input"
    max_prompt_bytes: int = validate.MAX_PROMPT_BYTES
    _seen: dict[str, int] = field(default_factory=dict)
    _rest: bytes = b""
    _lineno: int = 0
    _bytes: int = 0
    _staged: list[StagedRequest] = field(default_factory=list)
    # the bodies of requests sent whole (``feed_requests``), kept for a small job's preparing
    bodies: list[bytes] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self._seen)

    def feed(self, data: bytes) -> int:
        """Take the next bytes of a JSONL file; returns how many requests they completed."""
        self._bytes += len(data)
        if self._bytes > MAX_FILE_BYTES:
            raise validate.LimitExceeded(
                "file", f"{self.name} is over {MAX_FILE_BYTES >> 20} MB; split it")
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        before = self.count
        for text in lines:
            self._line(text)
        self._flush(ROWS_PER_WRITE)
        return self.count - before

    def feed_requests(self, requests: Sequence[RequestIn]) -> None:
        for request in requests:
            index = self.count
            where = f"requests[{index}]"
            self._check_id(request.custom_id, where + ".custom_id", f"requests[{{}}]")
            parts = _request_parts(request, where, self.model, self.max_prompt_bytes)
            body = PROTO_BODY + request_to_pb(request).SerializeToString()
            if index < PREPARE_AT_INTAKE:
                self.bodies.append(body)
            self._stage(request.custom_id, prefix_key(parts), body)
        self._flush(ROWS_PER_WRITE)

    def end(self) -> int:
        """The file ended: its last line (if it had no newline); returns requests completed."""
        before = self.count
        if self._rest.strip():
            self._line(self._rest)
        self._rest = b""
        if not self.count:
            raise validate.FieldError(self.name, "no requests (the file is empty)")
        return self.count - before

    def commit(self, idempotency_key: str = "") -> tuple[JobRecord, bool]:
        """Store what is left and create the job (see ``JobIntake.commit``)."""
        self._flush(1)
        return self.intake.commit(idempotency_key)

    def abort(self) -> None:
        self.intake.abort()

    def _line(self, text: bytes) -> None:
        self._lineno += 1
        if not text.strip():
            return
        where = f"{self.name}:{self._lineno}"
        line = line_shape(text, self.name, self._lineno)
        messages = _line_messages(line["body"]["messages"], where)
        validate.check_prompt_bytes(messages, f"{where}: body.messages", self.max_prompt_bytes)
        stop = line["body"].get("stop")
        validate.check_stop([stop] if isinstance(stop, str) else stop or [], f"{where}: body.stop")
        # compiled now (cached per schema), so an uncompilable one names its line and path
        validate.checked_format(line["body"].get("response_format"),
                                f"{where}: body.response_format")
        self._check_id(line["custom_id"], f"{where}: custom_id", f"{self.name}:{{}}")
        self._stage(line["custom_id"], prefix_key(_message_parts(messages)), LINE_BODY + text)

    def _check_id(self, custom_id: str, where: str, first: str) -> None:
        if not custom_id:
            raise validate.FieldError(where, "required: give every request a unique id")
        validate.check_custom_id(custom_id, where)
        if custom_id in self._seen:
            raise validate.FieldError(where, f"duplicate {validate.quoted(custom_id)} (first at "
                                      f"{first.format(self._seen[custom_id])}); custom ids must "
                                      "be unique")
        if self.count >= self.max_requests:
            raise validate.LimitExceeded("requests", f"more than the limit of {self.max_requests}"
                                         " requests per job; split the job")
        self._seen[custom_id] = self._lineno if self._lineno else self.count

    def _stage(self, custom_id: str, prefix: bytes, body: bytes) -> None:
        self._staged.append(StagedRequest(self.count - 1, custom_id, prefix, body))

    def _flush(self, at_least: int) -> None:
        if len(self._staged) >= at_least:
            self.intake.add(self._staged)
            self._staged = []


async def accept_file(store: JobStore, tenant: str, model: ModelInfo, max_requests: int,
                      chunks: AsyncIterable[bytes], name: str = "input",
                      idempotency_key: str = "",
                      on_requests: Callable[[int], None] | None = None,
                      max_prompt_bytes: int = validate.MAX_PROMPT_BYTES,
                      priority: Priority = Priority.BATCH) -> tuple[JobRecord, bool]:
    """Accept an OpenAI Batch input file, arriving as ``chunks``, into a durable job.

    Returns the job and whether it was created now (an ``idempotency_key`` that names an
    earlier job returns that one). ``on_requests(n)`` is called on the event loop as each chunk
    completes ``n`` requests (the runner's admission: it may raise to refuse the job). On any
    error, and on a cancel before the commit began, nothing of the job remains in the store;
    a cancel after it raises ``CancelledAfterCommit``.
    """
    batch = BatchIntake(store.intake(tenant, model.model_id, priority), model, max_requests,
                        name, max_prompt_bytes)
    gate = CommitGate()

    def commit() -> tuple[JobRecord, bool]:
        gate.begin_commit()
        return batch.commit(idempotency_key)

    try:
        async for chunk in chunks:
            added = await in_thread(batch.feed, chunk)
            if on_requests is not None and added:
                on_requests(added)
        added = await in_thread(batch.end)
        if on_requests is not None and added:
            on_requests(added)
        return await commit_in_thread(gate, commit)
    except CancelledAfterCommit:
        raise
    except BaseException:
        await asyncio.shield(asyncio.to_thread(batch.abort))
        raise
    finally:
        batch.intake.close()


async def accept_requests(store: JobStore, tenant: str, model: ModelInfo, max_requests: int,
                          requests: Sequence[RequestIn], idempotency_key: str = "",
                          max_prompt_bytes: int = validate.MAX_PROMPT_BYTES,
                          priority: Priority = Priority.BATCH,
                          prepare: PrepareSoon | None = None) -> tuple[JobRecord, bool]:
    """``accept_file`` for a job sent as requests (``SubmitJob``, the HTTP Batch API): the
    requests are all here, so the intake opens, takes them, commits and closes in one worker
    thread (one hop off the event loop, which a one-request job's latency is made of). A
    caller cancelled before the commit began leaves nothing (the thread aborts instead of
    committing); one cancelled after gets ``CancelledAfterCommit``.

    ``prepare``: for a job of at most ``PREPARE_AT_INTAKE`` requests, how to start preparing
    their bodies, and where to put each one prepared (by index): they are templated and
    tokenized in other threads while the commit's fsync runs, and are all there when this
    returns a committed job."""
    gate = CommitGate()

    def accept() -> tuple[JobRecord, bool]:
        batch = BatchIntake(store.intake(tenant, model.model_id, priority), model,
                            max_requests, max_prompt_bytes=max_prompt_bytes)
        try:
            batch.feed_requests(requests)
            soon = (prepare.start(batch.bodies)
                    if prepare is not None and batch.count <= PREPARE_AT_INTAKE else [])
            gate.begin_commit()
            committed = batch.commit(idempotency_key)
            if prepare is not None:
                prepare.ready.update((i, made.result()) for i, made in enumerate(soon))
            return committed
        except BaseException:
            batch.abort()
            raise
        finally:
            batch.intake.close()

    return await commit_in_thread(gate, accept)


@dataclass(frozen=True, slots=True)
class PrepareSoon:
    """A small job's requests prepared beside its commit (``accept_requests``): ``start``
    (``JobRunner.prepare_soon``) begins them, ``ready`` receives them, for ``launch``."""

    start: Callable[[Sequence[bytes]], list[Future[Prepared]]]
    ready: dict[int, Prepared] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JobIntakeService:
    """Accept a job and launch it, with the runner's admission: what ``SubmitJob``,
    ``SubmitBatchFile`` and the HTTP Batch API call.

    Requests are admitted (backpressure) as they are accepted, and released if the job is
    refused or turns out to be a retry of an earlier one (same idempotency key). A caller
    cancelled after the commit began (a client gone at that moment) still has its job
    launched: it runs, and the client finds it by its idempotency key."""

    store: JobStore
    runner: JobRunner
    model: ModelInfo
    max_requests: int
    max_prompt_bytes: int = validate.MAX_PROMPT_BYTES

    async def submit_file(self, tenant: str, chunks: AsyncIterable[bytes], name: str = "input",
                          idempotency_key: str = "", priority: Priority = Priority.BATCH
                          ) -> JobRecord:
        async def accept(admit: Callable[[int], None]) -> tuple[JobRecord, bool]:
            return await accept_file(self.store, tenant, self.model, self.max_requests, chunks,
                                     name, idempotency_key, on_requests=admit,
                                     max_prompt_bytes=self.max_prompt_bytes, priority=priority)
        return await self._submit(tenant, idempotency_key, accept)

    async def submit_requests(self, tenant: str, requests: Sequence[RequestIn],
                              idempotency_key: str = "", priority: Priority = Priority.BATCH
                              ) -> JobRecord:
        validate.check_job_size(len(requests), self.max_requests)
        prepare = PrepareSoon(self.runner.prepare_soon)

        async def accept(admit: Callable[[int], None]) -> tuple[JobRecord, bool]:
            admit(len(requests))  # an overloaded cluster does no work
            return await accept_requests(self.store, tenant, self.model, self.max_requests,
                                         requests, idempotency_key, self.max_prompt_bytes,
                                         priority, prepare)
        return await self._submit(tenant, idempotency_key, accept, prepare.ready)

    async def _submit(self, tenant: str, key: str, accept: Callable[
            [Callable[[int], None]], Awaitable[tuple[JobRecord, bool]]],
            prepared: dict[int, Prepared] | None = None) -> JobRecord:
        key = validate.idempotency_key(key)
        if key and (existing := self.store.find_job(tenant, key)) is not None:
            return existing  # a retried submission: the first one's job
        admitted = 0

        def admit(n: int) -> None:
            nonlocal admitted
            self.runner.admit(tenant, n)
            admitted += n

        try:
            job, created = await accept(admit)
        except CancelledAfterCommit as late:  # the job exists: it runs, whoever waits for it
            if late.created:
                self.runner.launch(late.job)
            else:
                self.runner.release(tenant, admitted)
            raise
        except BaseException:
            self.runner.release(tenant, admitted)
            raise
        if not created:  # the same key arrived twice while this one was being accepted
            self.runner.release(tenant, admitted)
            return job
        self.runner.launch(job, prepared)
        return job

"""What every API edge does with work: submit a job, or run one request and stream it.

The gRPC servicers and the HTTP API both come here, so that a job or a request takes one
path whatever protocol carried it: the same admission (backpressure), validation and
tokenization (off the event loop), concurrency slots, tracing and dispatch.

    submit_job(tenant, requests, key)    JobIntakeService: admit ─► shape checks ─► store
    submit_file(tenant, chunks, name)      ─► runner.launch (templating at dispatch)
    stream_one(tenant, request, ...)     direct.admitted ─► validate + tokenize (tokenizer's
                                         pool) ─► pump(direct.stream: slot ─► trace ─► backend)
                                         yields TokenChunk ... then one StoredResult

A request outside any job reaches the jobs room through ``cluster.jobs.direct`` alone
(``DirectRequests``: ``admitted`` and ``stream``), never the runner's own parts.
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterable, AsyncIterator, Callable, Sequence

from cluster.api import validate
from cluster.api.chat import ChatTokenizer
from cluster.api.incoming import RequestIn
from cluster.api.intake import JobIntakeService
from cluster.api.tool_calls import ToolFormat
from cluster.backend.protocol import ModelInfo, TokenChunk
from cluster.jobs.direct import DirectRequests
from cluster.jobs.store import JobRecord, StoredResult
from cluster.telemetry.setup import attached, extract_metadata
from workers.messages import Priority

Metadata = Sequence[tuple[str, str]]
Pump = Callable[[AsyncIterator], AsyncIterator]


def _direct(items: AsyncIterator) -> AsyncIterator:
    return items


class Work:
    """``tool_format``: how the served model writes tool calls (None: its chat template
    renders no tools, and a request that offers tools is refused naming the model)."""

    def __init__(self, direct: DirectRequests, model: ModelInfo, tokenizer: ChatTokenizer,
                 intake: JobIntakeService, max_prompt_bytes: int = validate.MAX_PROMPT_BYTES,
                 tool_format: ToolFormat | None = None):
        self._direct = direct
        self._model = model
        self._tokenizer = tokenizer
        self._intake = intake
        self._max_prompt_bytes = max_prompt_bytes
        self._tool_format = tool_format

    @property
    def model(self) -> ModelInfo:
        return self._model

    @property
    def tool_format(self) -> ToolFormat | None:
        return self._tool_format

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes, as log-probabilities show them."""
        return self._tokenizer.token_bytes(token_ids)

    async def submit_job(self, tenant: str, requests: Sequence[RequestIn],
                         idempotency_key: str = "", metadata: Metadata = (),
                         priority: Priority = Priority.BATCH) -> JobRecord:
        """Accept a job (or return the one ``idempotency_key`` already names) and launch it;
        its span joins the caller's trace, if any. ``priority``: the lane its requests take."""
        with attached(extract_metadata(metadata)):
            return await self._intake.submit_requests(tenant, requests, idempotency_key,
                                                      priority)

    async def submit_file(self, tenant: str, chunks: AsyncIterable[bytes], name: str,
                          idempotency_key: str = "", metadata: Metadata = (),
                          priority: Priority = Priority.BATCH) -> JobRecord:
        """Accept a batch file streamed in chunks (see ``cluster.api.intake``) and launch it."""
        with attached(extract_metadata(metadata)):
            return await self._intake.submit_file(tenant, chunks, name, idempotency_key,
                                                  priority)

    async def stream_one(self, tenant: str, request: RequestIn, field: str,
                         metadata: Metadata = (), remaining_s: float | None = None,
                         pump: Pump = _direct, priority: Priority = Priority.INTERACTIVE
                         ) -> AsyncIterator[TokenChunk | StoredResult]:
        """Run one request outside any job: its token chunks as they come, then its result.

        ``remaining_s`` is the caller's own deadline, if it has one; the configured request
        timeout applies either way. ``pump`` runs the request (the gRPC edge pumps it from a
        task the RPC's end cancels, so its span is current in that task only, never across a
        yield); closing this stream early aborts the request on its worker. An interactive
        request (the default) is shed when it would start past ``remaining_s`` or the
        configured bound (``cluster.jobs.shedding``); a batch one never is.
        """
        # admitted before tokenizing: an overloaded cluster does no work
        with self._direct.admitted(tenant, priority, remaining_s) as ticket:
            new = await self._tokenizer.off_loop(
                validate.new_request, request, field, self._model, self._tokenizer.render,
                self._max_prompt_bytes, self._tool_format)
            stream = self._direct.stream(tenant, new, metadata, remaining_s, priority, ticket)
            async with contextlib.aclosing(pump(stream)) as items:
                async for item in items:
                    yield item

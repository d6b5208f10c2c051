"""Validation of incoming requests: every field checked, tokenized, before anything runs.

Turns the edges' typed requests (``cluster.api.incoming.RequestIn``, from gRPC, HTTP or a
batch file alike) into the job store's ``NewRequest`` (token ids + ``SamplingParams``).
Every problem raises ``FieldError``, a ``ValueError`` whose message starts with the field's
path (``requests[3].messages[1].content: ...``) and says what to do; the edge maps it to
``INVALID_ARGUMENT`` (``LimitExceeded``, a job over the size limit, to ``RESOURCE_EXHAUSTED``).
Nothing here touches the job store or the backend.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from cluster.api.incoming import ABSENT, MessageIn, Messages, RequestIn, Tokens
from cluster.backend.protocol import ModelInfo
from cluster.jobs.store import NewRequest
from workers.messages import SamplingParams

ROLES = ("system", "user", "assistant", "tool")
MAX_CUSTOM_ID_BYTES = 256
MAX_STOP_STRINGS = 16        # as common APIs allow (OpenAI: 4, Anthropic: more)
MAX_STOP_BYTES = 256
QUOTE_CHARS = 64             # an error quotes at most this much of the offending value
MAX_PROMPT_BYTES = 1 << 20   # [limits] max_prompt_bytes: the default

Render = Callable[[Sequence[dict[str, str]]], list[int]]


class FieldError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def quoted(value: str) -> str:
    """``value`` as an error message shows it: at most ``QUOTE_CHARS`` characters of it.

    A message that echoed a 100 KB value whole would overflow gRPC's metadata limit and reach
    the caller as ``RESOURCE_EXHAUSTED`` instead of the error it describes."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return f"{value[:QUOTE_CHARS]!r}... ({len(value)} characters)"


class LimitExceeded(FieldError):
    """Well-formed input over a configured size limit (``RESOURCE_EXHAUSTED`` at the edge,
    as gRPC itself answers an oversized message)."""


def content_text(value, field: str) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str) or part.get("type") != "text":
                raise FieldError(f"{field}[{i}]", 'a content part must be {"type": "text", '
                                 '"text": "..."}')
            parts.append(text)
        return "".join(parts)
    raise FieldError(field, f"must be a string (or a list of text parts), got {_kind(value)}")


def _kind(value) -> str:
    """What a JSON value that is not text is, as an error names it."""
    if value is ABSENT:
        return "missing"
    if value is None:
        return "null"
    if isinstance(value, bool):  # before numbers: a bool is an int
        return "a boolean"
    return "an object" if isinstance(value, dict) else "a number"


def messages_to_dicts(messages: Sequence[MessageIn], field: str) -> list[dict[str, str]]:
    if not messages:
        raise FieldError(field, "empty message list; give at least one message")
    out = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise FieldError(f"{field}[{i}].role",
                             f"unknown role {quoted(message.role)}; use one of {', '.join(ROLES)}")
        out.append({"role": message.role,
                    "content": content_text(message.content, f"{field}[{i}].content")})
    return out


def check_prompt_bytes(messages: Sequence[dict[str, str]], field: str, max_bytes: int) -> None:
    """The size cap, checked before tokenizing (1 MiB of text takes seconds to tokenize)."""
    size = sum(len(m["content"].encode()) for m in messages)
    if size > max_bytes:
        raise FieldError(field, f"{size} bytes of text exceed the limit of {max_bytes} "
                         "([limits] max_prompt_bytes); shorten the prompt")


def check_context(ids: Sequence[int], field: str, context: int) -> Sequence[int]:
    """The token cap, checked before each id is (a 64 MiB message holds 8M token ids)."""
    if len(ids) >= context:
        raise FieldError(f"{field}.prompt", f"{len(ids)} tokens reach the model's context of "
                         f"{context}; shorten the prompt")
    return ids


def check_token_ids(ids: Sequence[int], field: str, vocab_size: int) -> tuple[int, ...]:
    if not ids:
        raise FieldError(field, "empty token list; give at least one token id")
    for j, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise FieldError(f"{field}[{j}]", f"token id {token} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return tuple(int(t) for t in ids)


def prompt_tokens(request: RequestIn, field: str, model: ModelInfo, render: Render,
                  max_prompt_bytes: int = MAX_PROMPT_BYTES) -> tuple[int, ...]:
    prompt = request.prompt
    if isinstance(prompt, Messages):
        messages = messages_to_dicts(prompt.items, f"{field}.messages")
        check_prompt_bytes(messages, f"{field}.messages", max_prompt_bytes)
        ids = check_context(render(messages), field, model.max_context)
        return check_token_ids(ids, f"{field}.messages (rendered)", model.vocab_size)
    if isinstance(prompt, Tokens):
        ids = check_context(prompt.ids, field, model.max_context)
        return check_token_ids(ids, f"{field}.tokens.ids", model.vocab_size)
    raise FieldError(f"{field}.prompt", "missing: set messages or tokens")


def sampling_params(request: RequestIn, field: str, prompt_len: int, model: ModelInfo
                    ) -> SamplingParams:
    s = request.sampling
    context = model.max_context
    if s.max_tokens < 1:
        raise FieldError(f"{field}.sampling.max_tokens", f"must be >= 1, got {s.max_tokens}")
    if prompt_len + s.max_tokens > context:
        raise FieldError(f"{field}.sampling.max_tokens",
                         f"{s.max_tokens} plus the {prompt_len}-token prompt exceeds the model's "
                         f"context of {context}; use at most {context - prompt_len}")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise FieldError(f"{field}.sampling.temperature", f"must be >= 0, got {s.temperature}")
    top_p = 1.0 if s.top_p is None else s.top_p
    if not 0 < top_p <= 1:
        raise FieldError(f"{field}.sampling.top_p", f"must be in (0, 1], got {top_p}")
    check_stop(s.stop, f"{field}.sampling.stop")
    return SamplingParams(max_tokens=s.max_tokens, temperature=float(s.temperature),
                          top_p=float(top_p), seed=int(s.seed), stop=tuple(s.stop))


def check_stop(stop: Sequence[str], field: str) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise FieldError(field, f"{len(stop)} stop strings; use at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(stop):
        if not text:
            raise FieldError(f"{field}[{i}]", "stop strings must not be empty")
        if len(text.encode()) > MAX_STOP_BYTES:
            raise FieldError(f"{field}[{i}]", f"{len(text.encode())} bytes; a stop string may "
                             f"have at most {MAX_STOP_BYTES}")


def check_custom_id(custom_id: str, field: str) -> str:
    size = len(custom_id.encode())
    if size > MAX_CUSTOM_ID_BYTES:
        raise FieldError(field, f"{size} bytes; use at most {MAX_CUSTOM_ID_BYTES}")
    return custom_id


def new_request(request: RequestIn, field: str, model: ModelInfo, render: Render,
                max_prompt_bytes: int = MAX_PROMPT_BYTES) -> NewRequest:
    check_custom_id(request.custom_id, f"{field}.custom_id")
    prompt = prompt_tokens(request, field, model, render, max_prompt_bytes)
    sampling = sampling_params(request, field, len(prompt), model)
    return NewRequest(custom_id=request.custom_id, prompt=prompt, sampling=sampling)


def idempotency_key(key: str) -> str:
    if len(key) > 256:
        raise FieldError("idempotency_key", f"{len(key)} characters; use at most 256")
    return key


def check_job_size(n: int, max_requests: int) -> None:
    """The cheap check, done before admission and tokenization."""
    if n == 0:
        raise FieldError("requests", "empty job; a job needs at least one request")
    if n > max_requests:
        raise LimitExceeded("requests", f"{n} requests exceed the limit of {max_requests} "
                            "per job; split the job")


def job_requests(requests: Sequence[RequestIn], max_requests: int, model: ModelInfo,
                 render: Render, max_prompt_bytes: int = MAX_PROMPT_BYTES) -> list[NewRequest]:
    """Validate a whole job; the first problem found raises, naming its request and field."""
    check_job_size(len(requests), max_requests)
    seen: dict[str, int] = {}
    out = []
    for i, request in enumerate(requests):
        field = f"requests[{i}]"
        if not request.custom_id:
            raise FieldError(f"{field}.custom_id", "required: give every request a unique id")
        if request.custom_id in seen:
            raise FieldError(f"{field}.custom_id", f"duplicate {quoted(request.custom_id)} (first at "
                             f"requests[{seen[request.custom_id]}]); custom ids must be unique")
        seen[request.custom_id] = i
        out.append(new_request(request, field, model, render, max_prompt_bytes))
    return out

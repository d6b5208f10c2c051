"""Validation of incoming requests: every field checked, tokenized, before anything runs.

Turns the edges' typed requests (``cluster.api.incoming.RequestIn``, from gRPC, HTTP or a
batch file alike) into the job store's ``NewRequest`` (token ids + ``SamplingParams``, with the
response format and log-probabilities asked for). A ``response_format``'s JSON schema is
compiled here (``workers.engine.constraints.check_format``), so a schema the grammar library
cannot compile is refused when the request arrives, naming the schema's path, never at decode
time. Tools (HTTP chat only) are rendered by the chat template and ``tool_choice`` required or
a named function becomes the request's grammar (``cluster.api.tool_calls``).
Every problem raises ``FieldError``, a ``ValueError`` whose message starts with the field's
path (``requests[3].messages[1].content: ...``) and says what to do; the edge maps it to
``INVALID_ARGUMENT`` (``LimitExceeded``, a job over the size limit, to ``RESOURCE_EXHAUSTED``).
Nothing here touches the job store or the backend.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from cluster.api.incoming import ABSENT, Json, MessageIn, Messages, RequestIn, Tokens
from cluster.backend.protocol import ModelInfo
from cluster.jobs.store import NewRequest
from workers.messages import MAX_TOP_LOGPROBS, ResponseFormat, SamplingParams

if TYPE_CHECKING:
    from cluster.api.tool_calls import ToolFormat

ROLES = ("system", "user", "assistant", "tool")
MAX_CUSTOM_ID_BYTES = 256
MAX_STOP_STRINGS = 16        # as common APIs allow (OpenAI: 4, Anthropic: more)
MAX_STOP_BYTES = 256
QUOTE_CHARS = 64             # an error quotes at most this much of the offending value
MAX_PROMPT_BYTES = 1 << 20   # [limits] max_prompt_bytes: the default
FORMAT_TYPES = ("text", "json_object", "json_schema")
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a json_schema's name

# Messages as the chat template reads them ({role, content}, an assistant's tool_calls, a
# tool's tool_call_id) to token ids; called with ``tools=`` (OpenAI function specs) only when
# the request offers tools.
Render = Callable[..., list[int]]


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


def messages_to_dicts(messages: Sequence[MessageIn], field: str) -> list[dict[str, Any]]:
    if not messages:
        raise FieldError(field, "empty message list; give at least one message")
    out = []
    for i, message in enumerate(messages):
        path = f"{field}[{i}]"
        if message.role not in ROLES:
            raise FieldError(f"{path}.role",
                             f"unknown role {quoted(message.role)}; use one of {', '.join(ROLES)}")
        if message.tool_calls is not None:
            out.append(_assistant_calls(message, path))
            continue
        item: dict[str, Any] = {"role": message.role,
                                "content": content_text(message.content, f"{path}.content")}
        if message.tool_call_id is not None:
            if message.role != "tool" or not isinstance(message.tool_call_id, str):
                raise FieldError(f"{path}.tool_call_id", "a string, on a tool message only")
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def _assistant_calls(message: MessageIn, path: str) -> dict[str, Any]:
    """An assistant turn that made calls, as templates read it: content may be null, each
    call's ``arguments`` (JSON text on the wire) an object."""
    if message.role != "assistant":
        raise FieldError(f"{path}.tool_calls", "only an assistant message makes tool calls")
    calls = message.tool_calls
    if not isinstance(calls, list) or not calls:
        raise FieldError(f"{path}.tool_calls", "must be a non-empty list of "
                         "{id, type: function, function: {name, arguments}}")
    rendered = []
    for j, call in enumerate(calls):
        where = f"{path}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise FieldError(where, "must be {id, type: function, function: {name, arguments}}")
        if not isinstance(fn.get("name"), str) or not isinstance(call.get("id", ""), str):
            raise FieldError(f"{where}.function.name", "required: a string (and id a string)")
        try:
            arguments = json.loads(fn.get("arguments", "{}"))
        except (TypeError, ValueError):
            arguments = None
        if not isinstance(arguments, dict):
            raise FieldError(f"{where}.function.arguments", "must be JSON text of an object, "
                             "as the call came back")
        rendered.append({"id": call.get("id", ""), "type": "function",
                         "function": {"name": fn["name"], "arguments": arguments}})
    content = message.content
    text = None if content is None or content is ABSENT else content_text(content,
                                                                          f"{path}.content")
    return {"role": "assistant", "content": text, "tool_calls": rendered}


def check_prompt_bytes(messages: Sequence[dict[str, Any]], field: str, max_bytes: int) -> None:
    """The size cap, checked before tokenizing (1 MiB of text takes seconds to tokenize)."""
    size = sum(len((m["content"] or "").encode()) for m in messages)
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
        rendered = (render(messages) if request.tools is None
                    else render(messages, tools=list(request.tools.tools)))
        ids = check_context(rendered, field, model.max_context)
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
                          top_p=float(top_p), seed=int(s.seed), stop=tuple(s.stop),
                          response_format=checked_format(request.response_format,
                                                         f"{field}.response_format"),
                          logprobs=logprobs_count(request, field))


def format_of(value: Json, field: str) -> ResponseFormat | None:
    """A ``response_format`` (OpenAI's shape) as the engine's ``ResponseFormat``, its shape
    checked (not compiled: ``checked_format``); None for free text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError(field, 'must be an object such as {"type": "json_object"}')
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise FieldError(f"{field}.type", f"must be one of {', '.join(FORMAT_TYPES)}, got "
                         f"{quoted(kind) if isinstance(kind, str) else _kind(kind)}")
    _only(value, ("type", "json_schema") if kind == "json_schema" else ("type",), field,
          f"a {kind} response_format has")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = value.get("json_schema")
    path = f"{field}.json_schema"
    if not isinstance(spec, dict):
        raise FieldError(path, "required: {name, schema, strict}")
    _only(spec, ("name", "schema", "strict"), path, "a json_schema has")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise FieldError(f"{path}.name", "required: 1 to 64 letters, digits, _ or -")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise FieldError(f"{path}.schema", "required: a JSON schema object")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError(f"{path}.strict", "must be true or false")
    return ResponseFormat("json_schema", schema=json.dumps(schema, sort_keys=True), name=name,
                          strict=bool(strict))


def _only(value: dict, keys: tuple[str, ...], field: str, what: str) -> None:
    extra = sorted(k for k, v in value.items() if k not in keys and v is not None)
    if extra:
        raise FieldError(f"{field}.{extra[0]}", f"not supported by orchard; {what} "
                         f"{', '.join(keys)}")


def checked_format(value: Json, field: str) -> ResponseFormat | None:
    """``format_of``, and compiled: a schema the grammar library cannot compile raises
    ``FieldError`` naming the schema's path (``...response_format.json_schema.schema.items``)."""
    fmt = format_of(value, field)
    if fmt is not None:
        _compile(fmt, field, "response_format")
    return fmt


def _compile(fmt: ResponseFormat, field: str, root: str) -> None:
    from workers.engine.constraints import ConstraintError, check_format  # llguidance

    try:
        check_format(fmt)
    except ConstraintError as exc:
        message = str(exc).removeprefix(f"{exc.path}: ")
        raise FieldError(field + exc.path.removeprefix(root), message) from None


def logprobs_count(request: RequestIn, field: str) -> int | None:
    """The alternatives per token a request asks for (None: no log-probabilities)."""
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise FieldError(f"{field}.top_logprobs", f"must be from 0 to {MAX_TOP_LOGPROBS}, got "
                         f"{request.top_logprobs}")
    if request.top_logprobs and not request.logprobs:
        raise FieldError(f"{field}.top_logprobs", "needs logprobs")
    return request.top_logprobs if request.logprobs else None


def tool_grammar(request: RequestIn, field: str, model: ModelInfo,
                 tool_format: ToolFormat | None) -> ResponseFormat | None:
    """The grammar a request's ``tool_choice`` imposes (None: none, or no tools); refused when
    the model renders no tools, or beside a ``response_format`` that would keep calls out."""
    tools = request.tools
    if tools is None:
        return None
    if tool_format is None:
        raise FieldError(f"{field}.tools", f"model {model.model_id!r} has no tool calling: its "
                         "chat template renders no tools; leave tools out")
    if tools.choice != "none" and format_of(request.response_format,
                                            f"{field}.response_format") is not None:
        raise FieldError(f"{field}.response_format", "cannot be combined with tools (the format "
                         "would keep calls out); leave one out, or set tool_choice none")
    try:
        grammar = tool_format.grammar(tools)
    except FieldError as exc:
        raise FieldError(f"{field}.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None
    if grammar is not None:
        _compile(grammar, f"{field}.tools", "grammar")
    return grammar


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
                max_prompt_bytes: int = MAX_PROMPT_BYTES,
                tool_format: ToolFormat | None = None) -> NewRequest:
    """The request checked and tokenized; ``tool_format``: how the model writes tool calls
    (None: its template renders no tools, and a request with tools is refused)."""
    check_custom_id(request.custom_id, f"{field}.custom_id")
    grammar = tool_grammar(request, field, model, tool_format)
    prompt = prompt_tokens(request, field, model, render, max_prompt_bytes)
    sampling = sampling_params(request, field, len(prompt), model)
    if grammar is not None:
        sampling = replace(sampling, response_format=grammar)
    from cluster.api import cache_fields  # it reads this module's checks

    diagnose = request.cache.diagnostics
    return NewRequest(custom_id=request.custom_id, prompt=prompt, sampling=sampling,
                      cache=cache_fields.cache_controls(request, field, prompt, render),
                      cache_salt=cache_fields.salt_of(request, field), diagnose=diagnose,
                      message_ends=cache_fields.message_ends(request, prompt, render)
                      if diagnose else (), verify=request.cache.verify)


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

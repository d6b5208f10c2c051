"""Anthropic's Messages API shapes: a ``POST /v1/messages`` body as the edges' ``RequestIn``,
and a result as Anthropic's message, its stream events and its errors.

    request   model, max_tokens (required), messages (user and assistant turns, content a
              string or text blocks), system (a string or text blocks), stop_sequences,
              temperature (default 1.0, as Anthropic's), top_p, stream, metadata ({user_id}: informational), and
              cache_control at the top level, on a system or message text block (writing
              stops at the last breakpoint; ``cluster.api.cache_fields``), orchard's
              a session header (``x-session-id``, ``x-claude-code-session-id``, ...: the
              router's tie-break), cache_diagnostics (unstreamed: the message carries
              ``cache_diagnostics``), Anthropic's ``diagnostics`` (taken off the body
              before these shapes, by ``cluster.api.http_messages``: a batch refuses it);
              any other field,
              a message key or a block type other than text is refused naming it (400)
    message   {id, type: message, role: assistant, model, content: [{type: text, text}],
              stop_reason: end_turn | max_tokens | stop_sequence, stop_sequence, usage}
    usage     input_tokens (computed and not stored), output_tokens,
              cache_read_input_tokens, cache_creation_input_tokens and cache_creation
              (ephemeral_5m_input_tokens, ephemeral_1h_input_tokens): the prompt's tokens
              are exactly input + cache read + cache creation, as Anthropic counts them
    stream    message_start, content_block_start, ping, content_block_delta (text_delta) per
              token chunk, content_block_stop, message_delta (stop reason, output tokens and
              the input totals: Anthropic's message_delta has no TTL split, so a streamed
              message carries the totals only), message_stop
    error     {type: error, error: {type, message}} with the status orchard's own mapping
              gives (``cluster.api.http_errors``)
"""
from __future__ import annotations

from typing import Any, Callable

from cluster.api import cache_fields, incoming, openai_fields
from cluster.api.incoming import CacheIn, MessageIn, Messages, RequestIn
from cluster.api.validate import FieldError
from cluster.jobs.store import StoredResult

PATH = "/v1/messages"
READ = frozenset(("model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
                  "top_p", "stream", "metadata", "cache_control", "cache_diagnostics"))
MESSAGE_KEYS = ("role", "content")
DEFAULT_TEMPERATURE = 1.0  # Anthropic's default (orchard's own APIs default to greedy)
ROLES = ("user", "assistant")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 504: "api_error"}


def request_of(body: dict, headers: dict[str, str] | None = None) -> RequestIn:
    """The request a Messages body asks for (unchecked beyond its JSON shape); a session
    header (``openai_fields.SESSION_HEADERS``, lower-case names) names its session."""
    for key, value in body.items():
        if value is not None and key not in READ:
            raise FieldError(key, "not supported by orchard's Messages API; leave it out")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise FieldError("max_tokens", "required: an integer >= 1")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise FieldError("stop_sequences", "must be a list of strings")
    numbers = {k: body.get(k) for k in ("temperature", "top_p")}
    for key, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise FieldError(key, "must be a number")
    _metadata(body.get("metadata"))
    temperature = DEFAULT_TEMPERATURE if numbers["temperature"] is None else numbers[
        "temperature"]
    sampling = incoming.sampling(max_tokens, temperature, numbers["top_p"], stop=stops)
    return RequestIn("", Messages(_system(body.get("system")) + _turns(body.get("messages"))),
                     sampling, cache=CacheIn(control=body.get("cache_control"),
                                             key=_session(headers or {}),
                                             diagnostics=openai_fields.diagnostics_of(body)))


def _session(headers: dict[str, str]) -> str:
    return next((headers[h] for h in openai_fields.SESSION_HEADERS if headers.get(h)), "")


def _system(system: Any) -> tuple[MessageIn, ...]:
    if system is None:
        return ()
    if not isinstance(system, (str, list)):
        raise FieldError("system", "must be a string or a list of text blocks")
    return (MessageIn("system", system),)


def _turns(messages: Any) -> tuple[MessageIn, ...]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise FieldError("messages", "must be a list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        for key in message:
            if key not in MESSAGE_KEYS and message[key] is not None:
                raise FieldError(f"messages[{i}].{key}", "not supported by orchard; a message "
                                 "has role and content")
        if message.get("role") not in ROLES:
            raise FieldError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
        out.append(MessageIn(message["role"], message.get("content")))
    return tuple(out)


def _metadata(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"user_id"} or not isinstance(
            value.get("user_id", ""), (str, type(None))):
        raise FieldError("metadata", "must be {\"user_id\": \"...\"} (informational)")


# ------------------------------------------------------------------ responses

def message_id(request_id: str) -> str:
    return f"msg_{request_id}"


def stop_of(r: StoredResult) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence): the stop string the engine cut the text at
    (``StoredResult.stop_sequence``), the model's end of turn, or ``max_tokens``."""
    if r.finish_reason == "length":
        return "max_tokens", None
    if r.stop_sequence:
        return "stop_sequence", r.stop_sequence
    return "end_turn", None


def usage(r: StoredResult) -> dict:
    written = r.written_input_tokens
    return {"input_tokens": r.prompt_tokens - r.cached_tokens - written,
            "output_tokens": len(r.output_tokens),
            "cache_read_input_tokens": r.cached_tokens,
            "cache_creation_input_tokens": written,
            "cache_creation": cache_fields.cache_creation(written, r.write_ttl_s)}


def message_body(r: StoredResult, model: str,
                 token_bytes: Callable[[list[int]], list[bytes]]) -> dict:
    reason, sequence = stop_of(r)
    body = {"id": message_id(r.request_id), "type": "message", "role": "assistant",
            "model": model, "content": [{"type": "text", "text": r.text}],
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(r)}
    if r.diagnosis is not None:
        body["cache_diagnostics"] = cache_fields.diagnosis_body(r.diagnosis, token_bytes)
    if r.verification is not None:
        body["cache_verify"] = cache_fields.verification_body(r.verification)
    return body


def start_events(request_id: str, model: str, extra: dict | None = None
                 ) -> list[tuple[str, dict]]:
    """The events before the first text: the message (its usage not known yet, ``extra``
    fields known before it runs: its ``diagnostics``), its block."""
    message = {"id": message_id(request_id), "type": "message", "role": "assistant",
               "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 0, "output_tokens": 0}, **(extra or {})}
    return [("message_start", {"type": "message_start", "message": message}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("ping", {"type": "ping"})]


def text_event(text: str) -> tuple[str, dict]:
    return ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": text}})


def end_events(r: StoredResult) -> list[tuple[str, dict]]:
    reason, sequence = stop_of(r)
    totals = {k: v for k, v in usage(r).items() if k != "cache_creation"}
    return [("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": totals}),
            ("message_stop", {"type": "message_stop"})]


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}

"""The fields of an OpenAI request body: those orchard reads, those it takes as harmless, and a
refusal naming every other, so that nothing is accepted and then dropped.

    read       implemented (docs/api.md says what each does): ``READ[endpoint]``
    harmless   informational, accepted and not used: ``user`` (a string), ``metadata`` (an
               object of strings), ``store`` (false only: orchard keeps no completions),
               ``service_tier`` (``auto`` or ``default`` only: there is one tier)
    neutral    not implemented, sent with the value that asks for nothing (``n: 1``,
               ``presence_penalty: 0``, ...: ``NEUTRAL``), as many clients send them
    null       any field: not given, as OpenAI reads it
    the rest   ``FieldError`` naming the field (400 / INVALID_ARGUMENT): a field orchard does
               not implement, a neutral field with another value, and a name no API has (a
               typo is refused, not ignored)

The cache controls (``cache_control``, ``cache_salt``, ``prompt_cache_key``,
``prompt_cache_retention``, orchard's ``cache: {read, write, verify}`` and
``cache_diagnostics``; the last two on unstreamed single requests only) are read into a ``CacheIn``
here (``cache_of``: their JSON types, and ``prompt_cache_retention``, which only says
``in_memory``: orchard keeps nothing 24 hours), checked in ``cluster.api.cache_fields``; a
session header names the session when the body gives no ``prompt_cache_key``
(``SESSION_HEADERS``).

A message may have ``role``, ``content``, ``tool_calls``, ``tool_call_id`` and
``cache_control``; any other key
(``name``, ``audio``, ``refusal`` ...) is refused naming it. A batch line (the Batch API's, an
``orchard submit`` file's) cannot stream or offer tools: its answer is a line of text in a file
(``check_batch_body``).

One table for the HTTP endpoints, the Batch API's lines and ``orchard submit`` files
(``cluster.api.batchfile``, which the command line shares): one list, one wording.
"""
from __future__ import annotations

from typing import Any

from cluster.api.incoming import CacheIn
from cluster.api.validate import FieldError
from workers.messages import MAX_TOP_LOGPROBS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "response_format", "logprobs", "cache_control", "cache_salt",
           "prompt_cache_key", "prompt_cache_retention", "cache", "cache_diagnostics",
           "service_tier")  # the request's priority (``cluster.api.priority``)
READ = {
    CHAT: frozenset(_COMMON + ("messages", "max_completion_tokens", "top_logprobs", "tools",
                               "tool_choice", "parallel_tool_calls")),
    COMPLETIONS: frozenset(_COMMON + ("prompt",)),
}
HARMLESS = ("user", "metadata", "store")
BATCH_TIERS = ("auto", "flex")  # a batch line runs as batch work: flex
NEUTRAL: dict[str, Any] = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
                           "logit_bias": {}, "echo": False, "suffix": "", "modalities": ["text"]}
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "cache_control")
RETENTIONS = ("in_memory",)  # OpenAI's 24h is not offered: orchard keeps 5m, 1h or its TTL
CACHE_USE_KEYS = ("read", "write", "verify")
# The headers that name a client's session, first found wins (prompt_cache_key first of all):
# orchard's own, then those agent clients send.
SESSION_HEADERS = ("x-session-id", "session_id", "x-claude-code-session-id")
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

# Why a field is refused, where more can be said than that orchard does not implement it.
_WHY = {
    "n": "only n = 1; send the request n times (with different seeds)",
    "best_of": "only best_of = 1",
    "presence_penalty": "not implemented; only 0",
    "frequency_penalty": "not implemented; only 0",
    "logit_bias": "not implemented; only {}",
    "echo": "not implemented; only false",
    "suffix": "not implemented (no insertion); only an empty suffix",
    "modalities": 'orchard answers text only; only ["text"]',
    "audio": "orchard answers text only",
    "functions": "deprecated by OpenAI: offer tools instead",
    "function_call": "deprecated by OpenAI: use tool_choice with tools",
    "store": "orchard keeps no completions; only false",
}


def refused(key: str) -> FieldError:
    why = _WHY.get(key, "not supported by orchard")
    return FieldError(key, f"{why}; leave it out")


def check_fields(body: dict, endpoint: str) -> None:
    """Every field of ``body`` is read, harmless or neutral; else ``FieldError`` naming it."""
    read = READ[endpoint]
    for key, value in body.items():
        if value is None or key in read:
            continue
        if key in HARMLESS:
            _harmless(key, value)
        elif not _neutral(key, value):
            raise refused(key)
    options = body.get("stream_options")
    if isinstance(options, dict):
        for key, value in options.items():
            if key not in STREAM_OPTIONS:
                raise FieldError(f"stream_options.{key}", "not a stream option; use "
                                 "include_usage")
            if key == "include_obfuscation" and value not in (None, False):
                raise FieldError("stream_options.include_obfuscation", "orchard does not pad "
                                 "its events; only false")


def check_batch_body(body: dict) -> None:
    """What a batch line's body cannot ask for: a stream, or tools (its answer is a line of
    text in the output file), or a priority other than batch."""
    if body.get("stream") not in (None, False):
        raise FieldError("stream", "a batch line is answered in the output file; leave it out")
    if body.get("stream_options") is not None:
        raise FieldError("stream_options", "a batch line is not streamed; leave it out")
    if body.get("service_tier") not in (None, *BATCH_TIERS):
        raise FieldError("service_tier", "a batch line runs as batch work: only "
                         f"{' or '.join(BATCH_TIERS)}; leave it out")
    if body.get("cache_diagnostics"):
        raise FieldError("cache_diagnostics", "answered on single requests only; leave it "
                         "out of a batch")
    if isinstance(body.get("cache"), dict) and body["cache"].get("verify"):
        raise FieldError("cache.verify", "answered on single requests only; leave it out of "
                         "a batch")
    for key in ("tools", "tool_choice"):
        if body.get(key) is not None:
            raise FieldError(key, "not supported in a batch (its output lines carry text); "
                             "send requests with tools to POST /v1/chat/completions")
    for i, message in enumerate(body.get("messages") or ()):
        for key in ("tool_calls", "tool_call_id"):
            if isinstance(message, dict) and message.get(key) is not None:
                raise FieldError(f"messages[{i}].{key}", "not supported in a batch; send tool "
                                 "loops to POST /v1/chat/completions")


def check_message_keys(messages: list) -> None:
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            for key in message:
                if key not in MESSAGE_KEYS and message[key] is not None:
                    raise FieldError(f"messages[{i}].{key}", "not supported by orchard; a "
                                     f"message has {', '.join(MESSAGE_KEYS)}")


def cache_of(body: dict, headers: dict[str, str] | None = None) -> CacheIn:
    """The cache controls of a body (their JSON types checked), the session from ``headers``
    (lower-case names) where the body names no ``prompt_cache_key``."""
    salt, key = body.get("cache_salt"), body.get("prompt_cache_key")
    for name, value in (("cache_salt", salt), ("prompt_cache_key", key)):
        if value is not None and not isinstance(value, str):
            raise FieldError(name, f"must be a string, got {_shown(value)}")
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in RETENTIONS:
        raise FieldError("prompt_cache_retention", f"{_shown(retention)} is not offered: "
                         "orchard keeps a cache entry at most 1 hour; use in_memory (the "
                         'store\'s TTL) or cache_control {"type": "ephemeral", "ttl": "1h"}')
    use = body.get("cache")
    if use is None:
        use = {}
    if not isinstance(use, dict):
        raise FieldError("cache", 'must be an object such as {"read": false}')
    for name, value in use.items():
        if name not in CACHE_USE_KEYS:
            raise FieldError(f"cache.{name}", "not a cache option; use read, write or verify")
        if not isinstance(value, bool):
            raise FieldError(f"cache.{name}", f"must be true or false, got {_shown(value)}")
    if not key and headers:
        key = next((headers[h] for h in SESSION_HEADERS if headers.get(h)), "")
    return CacheIn(control=body.get("cache_control"), salt=salt or "", key=key or "",
                   read=use.get("read", True), write=use.get("write", True),
                   diagnostics=diagnostics_of(body), verify=use.get("verify", False))


def diagnostics_of(body: dict) -> bool:
    """``cache_diagnostics``: true or false, on an unstreamed answer only."""
    value = body.get("cache_diagnostics")
    if value is not None and not isinstance(value, bool):
        raise FieldError("cache_diagnostics", f"must be true or false, got {_shown(value)}")
    if value and body.get("stream"):
        raise FieldError("cache_diagnostics", "answered on unstreamed requests only; leave "
                         "it out or set stream false")
    use = body.get("cache")
    if isinstance(use, dict) and use.get("verify") and body.get("stream"):
        raise FieldError("cache.verify", "answered on unstreamed requests only; leave it out "
                         "or set stream false")
    return bool(value)


def logprobs_of(body: dict, endpoint: str) -> tuple[bool, int]:
    """(logprobs asked, alternatives per token) of a body: chat's ``logprobs: true`` and
    ``top_logprobs``, or a completion's ``logprobs: N``."""
    value = body.get("logprobs")
    if endpoint == COMPLETIONS:
        if value is None:
            return False, 0
        return True, _count(value, "logprobs")
    if value is not None and not isinstance(value, bool):
        raise FieldError("logprobs", f"must be true or false, got {_shown(value)}")
    top = body.get("top_logprobs")
    count = 0 if top is None else _count(top, "top_logprobs")
    if top is not None and not value:
        raise FieldError("top_logprobs", "needs logprobs: true")
    return bool(value), count


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(key, f"must be an integer, got {_shown(value)}")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise FieldError(key, f"must be from 0 to {MAX_TOP_LOGPROBS}, got {_shown(value)}")
    return value


def _neutral(key: str, value: Any) -> bool:
    if key not in NEUTRAL:
        return False
    neutral = NEUTRAL[key]
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _harmless(key: str, value: Any) -> None:
    if key == "user" and not isinstance(value, str):
        raise FieldError("user", "must be a string")
    if key == "store" and value is not False:
        raise refused("store")
    if key == "metadata":
        if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
            raise FieldError("metadata", f"must be an object of at most {MAX_METADATA_PAIRS} "
                             "strings")
        for name, text in value.items():
            if len(name) > MAX_METADATA_KEY or not isinstance(text, str) or len(
                    text) > MAX_METADATA_VALUE:
                raise FieldError(f"metadata.{name[:MAX_METADATA_KEY]}", "keys of at most "
                                 f"{MAX_METADATA_KEY} characters, string values of at most "
                                 f"{MAX_METADATA_VALUE}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else f"{text[:64]}... ({len(text)} characters)"

"""A request's cache controls checked: from the edges' ``CacheIn`` and the prompt's
``cache_control`` marks to the engine's ``CacheControls`` and the namespace's salt.

What a request may ask (every edge alike; ``docs/api.md`` has the wire)::

    cache_control (top level)      {"type": "ephemeral", "ttl": "5m" | "1h"}: the breakpoint
                                   follows the conversation (every full block is written)
    messages[i].cache_control      a breakpoint after message i
    messages[i].content[j]         a breakpoint after content part j of message i
      .cache_control
    cache_breakpoints              [{tokens, ttl}] (gRPC, batch lines): a breakpoint after
                                   the first ``tokens`` tokens of the prompt
    cache: {read, write, verify}   read false: the whole prompt is computed; write false:
                                   nothing is stored; verify (with read false, single
                                   unstreamed requests): the cached path is run too and its
                                   tokens compared
    cache_salt                     enters the namespace root (``router.kv.key``)
    prompt_cache_key               (or a session header) the router's tie-break
    cache_diagnostics              (HTTP single requests, unstreamed) the answer says how
                                   much was cached, why not the rest, and where the prompt
                                   left the nearest sequence its worker held

Rules, stated once:

- **Where writing stops.** The last breakpoint: only the full blocks of the prompt before
  it are stored (blocks past it are computed, not stored; no output either). A breakpoint
  after a message or a part is the token offset where the prompt rendered up to it stops
  agreeing with the whole prompt rendered (the chat template's own boundary, whatever it
  renders between turns). No breakpoint at all: every full block is written, as always.
- **At most 4 breakpoints** (Anthropic's limit), the top-level one counted.
- **One TTL per request.** ``ttl`` is ``5m`` (300 s, the default of a ``cache_control``) or
  ``1h`` (3600 s); a request with no ``cache_control`` keeps the store's TTL. Breakpoints
  asking different TTLs are refused: the ledger keeps one TTL per writer, and a price split
  by breakpoint would not match what was kept.
- A salt and a key are at most 256 bytes of UTF-8.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from cluster.api.incoming import Json, MessageIn, Messages, RequestIn
from cluster.api.validate import FieldError, Render, messages_to_dicts, quoted
from cluster.jobs.records import CacheDiagnosis, CacheVerification
from router.cost import FIVE_MINUTES_S
from router.kv.key import MAX_SALT_BYTES
from workers.messages import CACHE_TTLS, CacheControls

MAX_BREAKPOINTS = 4
MAX_KEY_BYTES = 256
DEFAULT_CONTROL_TTL = "5m"  # a cache_control without a ttl (Anthropic's default)


def cache_creation(written_input_tokens: int, ttl_s: float) -> dict[str, int]:
    """Prompt tokens a request stored, by TTL as they are priced (Anthropic's usage names):
    a TTL up to 5 minutes, or above it (``router.cost.Rates.write_rate``)."""
    long = ttl_s > FIVE_MINUTES_S
    return {"ephemeral_5m_input_tokens": 0 if long else written_input_tokens,
            "ephemeral_1h_input_tokens": written_input_tokens if long else 0}


def verification_body(v: CacheVerification) -> dict[str, Any]:
    return {"same_tokens": v.same_tokens, "cached_tokens": v.cached_tokens,
            "first_difference": v.first_difference}


def diagnosis_body(d: CacheDiagnosis, token_bytes: Callable[[list[int]], list[bytes]]
                   ) -> dict[str, Any]:
    """A ``CacheDiagnosis`` as the HTTP answers carry it (``cache_diagnostics``), its
    excerpts the prompt's own text (``token_bytes``: each token's bytes)."""
    def text(ids: tuple[int, ...]) -> str:
        return b"".join(token_bytes(list(ids))).decode("utf-8", "replace")
    return {"cached_tokens": d.cached_tokens, "prompt_tokens": d.prompt_tokens,
            "outcome": d.outcome, "reason": d.reason, "diverged_at": d.diverged_at,
            "message_index": d.message_index, "before": text(d.before), "after": text(d.after)}


def salt_of(request: RequestIn, field: str) -> str:
    salt = request.cache.salt
    size = len(salt.encode("utf-8"))
    if size > MAX_SALT_BYTES:
        raise FieldError(f"{field}.cache_salt", f"{size} bytes; a salt has at most "
                         f"{MAX_SALT_BYTES}")
    return salt


def check_shape(request: RequestIn, field: str, prompt: Sequence[int] | None) -> None:
    """Every check that needs no tokenizer, for a job's intake (``cluster.api.intake``):
    ``prompt`` is a token prompt's ids, None for messages (whose length is known at
    dispatch, where ``cache_controls`` checks the rest)."""
    salt_of(request, field)
    if request.cache.diagnostics:
        raise FieldError(f"{field}.cache_diagnostics", "answered on single requests only; "
                         "leave it out of a job")
    if request.cache.verify:
        raise FieldError(f"{field}.cache.verify", "answered on single requests only; leave "
                         "it out of a job")
    cache_controls(request, field, prompt, None)


def message_ends(request: RequestIn, prompt: Sequence[int], render: Render
                 ) -> tuple[int, ...]:
    """Where each message of a chat prompt ends in ``prompt``, as its breakpoint would be
    placed (a diagnosis names the message a divergence falls in); () for token prompts."""
    if not isinstance(request.prompt, Messages):
        return ()
    items = request.prompt.items
    return tuple(_offset(request, items[:i + 1], prompt, render) for i in range(len(items)))


def cache_controls(request: RequestIn, field: str, prompt: Sequence[int] | None,
                   render: Render | None) -> CacheControls:
    """The controls ``request`` asks for, its ``prompt`` already tokenized (``render``: the
    chat template, to place a message's breakpoint; None with ``check_shape``)."""
    cache = request.cache
    if cache.verify and cache.read:
        raise FieldError(f"{field}.cache.verify", "compares a recompute with the cached path: "
                         "it needs read false")
    key_size = len(cache.key.encode("utf-8"))
    if key_size > MAX_KEY_BYTES:
        raise FieldError(f"{field}.prompt_cache_key", f"{key_size} bytes; a key has at most "
                         f"{MAX_KEY_BYTES}")
    marks: list[tuple[str, str, int | None]] = []  # (path, ttl, offset; None: the end)
    if cache.control is not None:
        marks.append((f"{field}.cache_control",
                      control_ttl(cache.control, f"{field}.cache_control"), None))
    marks += _message_marks(request, field, prompt, render)
    for k, mark in enumerate(cache.breakpoints):
        path = f"{field}.cache_breakpoints[{k}]"
        if prompt is not None and not 1 <= mark.tokens <= len(prompt):
            raise FieldError(f"{path}.tokens", f"token offset {mark.tokens} is past the "
                             f"{len(prompt)}-token prompt; use 1 to {len(prompt)}")
        ttl = mark.ttl or DEFAULT_CONTROL_TTL
        if ttl not in CACHE_TTLS:
            raise FieldError(f"{path}.ttl", f"{quoted(ttl)} is not offered; use one of "
                             f"{', '.join(CACHE_TTLS)}")
        marks.append((path, ttl, mark.tokens))
    if len(marks) > MAX_BREAKPOINTS:
        raise FieldError(marks[MAX_BREAKPOINTS][0], f"{len(marks)} cache breakpoints; a "
                         f"request has at most {MAX_BREAKPOINTS}")
    ttls = {ttl for _, ttl, _ in marks}
    if len(ttls) > 1:
        path = next(p for p, ttl, _ in marks if ttl != marks[0][1])
        raise FieldError(path, f"asks ttl {sorted(ttls)}; orchard keeps one TTL per "
                         "request: give every cache_control the same ttl")
    offsets = [offset for _, _, offset in marks]
    limit = None if not offsets or None in offsets else max(o for o in offsets if o)
    ttl = ttls.pop() if ttls else None  # no cache_control: the store's TTL
    return CacheControls(read=cache.read, write=cache.write, write_limit=limit,
                         ttl_s=CACHE_TTLS[ttl] if ttl else None, session=cache.key)


def control_ttl(value: Json, field: str) -> str:
    """The TTL a ``cache_control`` object asks for (``5m`` when it names none)."""
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise FieldError(field, 'must be {"type": "ephemeral"} with an optional "ttl" of '
                         f'{" or ".join(CACHE_TTLS)}')
    extra = sorted(set(value) - {"type", "ttl"})
    if extra:
        raise FieldError(f"{field}.{extra[0]}", "not supported by orchard; a cache_control "
                         "has type and ttl")
    ttl = value.get("ttl", DEFAULT_CONTROL_TTL)
    if ttl not in CACHE_TTLS:
        shown = quoted(ttl) if isinstance(ttl, str) else repr(ttl)
        raise FieldError(f"{field}.ttl", f"{shown} is not offered; use one of "
                         f"{', '.join(CACHE_TTLS)}")
    return ttl


def _message_marks(request: RequestIn, field: str, prompt: Sequence[int] | None,
                   render: Render | None) -> list[tuple[str, str, int | None]]:
    if not isinstance(request.prompt, Messages):
        return []
    items = request.prompt.items
    marks = []
    for i, message in enumerate(items):
        path = f"{field}.messages[{i}]"
        parts = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(parts):
            if isinstance(part, dict) and part.get("cache_control") is not None:
                where = f"{path}.content[{j}].cache_control"
                cut = MessageIn(message.role, parts[:j + 1], message.tool_calls,
                                message.tool_call_id)
                marks.append((where, control_ttl(part["cache_control"], where),
                              _offset(request, items[:i] + (cut,), prompt, render)))
        if message.cache_control is not None:
            where = f"{path}.cache_control"
            marks.append((where, control_ttl(message.cache_control, where),
                          _offset(request, items[:i + 1], prompt, render)))
    return marks


def _offset(request: RequestIn, head: Sequence[MessageIn], prompt: Sequence[int] | None,
            render: Render | None) -> int:
    """Where the prompt rendered up to a breakpoint stops agreeing with the whole prompt
    (1, a stand-in, when only the shape is checked)."""
    if render is None or prompt is None:
        return 1
    messages: list[dict[str, Any]] = messages_to_dicts(head, "messages")
    rendered = (render(messages) if request.tools is None
                else render(messages, tools=list(request.tools.tools)))
    n = 0
    for a, b in zip(rendered, prompt):
        if a != b:
            break
        n += 1
    return max(1, n)

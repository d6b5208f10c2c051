"""The typed request every edge produces: what a caller asked for, before any check.

    gRPC   orchard.v1.Request ── cluster.api.convert.request_from_pb (servicer) ──┐
    HTTP   a chat or completion body ── cluster.api.openai_shapes.request_of ─────┼─► RequestIn
    Batch  an input file's line ── cluster.api.batchfile.request_of ──────────────┘
        ─► cluster.api.validate.new_request (checked, tokenized) ─► NewRequest

Why a dataclass of its own rather than the protobuf message: validation is one function for
every edge, and it should read one plain value that no edge has to encode into another edge's
wire format first (the HTTP edge used to rebuild each body as protobuf through the client SDK,
for validation to read it back). Protobuf stays at the gRPC edge (``cluster.api.convert``), and
the job store keeps its request bodies in it (``cluster.api.intake``).

Why unchecked: every check lives in ``cluster.api.validate``, so a problem is named the same
way (the field's path, the words, the numbers) whichever edge carried it, and a job's first
problem is found in the same order. The edges check their own wire only: JSON's types and
protobuf's decoding. So the value is faithful to what was sent, as far as validation can tell:

- ``MessageIn.content`` is the JSON value as sent: a string, a list of text parts, or anything
  else, which validation refuses naming its kind; ``ABSENT`` when a gRPC message left it unset
  (JSON has no such value: a body's message without content reads as null).
- ``temperature`` and ``top_p`` are single precision, what the gRPC fields hold (``single``),
  so a request samples the same, and is refused quoting the same number, whatever carried it.
- ``prompt`` is ``Messages``, ``Tokens``, or ``None`` when neither was given (protobuf's oneof).
- ``response_format`` is the JSON object as sent (OpenAI's shape, the gRPC message read as
  it), ``None`` when absent or null; ``logprobs`` and ``top_logprobs`` as the chat API has them
  (a completion's ``logprobs: N`` is ``logprobs=True, top_logprobs=N``).
- ``tools`` is what ``cluster.api.tool_calls.parse_request`` made of a chat body's ``tools``,
  ``tool_choice`` and ``parallel_tool_calls`` (checked there: the edge needs the same value to
  parse the answer); a message's ``tool_calls`` and ``tool_call_id`` are the JSON values as
  sent (``None``: absent). Only the HTTP chat endpoint carries them.
- ``cache`` (``CacheIn``) is what the request asks of the prefix cache: the top-level
  ``cache_control`` and a message's ``cache_control`` as the JSON values sent (Anthropic's
  ``{"type": "ephemeral", "ttl": "5m" | "1h"}``; a content part's stays inside the content),
  ``cache_salt``, ``prompt_cache_key`` (or a session header), ``cache: {read, write}`` and
  ``cache_breakpoints`` (token offsets: gRPC and batch lines only). Checked in
  ``cluster.api.cache_fields``.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from cluster.api.tool_calls import ToolRequest

Json = Any  # a value as JSON parses it: str, int, float, bool, None, list or dict of them


class Absent:
    """The content of a gRPC message that has none (``ABSENT``, the one instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = Absent()


@dataclass(frozen=True, slots=True)
class MessageIn:
    role: str
    content: Json | Absent
    tool_calls: Json = None     # an assistant's calls, as sent (None: none)
    tool_call_id: Json = None   # the call a tool message answers, as sent (None: none)
    cache_control: Json = None  # a breakpoint after this message, as sent (None: none)


@dataclass(frozen=True, slots=True)
class Messages:
    """A chat prompt, rendered with the model's chat template."""
    items: tuple[MessageIn, ...]


@dataclass(frozen=True, slots=True)
class Tokens:
    """A prompt of token ids, used as they are."""
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SamplingIn:
    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float | None = None      # None: not given (1.0)
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenBreakpoint:
    """A breakpoint at a token offset of the prompt (gRPC, batch lines), unchecked."""
    tokens: int
    ttl: str = ""  # "5m" or "1h" ("": 5m, as a cache_control without one)


@dataclass(frozen=True, slots=True)
class CacheIn:
    """What a request asks of the prefix cache, unchecked (see the module doc)."""
    control: Json = None           # the top-level cache_control, as sent (None: none)
    salt: str = ""                 # cache_salt
    key: str = ""                  # prompt_cache_key, or the client's session header
    read: bool = True              # cache.read
    write: bool = True             # cache.write
    breakpoints: tuple[TokenBreakpoint, ...] = ()  # cache_breakpoints
    diagnostics: bool = False      # cache_diagnostics (HTTP, unstreamed, single requests)
    verify: bool = False           # cache.verify: with read false, run the cached path too


@dataclass(frozen=True, slots=True)
class RequestIn:
    custom_id: str
    prompt: Messages | Tokens | None
    sampling: SamplingIn
    response_format: Json = None   # as sent (None: free text)
    logprobs: bool = False
    top_logprobs: int = 0
    tools: ToolRequest | None = None
    cache: CacheIn = CacheIn()


def single(value: float) -> float:
    """``value`` as a 32-bit float field holds it: rounded, infinite past the largest (as
    protobuf stores it; an integer too large for a float raises ``OverflowError``, as there)."""
    value = float(value)
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # finite, but rounds past the largest single
        return math.copysign(math.inf, value)


def sampling(max_tokens: int, temperature: float = 0.0, top_p: float | None = None,
             seed: int = 0, stop: Sequence[str] = ()) -> SamplingIn:
    """Sampling parameters as a JSON edge reads them (the floats to single precision)."""
    return SamplingIn(max_tokens=max_tokens, temperature=single(temperature),
                      top_p=None if top_p is None else single(top_p), seed=seed,
                      stop=tuple(stop))


def messages_of(messages: Sequence[dict[str, Json]]) -> Messages:
    """A JSON list of ``{role, content}`` objects (with ``tool_calls`` or ``tool_call_id``
    where given); a role that is not a string is read as its text (and refused by validation as
    an unknown role)."""
    return Messages(tuple(MessageIn(str(m.get("role", "")), m.get("content"),
                                    m.get("tool_calls"), m.get("tool_call_id"),
                                    m.get("cache_control"))
                          for m in messages))

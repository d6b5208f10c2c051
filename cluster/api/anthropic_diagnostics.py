"""Anthropic's ``diagnostics``: why a message's prompt could not reuse the previous one's.

A Messages request may name the id of a message its client got before,
``diagnostics: {"previous_message_id": "msg_..."}`` (``null`` on a first turn: it opts in
with nothing to compare). Each request that asks is fingerprinted when it is answered
(``PromptPrints.record``), and a later one naming it is compared in Anthropic's order::

    the named message not held (never answered with diagnostics here, another tenant's,
      forgotten)                                         previous_message_not_found
    model differs                                        model_changed
    system prompt text differs                           system_changed
    the earlier messages are not all kept, in order      messages_changed
    otherwise (messages only appended)                   no divergence: diagnostics null

``cache_missed_input_tokens`` is the named request's prompt tokens: what the cache could have
offered had this prompt continued it (approximate, as Anthropic's is). The comparison needs
only the two fingerprints, so the diagnosis is known before the request runs and a streamed
message carries it in ``message_start``.

A fingerprint is the model, a digest of the system prompt's text and a chained digest of the
messages (role and text, each message's digest over the one before it), so "only appended"
is one digest compared at the earlier request's length; a ``cache_control`` moved between
turns changes no text and no digest. The fingerprints live in the frontend that answered
(``MAX_PRINTS``, the least recently recorded forgotten first): a message answered by
another frontend is ``previous_message_not_found``, which Anthropic says does not mean the
request changed. Tools are not part of orchard's Messages API, so ``tools_changed`` never
arises.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cluster.api.validate import FieldError

MAX_PRINTS = 1 << 16  # about 200 bytes each: 13 MB at most
_DIGEST = 16


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request's ``diagnostics`` asks: a fingerprint, and a comparison if named."""

    previous_message_id: str  # "": the first turn, nothing to compare


@dataclass(frozen=True, slots=True)
class PromptPrint:
    model: str
    system: bytes
    chain: tuple[bytes, ...]  # the messages' chained digests, one per message
    prompt_tokens: int = 0


def asked(value: Any) -> Asked | None:
    """``diagnostics`` of a Messages body (None: not asked); a bad one raises FieldError."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"previous_message_id"}:
        raise FieldError("diagnostics", "must be {\"previous_message_id\": \"msg_...\" or "
                         "null}")
    previous = value.get("previous_message_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise FieldError("diagnostics.previous_message_id", "must be a message id (msg_...) "
                         "or null on a first turn")
    return Asked(previous or "")


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _text(content: Any) -> bytes:
    """A content's text (a string, or its blocks' types and texts, without cache_control)."""
    if isinstance(content, str):
        blocks = [("text", content)]
    elif isinstance(content, list):
        blocks = [(b.get("type"), b.get("text")) if isinstance(b, dict) else (None, b)
                  for b in content]
    else:
        blocks = [(None, content)]
    return json.dumps(blocks, separators=(",", ":")).encode()


def fingerprint(model: str, system: Any, messages: Any) -> PromptPrint:
    """A Messages body's fingerprint (its fields already checked by the request's shape)."""
    chain, last = [], b""
    for message in messages if isinstance(messages, list) else []:
        role = message.get("role", "") if isinstance(message, dict) else ""
        content = message.get("content") if isinstance(message, dict) else message
        last = _digest(last, str(role).encode(), _text(content))
        chain.append(last)
    return PromptPrint(model, _digest(_text(system or "")), tuple(chain))


def diagnose(previous: PromptPrint | None, current: PromptPrint) -> dict | None:
    """Anthropic's ``diagnostics`` body for ``current`` against the named ``previous``
    (None: it was not found); None when nothing diverged."""
    if previous is None:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    missed = {"cache_missed_input_tokens": previous.prompt_tokens}
    if previous.model != current.model:
        return {"cache_miss_reason": {"type": "model_changed", **missed}}
    if previous.system != current.system:
        return {"cache_miss_reason": {"type": "system_changed", **missed}}
    kept = len(previous.chain)
    if kept and (len(current.chain) < kept or current.chain[kept - 1] != previous.chain[-1]):
        return {"cache_miss_reason": {"type": "messages_changed", **missed}}
    return None


class PromptPrints:
    """The fingerprints of the messages answered with ``diagnostics``, by tenant and id."""

    def __init__(self, limit: int = MAX_PRINTS) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1 fingerprint, got {limit}")
        self._limit = limit
        self._prints: OrderedDict[tuple[str, str], PromptPrint] = OrderedDict()

    def get(self, tenant: str, message_id: str) -> PromptPrint | None:
        return self._prints.get((tenant, message_id))

    def record(self, tenant: str, message_id: str, prompt: PromptPrint,
               prompt_tokens: int) -> None:
        key = (tenant, message_id)
        self._prints[key] = PromptPrint(prompt.model, prompt.system, prompt.chain,
                                        prompt_tokens)
        self._prints.move_to_end(key)
        while len(self._prints) > self._limit:
            self._prints.popitem(last=False)

    def __len__(self) -> int:
        return len(self._prints)

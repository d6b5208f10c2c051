"""A multi-turn chat on one engine: each turn re-renders the whole conversation.

``ChatSession`` keeps the messages, renders them with the model's chat template, and sends the
full prompt every turn, exactly as a stateless client would; the prefix store is what makes
the earlier turns cheap. Used by ``orchard demo`` and reusable by anything that wants a chat.
``render_chat`` is the one rendering of messages through a tokenizer's chat template
(``Engine.render_chat``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Sequence

from workers.messages import GenerateRequest, GenerateResult, SamplingParams

if TYPE_CHECKING:  # the engine renders with ``render_chat``: no import cycle at run time
    from workers.engine.engine import Engine


def render_chat(tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
                ) -> list[int]:
    """Token ids of ``messages`` (``{"role", "content"}`` dicts) through the chat template."""
    if not messages:
        raise ValueError("messages is empty: pass at least one {'role', 'content'} message")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content' keys, got {m!r}")
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@dataclass
class ChatSession:
    engine: Engine
    tenant: str
    system: str = ""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=32))
    messages: list[dict[str, str]] = field(default_factory=list)
    _ids: count = field(default_factory=count, repr=False)

    def __post_init__(self) -> None:
        if self.system and not self.messages:
            self.messages.append({"role": "system", "content": self.system})

    def say(self, text: str) -> GenerateResult:
        """Send one user message; the reply joins the conversation for the next turn."""
        if not text.strip():
            raise ValueError("the user message is empty: type something to say")
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = self.engine.render_chat(messages)
        request = GenerateRequest(f"{self.tenant}-turn-{next(self._ids)}",
                                  self.engine.namespace(self.tenant), tuple(prompt), self.sampling)
        (result,) = self.engine.generate([request])
        if not isinstance(result, GenerateResult):
            raise ValueError(result.error)
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        return result

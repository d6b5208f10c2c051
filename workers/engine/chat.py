"""A multi-turn chat on one engine: each turn re-renders the whole conversation.

``ChatSession`` keeps the messages, renders them with the model's chat template, and sends the
full prompt every turn, exactly as a stateless client would; the prefix store is what makes
the earlier turns cheap. Used by ``orchard demo`` and reusable by anything that wants a chat.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

from workers.engine.engine import Engine
from workers.messages import GenerateRequest, GenerateResult, SamplingParams


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

"""One streamed answer in OpenAI's chunks, made from the backend's items as they come.

    chat         {delta: {role: assistant}}           first, before any text
                 {delta: {content}, logprobs}         per token chunk (logprobs: its tokens)
                 {delta: {}, finish_reason}           at the result
                 {choices: [], usage}                 with stream_options.include_usage
    completions  {text, logprobs}                     per token chunk (text_offset runs on
                                                      from the text streamed so far)
                 {text: "", finish_reason}, then usage as for chat

A chat that offered tools (``tool_choice`` other than ``none``) is answered when its output is
complete: a call can only be told from text once it is whole, so its chunks are held back,
then sent as one content chunk (the text outside calls, with every token's logprobs), one
chunk of ``tool_calls`` (each whole: index, id, type, function name and arguments), and the
finish chunk (``finish_reason: "tool_calls"`` when calls were made).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.api.openai_logprobs import (TokenScore, chat_logprobs, completion_logprobs,
                                         scores_of)
from cluster.api.openai_shapes import CHAT, Outputs, Streaming, completion_id, usage
from cluster.backend.protocol import TokenChunk
from cluster.jobs.store import StoredResult


@dataclass
class StreamedAnswer:
    endpoint: str
    model: str
    created_s: int
    mode: Streaming
    outputs: Outputs
    _request_id: str = ""
    _chars: int = 0                                  # text streamed so far (completions)
    _held: list[TokenScore] = field(default_factory=list)  # a tool chat's, until the end

    def on_chunk(self, item: TokenChunk) -> list[dict]:
        """The chunks to send for one of the backend's token chunks."""
        out = []
        if not self._request_id:
            self._request_id = item.request_id
            if self.endpoint == CHAT:  # OpenAI's first chunk names the role
                out.append(self._chunk({"delta": {"role": "assistant", "content": ""}}))
        scores = scores_of(item.logprobs, self.outputs.token_bytes) if item.logprobs else []
        if self.endpoint == CHAT and self.outputs.parses_calls:
            self._held.extend(scores)
        elif self.endpoint == CHAT:
            out.append(self._chunk({"delta": {"content": item.text},
                                    "logprobs": chat_logprobs(scores) if scores else None}))
        else:
            logprobs = completion_logprobs(scores, self._chars) if scores else None
            self._chars += len(item.text)
            out.append(self._chunk({"text": item.text, "logprobs": logprobs}))
        return out

    def on_result(self, result: StoredResult) -> list[dict]:
        """The closing chunks: held-back content and calls, the finish reason, the usage."""
        self._request_id = result.request_id
        finish = result.finish_reason
        out = []
        if self.endpoint == CHAT and self.outputs.parses_calls:
            message, finish = self.outputs.message(result.text, result.request_id, finish)
            logprobs = chat_logprobs(self._held) if self._held else None
            if message["content"] or logprobs:
                out.append(self._chunk({"delta": {"content": message["content"] or ""},
                                        "logprobs": logprobs}))
            if "tool_calls" in message:
                calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                out.append(self._chunk({"delta": {"tool_calls": calls}}))
        closing = {"delta": {}} if self.endpoint == CHAT else {"text": ""}
        out.append(self._chunk({**closing, "finish_reason": finish}))
        if self.mode.include_usage:
            out.append({**self._chunk(None), "usage": usage(result)})
        return out

    def _chunk(self, choice: dict | None) -> dict:
        """A chunk of one choice (``None``: of none, the usage chunk)."""
        choices = [] if choice is None else [
            {"index": 0, "logprobs": None, "finish_reason": None, **choice}]
        return {"id": completion_id(self.endpoint, self._request_id),
                "object": "chat.completion.chunk" if self.endpoint == CHAT
                else "text_completion",
                "created": self.created_s, "model": self.model, "choices": choices,
                "usage": None}

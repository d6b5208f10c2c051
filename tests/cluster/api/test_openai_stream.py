"""One streamed answer in OpenAI's chunks (``cluster.api.openai_stream``), from backend items
made by hand: chat's role chunk first, completions' offsets running on from the text sent, the
finish and usage chunks, and a tool chat held back until its calls are whole."""
from __future__ import annotations

import json

from cluster.api.openai_fields import CHAT, COMPLETIONS
from cluster.api.openai_shapes import Outputs, Streaming
from cluster.api.openai_stream import StreamedAnswer
from cluster.api.tool_calls import ToolFormat, ToolRequest
from cluster.backend.protocol import TokenChunk
from cluster.jobs.store import StoredResult
from workers.messages import TokenLogprob

PIECES = {1: b"He", 2: b"llo", 3: b" you"}
OUTPUTS = Outputs(lambda ids: [PIECES[i] for i in ids])
TOOLS = ToolRequest(({"type": "function", "function": {"name": "get", "parameters": {}}},))
TOOL_FORMAT = ToolFormat("m", "<call>", "</call>", lambda inner, tools: json.loads(inner),
                         "json_tools")


def _answer(endpoint: str, include_usage: bool = False, outputs: Outputs = OUTPUTS
            ) -> StreamedAnswer:
    return StreamedAnswer(endpoint, "m", 1700, Streaming(True, include_usage), outputs)


def _chunk(text: str, *tokens: int) -> TokenChunk:
    return TokenChunk("r1", tokens, text, tuple(TokenLogprob(t, -float(t)) for t in tokens))


def _result(text: str = "Hello", finish: str = "stop") -> StoredResult:
    return StoredResult(0, "c", "r1", True, text=text, output_tokens=(1, 2),
                        finish_reason=finish, prompt_tokens=7, cached_tokens=4)


def _choices(chunks: list[dict]) -> list[dict]:
    return [c["choices"][0] for c in chunks]


class TestChat:
    def test_the_first_chunk_names_the_role_then_each_token_chunk_has_its_logprobs(self):
        answer = _answer(CHAT)
        first = answer.on_chunk(_chunk("He", 1))
        assert [c["id"] for c in first] == ["chatcmpl-r1", "chatcmpl-r1"]
        assert first[0] == {"id": "chatcmpl-r1", "object": "chat.completion.chunk",
                            "created": 1700, "model": "m", "usage": None, "choices": [
                                {"index": 0, "logprobs": None, "finish_reason": None,
                                 "delta": {"role": "assistant", "content": ""}}]}
        assert _choices(first)[1]["delta"] == {"content": "He"}
        assert _choices(first)[1]["logprobs"]["content"][0]["token"] == "He"
        later = answer.on_chunk(TokenChunk("r1", (2,), "llo"))
        assert _choices(later) == [{"index": 0, "logprobs": None, "finish_reason": None,
                                    "delta": {"content": "llo"}}]

    def test_the_result_closes_with_the_finish_reason_and_usage_when_asked(self):
        answer = _answer(CHAT, include_usage=True)
        answer.on_chunk(_chunk("He", 1))
        closing = answer.on_result(_result(finish="length"))
        assert _choices(closing[:1]) == [{"index": 0, "logprobs": None, "delta": {},
                                          "finish_reason": "length"}]
        assert closing[1]["choices"] == [] and closing[1]["usage"]["prompt_tokens"] == 7
        assert closing[1]["usage"]["completion_tokens"] == 2
        assert len(_answer(CHAT).on_result(_result())) == 1  # no usage unless asked


class TestCompletions:
    def test_text_offsets_run_on_from_the_text_streamed_so_far(self):
        answer = _answer(COMPLETIONS)
        first = answer.on_chunk(_chunk("He", 1))
        assert len(first) == 1 and first[0]["object"] == "text_completion"
        assert first[0]["id"] == "cmpl-r1" and _choices(first)[0]["text"] == "He"
        second = _choices(answer.on_chunk(_chunk("llo you", 2, 3)))[0]
        assert second["logprobs"]["text_offset"] == [2, 5]
        assert second["logprobs"]["token_logprobs"] == [-2.0, -3.0]
        closing = answer.on_result(_result())
        assert _choices(closing) == [{"index": 0, "logprobs": None, "text": "",
                                      "finish_reason": "stop"}]


class TestToolChat:
    def test_chunks_are_held_until_the_result_then_content_calls_and_finish(self):
        answer = _answer(CHAT, outputs=Outputs(OUTPUTS.token_bytes, TOOLS, TOOL_FORMAT))
        assert len(answer.on_chunk(_chunk("He", 1))) == 1  # the role chunk only
        assert answer.on_chunk(_chunk("llo", 2)) == []
        text = 'Hello<call>{"name": "get", "arguments": {"q": 1}}</call>'
        closing = _choices(answer.on_result(_result(text)))
        assert closing[0]["delta"] == {"content": "Hello"}
        assert [e["token"] for e in closing[0]["logprobs"]["content"]] == ["He", "llo"]
        assert closing[1]["delta"] == {"tool_calls": [
            {"index": 0, "id": "call_r1_0", "type": "function",
             "function": {"name": "get", "arguments": '{"q": 1}'}}]}
        assert closing[2] == {"index": 0, "logprobs": None, "delta": {},
                              "finish_reason": "tool_calls"}
        assert len(closing) == 3

    def test_held_text_without_calls_is_one_content_chunk_and_stops(self):
        answer = _answer(CHAT, outputs=Outputs(OUTPUTS.token_bytes, TOOLS, TOOL_FORMAT))
        answer.on_chunk(TokenChunk("r1", (1,), "He"))
        closing = _choices(answer.on_result(_result("Hello")))
        assert [c["delta"] for c in closing] == [{"content": "Hello"}, {}]
        assert closing[1]["finish_reason"] == "stop"

    def test_calls_alone_keep_their_logprobs_in_an_empty_content_chunk_and_count_up(self):
        answer = _answer(CHAT, outputs=Outputs(OUTPUTS.token_bytes, TOOLS, TOOL_FORMAT))
        answer.on_chunk(_chunk("He", 1))
        call = '<call>{"name": "get", "arguments": {}}</call>'
        closing = _choices(answer.on_result(_result(call + call)))
        assert closing[0]["delta"] == {"content": ""}
        assert [e["token"] for e in closing[0]["logprobs"]["content"]] == ["He"]
        assert [(c["index"], c["id"]) for c in closing[1]["delta"]["tool_calls"]] == [
            (0, "call_r1_0"), (1, "call_r1_1")]


class TestNoTokens:
    def test_a_result_before_any_chunk_is_named_by_its_request(self):
        closing = _answer(CHAT).on_result(_result())
        assert [c["id"] for c in closing] == ["chatcmpl-r1"]

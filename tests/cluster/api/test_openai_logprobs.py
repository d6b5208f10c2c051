"""Log-probabilities in OpenAI's two shapes (``cluster.api.openai_logprobs``), as plain values:
each token's bytes read in one tokenizer call, the chat shape with exact bytes, and the
completion shape's offsets counted in the answer's text. Then end to end through the real
``openai`` SDK against a real frontend over a LocalBackend (one real engine): chat and
completions (shape, count, order; streamed chunk by chunk), a constrained answer's values
from before the mask, counts outside the range refused, and gRPC's results and deltas."""
from __future__ import annotations

import openai
import pytest

from cluster.api.openai_logprobs import TokenScore, chat_logprobs, completion_logprobs, scores_of
from cluster.api.client import chat_request
from tests.support.structured_outputs import (MODEL, PET_FORMAT, USER, chat, sdk_client,
                                              tools_frontend)
from workers.messages import TokenLogprob


class TestShapes:
    def test_scores_read_every_token_and_alternative_in_one_call(self):
        calls = []

        def token_bytes(ids):
            calls.append(list(ids))
            return [f"<{i}>".encode() for i in ids]

        scores = scores_of([TokenLogprob(1, -0.5, ((1, -0.5), (7, -2.0))), TokenLogprob(3, -1.0)],
                           token_bytes)
        assert calls == [[1, 1, 7, 3]]
        assert scores == [TokenScore(b"<1>", -0.5, ((b"<1>", -0.5), (b"<7>", -2.0))),
                          TokenScore(b"<3>", -1.0)]

    def test_the_chat_shape_with_exact_bytes_for_a_split_character(self):
        euro = "€".encode()  # three bytes, split over two tokens
        scores = [TokenScore(b" a", -0.1, ((b" a", -0.1), (b" b", -3.0))),
                  TokenScore(euro[:2], -0.2), TokenScore(euro[2:], -0.3)]
        content = chat_logprobs(scores)["content"]
        assert content[0] == {"token": " a", "logprob": -0.1, "bytes": [32, 97], "top_logprobs": [
            {"token": " a", "logprob": -0.1, "bytes": [32, 97]},
            {"token": " b", "logprob": -3.0, "bytes": [32, 98]}]}
        assert [c["token"] for c in content[1:]] == ["\ufffd", "\ufffd"]
        assert bytes(content[1]["bytes"] + content[2]["bytes"]).decode() == "€"

    def test_the_completion_shape_counts_offsets_in_the_answers_text(self):
        scores = [TokenScore(b" Hello", -1.0, ((b" Hello", -1.0), (b"Hi", -2.0), (b"Hi", -2.5))),
                  TokenScore(b" w", -2.0), TokenScore("ör".encode(), -3.0), TokenScore(b"ld", -4.0)]
        shaped = completion_logprobs(scores, text="Hello wörld")  # the leading space dropped
        assert shaped["tokens"] == [" Hello", " w", "ör", "ld"]
        assert shaped["token_logprobs"] == [-1.0, -2.0, -3.0, -4.0]
        assert shaped["top_logprobs"][0] == {" Hello": -1.0, "Hi": -2.0}  # the likelier kept
        assert shaped["text_offset"] == [0, 5, 7, 9]
        assert completion_logprobs(scores[1:], offset=5)["text_offset"] == [5, 7, 9]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with tools_frontend(tmp_path_factory) as harness:
        yield harness


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return sdk_client(api)


class TestLogprobs:
    def test_chat_content_entries_one_per_token_with_alternatives_most_likely_first(self, client):
        answer = chat(client, max_tokens=6, logprobs=True, top_logprobs=5)
        entries = answer.choices[0].logprobs.content
        assert len(entries) == answer.usage.completion_tokens == 6
        for entry in entries:
            assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token
            tops = entry.top_logprobs
            assert len(tops) == 5
            values = [t.logprob for t in tops]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            # greedy: the token drawn is the likeliest
            assert (tops[0].token, tops[0].logprob) == (entry.token, entry.logprob)
        text = b"".join(bytes(e.bytes) for e in entries).decode(errors="replace")
        assert text.strip() == answer.choices[0].message.content.strip()

    def test_no_alternatives_and_none_unless_asked(self, client):
        answer = chat(client, max_tokens=3, logprobs=True, top_logprobs=0)
        assert [e.top_logprobs for e in answer.choices[0].logprobs.content] == [[], [], []]
        assert chat(client, max_tokens=3).choices[0].logprobs is None
        assert chat(client, max_tokens=3, logprobs=False).choices[0].logprobs is None

    def test_a_constrained_answer_has_the_models_values_before_the_mask(self, client):
        answer = chat(client, response_format=PET_FORMAT, logprobs=True, top_logprobs=20)
        entries = answer.choices[0].logprobs.content
        assert len(entries) == answer.usage.completion_tokens
        # the first token opens the object because of the grammar, not because the model likes
        # it best: greedy drew it, and the model's own likeliest token is another
        assert entries[0].token.startswith("{")
        assert entries[0].logprob < entries[0].top_logprobs[0].logprob

    def test_streamed_chunks_carry_their_tokens_logprobs(self, client):
        whole = chat(client, max_tokens=6, logprobs=True, top_logprobs=2)
        chunks = list(chat(client, max_tokens=6, logprobs=True, top_logprobs=2, stream=True))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert streamed == whole.choices[0].logprobs.content

    def test_completions_legacy_shape(self, client):
        answer = client.completions.create(model=MODEL, prompt="Once upon a time",
                                           max_tokens=6, temperature=0, logprobs=3)
        choice = answer.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(
            lp.text_offset) == answer.usage.completion_tokens == 6
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert 1 <= len(top) <= 3 and list(top.values()) == sorted(top.values(), reverse=True)
            assert max(top.values()) == value and top[token] == value  # greedy
        offsets = lp.text_offset
        assert offsets == sorted(offsets) and offsets[0] == 0
        for i in range(1, len(offsets) - 1):
            assert choice.text[offsets[i]:offsets[i + 1]] == lp.tokens[i]
        streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                                  max_tokens=6, temperature=0, logprobs=3,
                                                  stream=True))
        pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
        assert [t for p in pieces for t in p.tokens] == lp.tokens
        assert [o for p in pieces for o in p.text_offset] == offsets

    @pytest.mark.parametrize("params, param", [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ])
    def test_chat_counts_outside_the_range_are_refused(self, client, params, param):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, **params)
        assert caught.value.body["param"] == param

    def test_completions_refuse_more_than_twenty(self, client):
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1,
                                         logprobs=20).choices[0].logprobs.top_logprobs
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=21)
        assert caught.value.body["param"] == "logprobs"

    def test_over_grpc_results_and_deltas_carry_them(self, api, client):
        http = chat(client, max_tokens=4, logprobs=True, top_logprobs=2)
        request = chat_request("", USER, 4, temperature=0)
        request.logprobs, request.top_logprobs = True, 2
        with api.client("acme") as grpc_client:
            events = list(grpc_client.generate(request))
        result = events[-1].result
        deltas = [lp for e in events[:-1] for lp in e.delta.logprobs]
        assert list(result.logprobs) == deltas and len(deltas) == 4
        for entry, want in zip(result.logprobs, http.choices[0].logprobs.content):
            assert list(entry.bytes) == want.bytes and entry.logprob == pytest.approx(
                want.logprob, abs=0)
            assert [list(t.bytes) for t in entry.top_logprobs] == [
                t.bytes for t in want.top_logprobs]

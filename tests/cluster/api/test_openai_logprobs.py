"""Log-probabilities in OpenAI's two shapes (``cluster.api.openai_logprobs``), as plain values:
each token's bytes read in one tokenizer call, the chat shape with exact bytes, and the
completion shape's offsets counted in the answer's text."""
from __future__ import annotations

from cluster.api.openai_logprobs import TokenScore, chat_logprobs, completion_logprobs, scores_of
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

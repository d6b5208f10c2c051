"""What a request must be for an engine to run it (``workers.engine.validate.check_request``):
each refusal names the request and what to fix; a request at the limits runs."""
from __future__ import annotations

import dataclasses

import pytest

from router.kv.key import Namespace
from workers.engine.validate import check_request
from workers.messages import GenerateRequest, SamplingParams

SECRET = b"s" * 32
NS = Namespace("t", "m", secret=SECRET)
VOCAB, CONTEXT = 100, 16


def _request(prompt=(1, 2, 3), ns=NS, **sampling) -> GenerateRequest:
    return GenerateRequest("r7", ns, tuple(prompt), SamplingParams(**{"max_tokens": 4,
                                                                      **sampling}))


def _refusal(request: GenerateRequest) -> str:
    with pytest.raises(ValueError) as refused:
        check_request(request, VOCAB, CONTEXT, SECRET)
    return str(refused.value)


class TestAccepted:
    def test_a_request_at_every_limit_runs(self):
        check_request(_request(prompt=[0] * 12 + [VOCAB - 1], max_tokens=3, temperature=0.0,
                               top_p=1.0), VOCAB, CONTEXT, SECRET)   # 13 + 3 = the context


class TestRefused:
    def test_a_namespace_of_another_type_or_secret(self):
        assert _refusal(dataclasses.replace(_request(), namespace=("t", "m"))) == (
            "request r7: namespace must be a router.kv.key.Namespace")
        assert _refusal(_request(ns=Namespace("t", "m", secret=b"x" * 32))) == (
            "request r7: its namespace is hashed with another cache secret than this "
            "worker's; start workers from the cluster that routes to them")

    def test_an_empty_prompt_and_a_token_outside_the_vocabulary(self):
        assert _refusal(_request(prompt=())) == (
            "request r7: the prompt is empty; send at least one token")
        assert _refusal(_request(prompt=(5, VOCAB, -1))) == (
            "request r7: token id 100 is outside the vocabulary [0, 100); tokenize with this "
            "model's tokenizer")
        assert _refusal(_request(prompt=(5, -1))) == (
            "request r7: token id -1 is outside the vocabulary [0, 100); tokenize with this "
            "model's tokenizer")

    def test_no_tokens_asked_for_and_one_past_the_context(self):
        assert _refusal(_request(max_tokens=0)) == "request r7: max_tokens must be >= 1, got 0"
        assert _refusal(_request(prompt=[1] * 13, max_tokens=4)) == (
            "request r7: prompt (13 tokens) plus max_tokens (4) exceeds the model's context of "
            "16; shorten the prompt or lower max_tokens")

    @pytest.mark.parametrize("temperature, top_p", [(-0.1, 1.0), (0.5, 0.0), (0.5, 1.01)])
    def test_sampling_outside_its_ranges(self, temperature, top_p):
        assert _refusal(_request(temperature=temperature, top_p=top_p)) == (
            f"request r7: need temperature >= 0 and 0 < top_p <= 1, got {temperature} and "
            f"{top_p}")

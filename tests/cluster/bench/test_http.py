"""``cluster.bench.http``: the HTTP side of ``orchard bench api``, what can be checked without a
frontend: every request's prompt distinct and tagged, and the SDK client it measures with
(the frontend's ``/v1``, no retries, ``TCP_NODELAY`` or not). The measurements themselves run
against a frontend in ``tests/cluster/bench/test_api.py``."""
from __future__ import annotations

from cluster.bench.http import TtftFigures, _messages, sdk


class TestThePrompts:
    def test_one_user_message_tagged_and_numbered_of_the_words_asked(self):
        assert _messages(3, 2, "http") == [
            {"role": "user", "content": "http request 3: word0 word1"}]
        assert _messages(0, 0, "ttft-grpc") == [{"role": "user", "content": "ttft-grpc request 0: "}]

    def test_no_two_requests_share_a_prompt(self):
        texts = {_messages(i, 4, tag)[0]["content"] for i in range(50)
                 for tag in ("http", "ttft-http")}
        assert len(texts) == 100


class TestTheClient:
    def test_the_sdk_talks_to_the_frontends_v1_without_retries_either_way(self):
        for nodelay in (True, False):
            client = sdk("http://127.0.0.1:9", "key-acme", nodelay=nodelay)
            assert (str(client.base_url), client.api_key, client.max_retries) == (
                "http://127.0.0.1:9/v1/", "key-acme", 0)

    def test_ttft_figures_are_a_plain_record(self):
        figures = TtftFigures("grpc", 8, 1.5, 3.0)
        assert (figures.path, figures.requests, figures.ttft_p50_ms, figures.ttft_p99_ms) == (
            "grpc", 8, 1.5, 3.0)

"""``cluster.api.http_message_batches``: Anthropic's Message Batches as orchard jobs, with the
real ``anthropic`` SDK's ``client.messages.batches`` against a real frontend over one real
engine: a batch run as a job whose results are the messages, batches listed newest first and
paged both ways, bad list queries and unknown cursors, and requests a batch refuses.
"""
from __future__ import annotations

import time

import anthropic
import pytest

from tests.support.anthropic_api import GREEDY, MODEL, SYSTEM
from tests.support.anthropic_api import api, claude  # noqa: F401  (fixtures)



class TestMessageBatches:
    def test_a_batch_runs_as_a_job_and_its_results_are_the_messages(self, claude):
        system = [{"type": "text", "text": "Batched. " + SYSTEM,
                   "cache_control": {"type": "ephemeral", "ttl": "1h"}}]

        def params(user: str) -> dict:
            return {"model": MODEL, "max_tokens": 3, "temperature": 0, "system": system,
                    "messages": [{"role": "user", "content": user}]}
        batch = claude.messages.batches.create(requests=[
            {"custom_id": "q1", "params": params("First batched question?")},
            {"custom_id": "q2", "params": params("Second batched question?")}])
        assert (batch.type, batch.processing_status) == ("message_batch", "in_progress")
        deadline = time.monotonic() + 120
        while batch.processing_status != "ended" and time.monotonic() < deadline:
            time.sleep(0.1)
            batch = claude.messages.batches.retrieve(batch.id)
        assert batch.processing_status == "ended"
        assert (batch.request_counts.succeeded, batch.request_counts.errored,
                batch.request_counts.processing) == (2, 0, 0)
        results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
        assert sorted(results) == ["q1", "q2"]
        plain = claude.messages.create(**{k: v for k, v in params("First batched question?")
                                          .items() if k != "temperature"}, extra_body=GREEDY)
        first = results["q1"]
        assert first.type == "succeeded"
        assert first.message.content[0].text == plain.content[0].text
        written = [r.message.usage.cache_creation.ephemeral_1h_input_tokens
                   for r in results.values()]
        assert sum(written) == plain.usage.cache_read_input_tokens > 0  # one wrote the system

    def test_batches_are_listed_newest_first_and_paged_both_ways(self, claude, api):
        def batch(n: int):
            return claude.messages.batches.create(requests=[{"custom_id": f"l{n}", "params": {
                "model": MODEL, "max_tokens": 1, "messages": [
                    {"role": "user", "content": f"Listed {n}"}]}}])
        made = [batch(n).id for n in range(3)]
        newest = made[::-1]
        page = claude.messages.batches.list(limit=2)
        assert [b.id for b in page.data] == newest[:2]
        assert (page.has_more, page.first_id, page.last_id) == (True, newest[0], newest[1])
        assert all(b.type == "message_batch" for b in page.data)
        older = claude.messages.batches.list(limit=2, after_id=newest[1])
        assert [b.id for b in older.data][:1] == [newest[2]]
        newer = claude.messages.batches.list(limit=1, before_id=newest[2])
        assert [b.id for b in newer.data] == [newest[1]] and newer.has_more
        assert [b.id for b in claude.messages.batches.list(before_id=newest[0]).data] == []
        # the SDK's own paging walks every batch once, newest first
        walked = [b.id for b in claude.messages.batches.list(limit=1)]
        assert walked[:3] == newest and len(walked) == len(set(walked))

    @pytest.mark.parametrize("query, field", [
        ({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"order": "asc"}, "order"),
        ({"after_id": "", "before_id": ""}, "before_id")])
    def test_a_bad_list_query_is_refused_naming_it(self, claude, query, field):
        if "after_id" in query:  # both cursors, each a batch that exists
            made = claude.messages.batches.create(requests=[{"custom_id": "c", "params": {
                "model": MODEL, "max_tokens": 1, "messages": [
                    {"role": "user", "content": "Cursor"}]}}])
            query = {"after_id": made.id, "before_id": made.id}
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.batches.list(extra_query=query)
        assert caught.value.body["error"]["message"].startswith(f"{field}: ")

    def test_an_unknown_cursor_is_not_found(self, claude):
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.batches.list(after_id="msgbatch_nope")

    def test_diagnostics_in_a_batch_is_refused_naming_the_request(self, claude):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.batches.create(requests=[{"custom_id": "d", "params": {
                "model": MODEL, "max_tokens": 1, "diagnostics": {"previous_message_id": None},
                "messages": [{"role": "user", "content": "Hi"}]}}])
        assert caught.value.body["error"]["message"].startswith(
            "requests[0].params.diagnostics: a batch's requests have no previous message")

    def test_a_bad_request_in_a_batch_is_refused_naming_it(self, claude):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.batches.create(requests=[
                {"custom_id": "ok", "params": {"model": MODEL, "max_tokens": 2, "messages": [
                    {"role": "user", "content": "Hi"}]}},
                {"custom_id": "bad", "params": {"model": MODEL, "max_tokens": 2, "top_k": 3,
                                                "messages": [{"role": "user", "content": "Hi"}]}}])
        assert caught.value.body["error"]["message"] == (
            "requests[1].params.top_k: not supported by orchard's Messages API; leave it out")

"""``infra/netns_job.py``: the job it runs on a namespace cluster while killing a node: every
request shares a 64-token prefix and ends in 24 tokens of its own. The run itself needs root
and namespaces (``tests/cluster/backend/test_bootstrap.py``)."""
from __future__ import annotations

from tests.support.netns_hosts import load_infra

netns_job = load_infra("netns_job")


class TestTheRequests:
    def test_a_shared_prefix_then_tokens_of_their_own(self):
        first, second = netns_job.requests(2, 48)
        assert [r.custom_id for r in (first, second)] == ["req-000", "req-001"]
        shared = [100 + (i * 13) % 700 for i in range(64)]
        assert list(first.tokens.ids) == shared + list(range(900, 924))
        assert list(second.tokens.ids) == shared + list(range(907, 931))
        assert first.sampling.max_tokens == 48

    def test_every_custom_id_and_tail_distinct(self):
        made = netns_job.requests(30, 4)
        assert len({r.custom_id for r in made}) == 30
        assert len({tuple(r.tokens.ids[64:]) for r in made}) == 30

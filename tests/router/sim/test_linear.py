"""``router.sim.linear``: a simulated worker under the linear service model, and the pull from
a peer it makes first when the router planned one: a hot document's second worker pulls it
instead of prefilling it; a slow link pulls nothing."""
from __future__ import annotations

from router.sim.simulator import SimConfig, replay
from tests.support.sim_traces import BS, HOT


class TestAPullFirst:
    def test_a_hot_documents_second_worker_pulls_it_instead_of_prefilling_it(self):
        alone = replay(HOT, "orchard", SimConfig(workers=2))
        pulled = replay(HOT, "orchard", SimConfig(workers=2, link_gbps=10.0))
        assert (alone.pulled_tokens, pulled.pulled_tokens) == (0, 8 * BS)   # one pull, once
        assert pulled.prefill_tokens == alone.prefill_tokens - 8 * BS
        assert pulled.ttft_mean_s < alone.ttft_mean_s
        assert pulled.reasons["load_spill"] == 1

    def test_a_link_too_slow_pulls_nothing(self):
        slow = replay(HOT, "orchard", SimConfig(workers=2, link_gbps=0.01))
        alone = replay(HOT, "orchard", SimConfig(workers=2))
        assert slow.pulled_tokens == 0
        assert (slow.prefill_tokens, slow.reasons) == (alone.prefill_tokens, alone.reasons)

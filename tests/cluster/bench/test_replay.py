"""``cluster.bench.replay``: a slice of a trace scaled down for a real cluster (tokens divided,
proportions kept, an emptied request refused) and the prompts made from its block ids."""
from __future__ import annotations

import pytest

from cluster.bench.replay import ReplaySlice, prompt_tokens, scale_slice
from router.sim.trace import TraceRequest


class TestScalingASlice:
    def test_scaling_a_slice_divides_tokens_keeps_proportions_and_refuses_empty_requests(self):
        trace = [TraceRequest(10.0, 1000, 90, (1, 2)), TraceRequest(12.5, 1600, 2, (1, 3, 4)),
                 TraceRequest(20.0, 300, 40, (5,))]
        lines = scale_slice(trace, ReplaySlice(start=0, requests=3, scale=4, time_scale=2.0))
        assert [(t.arrival_s, t.input_length, t.output_length) for t in lines] == \
            [(0.0, 250, 22), (5.0, 400, 1), (20.0, 75, 10)]
        with pytest.raises(ValueError, match=r"--scale 512 leaves request 2 \(300 input tokens\) "
                                             r"empty: use a smaller --scale"):
            scale_slice(trace, ReplaySlice(requests=3, scale=512))
        with pytest.raises(ValueError, match="--scale must divide the trace's 512-token blocks"):
            ReplaySlice(scale=3)
        a, b = (prompt_tokens(t, 128, 1000, salt=i) for i, t in enumerate(lines[:2]))
        assert (len(a), len(b)) == (250, 400)
        assert a[:128] == b[:128] and a[128:250] != b[128:250]  # id 1 shared, then 2 against 3

"""``orchard bench frontends`` at a small size: two frontends' routers over the same two
workers (forged tiny model, a store of 8 blocks each, so evictions run) end with the same
belief, and it is what the workers hold."""
import json

from cluster.bench.frontends import FrontendsWorkload, as_json, run
from tests.support.forged_models import tiny_model


def test_two_routers_over_the_same_workers_believe_the_same_and_the_truth():
    workload = FrontendsWorkload(workers=2, requests=12, concurrency=3, prefixes=3,
                                 prefix_tokens=48, suffix_tokens=16, store_blocks=8)
    report = run(str(tiny_model()), workload)
    assert (report.belief_drift_blocks, report.truth_drift_blocks) == (0, 0)
    assert report.blocks_held == 2 * 8          # both stores full ...
    assert report.blocks_named > report.blocks_held   # ... after evicting
    assert (report.requests, report.drained, report.feed_deliveries_lost) == (24, True, 0)
    out = as_json(report, workload)
    assert json.loads(json.dumps(out))["belief_drift_blocks"] == 0
    assert out["workload"]["store_blocks"] == 8

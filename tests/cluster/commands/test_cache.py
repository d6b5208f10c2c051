"""``orchard cache`` and ``orchard invalidate`` against a real frontend."""
import json

import pytest

from cluster.cli import main
from cluster.api.client import token_request
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG as CONFIG, running_frontend


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "orchard.toml").write_text(CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness


def admin(frontend, *args, key="key-admin"):
    return main([*args, "--address", frontend.address, "--api-key", key])


def test_cache_stats_and_invalidation(frontend, capsys):
    prompt = list(range(500, 564))
    with frontend.client("acme") as client:
        job = client.wait(client.submit([token_request("a", prompt, 2)]).job_id, poll_s=0.05)
        assert job.completed == 1
    assert admin(frontend, "cache", "--json") == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["workers"] == 1 and stats["cache_blocks"] == 4 and stats["input_tokens"] == 64
    tokens = ",".join(str(t) for t in prompt[:32])
    assert admin(frontend, "invalidate", "--tenant", "acme", "--prefix-tokens", tokens) == 0
    assert "removed 3 cached blocks" in capsys.readouterr().out
    assert admin(frontend, "invalidate", "--tenant", "acme") == 0
    assert "removed 1 cached blocks" in capsys.readouterr().out


def test_bad_invalidation_arguments(frontend, tmp_path, capsys):
    assert admin(frontend, "invalidate", "--tenant", "nobody") == 1
    assert "INVALID_ARGUMENT: tenant: unknown tenant 'nobody'" in capsys.readouterr().err
    assert admin(frontend, "invalidate", "--tenant", "acme", "--prefix-tokens", "1,x") == 2
    assert "comma-separated integers" in capsys.readouterr().err
    bad = tmp_path / "m.json"
    bad.write_text("{oops")
    assert admin(frontend, "invalidate", "--tenant", "acme", "--prefix-messages", str(bad)) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert admin(frontend, "cache", key="key-acme") == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err


def test_workers_and_cache_show_the_disk_tier(tmp_path, capsys):
    from workers.engine.engine import Engine, EngineConfig

    block = Engine.open(tiny_model()).kv_bytes_per_token * 16
    engine = EngineConfig(block_size=16, max_batch=4, store_bytes=2 * block,
                          disk_bytes=1 << 20, disk_dir=str(tmp_path / "cache"))
    (tmp_path / "orchard.toml").write_text(CONFIG)
    with running_frontend(tmp_path, tiny_model(), workers=1, engine=engine) as harness:
        with harness.client("acme") as client:
            job = client.submit([token_request("a", list(range(500, 564)), 1)])
            assert client.wait(job.job_id, poll_s=0.05).completed == 1
        assert admin(harness, "cache", "--json") == 0
        stats = json.loads(capsys.readouterr().out)
        # 64 prompt tokens: 4 blocks, two in memory, two straight to disk
        assert (stats["cache_blocks"], stats["disk_blocks"], stats["disk_bytes"]) == (
            2, 2, 2 * block)
        assert (stats["disk_capacity_bytes"], stats["disk_corrupt"], stats["disk_torn"],
                stats["disk_full"]) == (1 << 20, 0, 0, False)
        assert stats["disk_free_bytes"] > 0
        assert admin(harness, "workers") == 0
        line = capsys.readouterr().out.splitlines()[1]
        assert f"{2 * block / 2**20:.2f} of 1 MiB, 2 blocks" in line and "corrupt 0, torn 0" in line


def test_cache_shows_what_a_full_disk_tier_evicted(tmp_path, capsys):
    """Memory and disk hold 4 blocks each: three prompts of 4 blocks spill the first's to disk,
    then the second's, evicting the first's from disk; the count reaches the client over gRPC."""
    from workers.engine.engine import Engine, EngineConfig

    block = Engine.open(tiny_model()).kv_bytes_per_token * 16
    engine = EngineConfig(block_size=16, max_batch=4, store_bytes=4 * block, kept_bytes=0,
                          disk_bytes=4 * block, disk_dir=str(tmp_path / "cache"))
    (tmp_path / "orchard.toml").write_text(CONFIG)
    with running_frontend(tmp_path, tiny_model(), workers=1, engine=engine) as harness:
        with harness.client("acme") as client:
            for first in (500, 600, 700):
                job = client.submit([token_request("a", list(range(first, first + 64)), 1)])
                assert client.wait(job.job_id, poll_s=0.05).completed == 1
        assert admin(harness, "cache", "--json") == 0
        stats = json.loads(capsys.readouterr().out)
        assert (stats["cache_blocks"], stats["disk_blocks"], stats["disk_evictions"]) == (4, 4, 4)
        assert admin(harness, "workers") == 0
        assert "evicted 4" in capsys.readouterr().out.splitlines()[1]

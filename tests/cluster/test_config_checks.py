"""The checks on a loaded config (``cluster.config_checks``), on ``Config`` values built by hand:
the defaults pass, and each value out of its range is a ``ValueError`` naming the file and the
key, exactly."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cluster.config import (CacheConfig, Config, EngineSettings, FrontendTls, HttpConfig, Limits,
                            MetricsConfig, RouterConfig)
from cluster.config_checks import check

PATH = Path("/run/orchard.toml")
GOOD = Config(run_dir=Path("/run"), tenant_keys={"sk-a": "acme"}, admin_keys=frozenset({"sk-admin"}))


class TestDefaults:
    def test_the_defaults_pass(self):
        check(GOOD, PATH)  # raises nothing
        check(replace(GOOD, cache=CacheConfig(disk_bytes=1 << 20, kv_bits=8, disk_kv_bits=4),
                      engine=EngineSettings(speculate=True, speculate_max_k=1, max_batch=256,
                                            draft_model="small")), PATH)


@pytest.mark.parametrize("changes, message", [
    ({"limits": Limits(max_pending_total=0)}, "[limits] max_pending_total must be >= 1"),
    ({"limits": Limits(max_prompt_bytes=0)}, "[limits] max_prompt_bytes must be >= 1"),
    ({"limits": Limits(request_timeout_s=0.0)}, "[limits] request_timeout_s must be > 0"),
    ({"limits": Limits(max_ttft_s=-0.5)},
     "[limits] max_ttft_s must be >= 0 (0: callers' deadlines only)"),
    ({"http": HttpConfig(max_connections_per_client=0)},
     "[http] max_connections_per_client must be >= 1"),
    ({"http": HttpConfig(body_timeout_s=0.0)}, "[http] body_timeout_s must be > 0 (seconds)"),
    ({"engine": EngineSettings(speculate_max_k=0)}, "[engine] speculate_max_k must be 1 to 8"),
    ({"engine": EngineSettings(max_batch=257)}, "[engine] max_batch must be 1 to 256"),
    ({"engine": EngineSettings(draft_model="small")},
     "[engine] draft_model needs speculate = true"),
    ({"metrics": MetricsConfig(port=-1)}, "[metrics] port must be in [0, 65535], got -1"),
    ({"cache": CacheConfig(block_size=0)}, "[cache] block_size must be >= 1"),
    ({"cache": CacheConfig(disk_kv_bits=2)},
     "[cache] disk_kv_bits must be 0 (model precision), 8 or 4"),
    ({"cache": CacheConfig(disk_bytes=-1)},
     "[cache] disk_bytes must be >= 0 (0: no disk tier), with a disk_dir when > 0"),
    ({"cache": CacheConfig(disk_bytes=1, disk_dir="")},
     "[cache] disk_bytes must be >= 0 (0: no disk tier), with a disk_dir when > 0"),
    ({"router": RouterConfig(index_bytes=(1 << 20) - 1)},
     "[router] index_bytes must be at least 1048576 (1 MiB), got 1048575; the default is "
     "2147483648 (2 GiB)"),
    ({"admin_keys": frozenset({"sk-a"})}, "a key may not be both a tenant key and an admin key"),
    ({"tls": FrontendTls(tls_cert="cert.pem")}, "[frontend] tls_cert and tls_key go together"),
    ({"tls": FrontendTls(client_ca="ca.pem")},
     "[frontend] client_ca (mutual TLS) needs tls_cert and tls_key"),
    ({"port": 65536}, "ports must be in [0, 65535]"),
])
def test_a_value_out_of_range_names_the_file_and_the_key(changes, message):
    with pytest.raises(ValueError) as caught:
        check(replace(GOOD, **changes), PATH)
    assert str(caught.value) == f"{PATH}: {message}"


class TestBoundaries:
    def test_the_edges_of_each_range_pass(self):
        for changes in ({"router": RouterConfig(index_bytes=1 << 20)},
                        {"limits": Limits(max_ttft_s=0.0, max_concurrent=1)},
                        {"metrics": MetricsConfig(port=65535)}, {"port": 65535}):
            check(replace(GOOD, **changes), PATH)

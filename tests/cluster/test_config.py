"""The run directory's config: defaults with fresh keys, and errors that name the key."""
import pytest

from cluster.config import load_config, write_default_config


def test_default_config_has_fresh_keys_and_loopback(tmp_path):
    path = write_default_config(tmp_path, tenants=("acme", "beta"), max_concurrent=3)
    config = load_config(tmp_path)
    assert config.tenants() == ["acme", "beta"]
    assert config.key_for("acme").startswith("sk-acme-") and len(config.admin_keys) == 1
    assert config.limits.max_concurrent == 3 and config.host == "127.0.0.1"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    write_default_config(tmp_path / "other")
    assert load_config(tmp_path / "other").key_for("default") != config.key_for("acme")
    assert write_default_config(tmp_path) == path  # an existing config is kept


@pytest.mark.parametrize("text, message", [
    ("[limits]\nmax_concurrent = 0\n", "max_concurrent must be >= 1"),
    ("[limits]\nmax_concurent = 2\n", "unknown key(s) max_concurent"),
    ("[limits]\nrequest_timeout_s = \"soon\"\n", "request_timeout_s must be a float"),
    ("[frontend]\nhost = \"0.0.0.0\"\n", "loopback"),
    ("[[tenants]]\nname = \"a\"\napi_keys = []\n", "tenants[0].api_keys"),
    ("[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\n[admin]\napi_keys = [\"k\"]\n",
     "both a tenant key and an admin key"),
    ("[cache\n", "not valid TOML"),
    ("[cache]\neviction = \"fifo\"\n", "eviction must be one of lru, reuse"),
    ("[router]\nindex_bytes = 4096\n", "[router] index_bytes must be at least 1048576"),
    ("[router]\nindex_blocks = 4096\n", "unknown key(s) index_blocks in [router]"),
    ("[engine]\nspeculate_max_k = 9\n", "[engine] speculate_max_k must be 1 to 8"),
    ("[engine]\nspeculate = \"yes\"\n", "[engine] speculate must be a bool"),
    ("[engine]\ndraft_model = \"small\"\n", "[engine] draft_model needs speculate = true"),
    ("[metrics]\nhost = \"0.0.0.0\"\n", "[metrics] host must be a loopback address"),
    ("[metrics]\nhost = \"mac1.local\"\n", "[metrics] host must be a loopback address"),
    ("[metrics]\nport = 70000\n", "[metrics] port must be in [0, 65535], got 70000"),
    ("[metrics]\ndedicated = \"yes\"\n", "[metrics] dedicated must be a bool"),
    ("[metrics]\npath = \"/m\"\n", "unknown key(s) path in [metrics]"),
])
def test_bad_config_names_the_key(tmp_path, text, message):
    (tmp_path / "orchard.toml").write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(tmp_path)
    assert message in str(err.value)


def test_metrics_default_to_the_http_port_and_a_loopback_dedicated_port(tmp_path):
    write_default_config(tmp_path)
    metrics = load_config(tmp_path).metrics
    assert (metrics.http, metrics.dedicated, metrics.host, metrics.port) == (
        True, False, "127.0.0.1", 9464)
    (tmp_path / "v6").mkdir()
    (tmp_path / "v6" / "orchard.toml").write_text(
        "[metrics]\ndedicated = true\nhost = \"::1\"\nport = 0\n")
    assert load_config(tmp_path / "v6").metrics.host == "::1"


def test_missing_config_says_how_to_start(tmp_path):
    with pytest.raises(FileNotFoundError, match="orchard up --run-dir"):
        load_config(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no tenant 'zed'"):
        load_config(write_default_config(tmp_path).parent).key_for("zed")


def test_the_lease_is_ten_seconds_unless_set_and_must_be_positive(tmp_path):
    write_default_config(tmp_path)
    assert load_config(tmp_path).lease_s == 10.0
    path = tmp_path / "orchard.toml"
    path.write_text(path.read_text().replace("[frontend]\n", "[frontend]\nlease_s = 2\n"))
    assert load_config(tmp_path).lease_s == 2.0
    path.write_text(path.read_text().replace("lease_s = 2", "lease_s = 0"))
    with pytest.raises(ValueError, match=r"\[frontend\] lease_s must be a number of seconds > 0, got 0"):
        load_config(tmp_path)


def test_the_router_index_budget_reaches_the_frontends_router(tmp_path):
    from cluster.backend.routing import FrontendRouter
    from router.kv.events import BlockStored, EventBatch

    write_default_config(tmp_path)
    assert load_config(tmp_path).router.index_bytes == 2 << 30
    toml = tmp_path / "orchard.toml"
    toml.write_text(toml.read_text() + "\n[router]\nindex_bytes = 1048576\n")
    config = load_config(tmp_path)
    routes = FrontendRouter(16, index_bytes=config.router.index_bytes)
    routes.router.add_worker("w0")
    events = tuple(BlockStored(b, b - 1, 16, "ns") for b in range(1, 50_001))
    routes.router.apply_events(EventBatch("w0", 0, events))
    held = routes.router.indexed_blocks()  # 47,662 fit (22 bytes a block); 476 go at a time
    assert held == (1 << 20) // 22 - 5 * 476 + 50_000 - (1 << 20) // 22
    assert routes.router.index_counters().dropped == 50_000 - held

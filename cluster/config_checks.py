"""The checks ``cluster.config.load_config`` runs on a loaded ``Config``: each value in its
range, TLS and the binding agreeing, keys that may not be both a tenant's and an admin's. A
failed check is a ``ValueError`` naming the file and the key."""
from __future__ import annotations

from pathlib import Path

from cluster.config import MIN_INDEX_BYTES, Config, HttpConfig, MetricsConfig
from router.index import DEFAULT_INDEX_BYTES


def check(config: Config, path: Path) -> None:
    """``ValueError`` naming ``path`` and the key for a value out of its range."""
    _check_tls(config, path)
    limits = config.limits
    for name in ("max_requests_per_job", "max_pending_per_tenant", "max_pending_total",
                 "max_concurrent", "max_prompt_bytes"):
        if getattr(limits, name) < 1:
            raise ValueError(f"{path}: [limits] {name} must be >= 1")
    if limits.request_timeout_s <= 0:
        raise ValueError(f"{path}: [limits] request_timeout_s must be > 0")
    if limits.max_ttft_s < 0:
        raise ValueError(f"{path}: [limits] max_ttft_s must be >= 0 (0: callers' deadlines only)")
    _check_http(config.http, path)
    if not 1 <= config.engine.speculate_max_k <= 8:
        raise ValueError(f"{path}: [engine] speculate_max_k must be 1 to 8")
    if not 1 <= config.engine.max_batch <= 256:
        raise ValueError(f"{path}: [engine] max_batch must be 1 to 256")
    if config.engine.draft_model and not config.engine.speculate:
        raise ValueError(f"{path}: [engine] draft_model needs speculate = true")
    _check_metrics(config.metrics, path)
    if config.cache.block_size < 1:
        raise ValueError(f"{path}: [cache] block_size must be >= 1")
    cache = config.cache
    for name in ("kv_bits", "disk_kv_bits"):
        if getattr(cache, name) not in (0, 8, 4):
            raise ValueError(f"{path}: [cache] {name} must be 0 (model precision), 8 or 4")
    if cache.disk_bytes < 0 or (cache.disk_bytes and not cache.disk_dir):
        raise ValueError(f"{path}: [cache] disk_bytes must be >= 0 (0: no disk tier), "
                         f"with a disk_dir when > 0")
    if config.router.index_bytes < MIN_INDEX_BYTES:
        raise ValueError(f"{path}: [router] index_bytes must be at least {MIN_INDEX_BYTES} "
                         f"(1 MiB), got {config.router.index_bytes}; the default is "
                         f"{DEFAULT_INDEX_BYTES} (2 GiB)")
    if set(config.tenant_keys) & config.admin_keys:
        raise ValueError(f"{path}: a key may not be both a tenant key and an admin key")


def _check_http(http: HttpConfig, path: Path) -> None:
    for name in ("max_body_bytes", "max_connections_per_client"):
        if getattr(http, name) < 1:
            raise ValueError(f"{path}: [http] {name} must be >= 1")
    for name in ("header_timeout_s", "body_timeout_s"):
        if not getattr(http, name) > 0:
            raise ValueError(f"{path}: [http] {name} must be > 0 (seconds)")


def _check_metrics(metrics: MetricsConfig, path: Path) -> None:
    from cluster.tls import is_loopback

    if not 0 <= metrics.port < 65536:
        raise ValueError(f"{path}: [metrics] port must be in [0, 65535], got {metrics.port}")
    if not is_loopback(metrics.host):
        raise ValueError(f"{path}: [metrics] host must be a loopback address (127.0.0.1 or "
                         f"::1), got {metrics.host!r}: the dedicated port has no key; a "
                         "scraper on another machine reads GET /metrics on the HTTP port "
                         "with an admin key")


def _check_tls(config: Config, path: Path) -> None:
    from cluster.tls import check_binding

    tls = config.tls
    if bool(tls.tls_cert) != bool(tls.tls_key):
        raise ValueError(f"{path}: [frontend] tls_cert and tls_key go together")
    if tls.client_ca and not tls.tls_cert:
        raise ValueError(f"{path}: [frontend] client_ca (mutual TLS) needs tls_cert and tls_key")
    files = config.tls_files()
    for name, file in (("tls_cert", files and files.cert), ("tls_key", files and files.key),
                       ("client_ca", files and files.client_ca)):
        if file and not file.is_file():
            raise ValueError(f"{path}: [frontend] {name}: {file} does not exist (create the "
                             "files with `orchard tls init`)")
    try:
        check_binding(config.host, files, tls.allow_plaintext_lan)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not 0 <= config.http.port < 65536 or not 0 <= config.port < 65536:
        raise ValueError(f"{path}: ports must be in [0, 65535]")

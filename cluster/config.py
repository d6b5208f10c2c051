"""One frozen configuration per process, loaded from ``orchard.toml`` in the run directory.

The run directory (``--run-dir``, else ``$ORCHARD_RUN_DIR``, else ``./run``) holds everything a
running cluster owns: this config, the job store, the frontend's address file, traces.

    [[tenants]]                  # API keys per tenant; the tenant is part of the cache namespace
    name = "acme"
    api_keys = ["..."]

    [admin]
    api_keys = ["..."]           # needed by Admin calls (workers, scale, drain, invalidate)

    [limits]
    max_requests_per_job = 50000 # a bigger job is refused (RESOURCE_EXHAUSTED): split it
    max_pending_per_tenant = 100000 # requests accepted but not finished, per tenant
    max_pending_total = 200000      # ... over all tenants (beyond either: RESOURCE_EXHAUSTED)
    max_concurrent = 32          # requests in flight to the backend at once
    request_timeout_s = 600.0    # a job request running longer fails with DEADLINE_EXCEEDED
    max_ttft_s = 0.0             # an interactive request predicted to wait longer for its
                                 # first token is refused at once (429, Retry-After); 0: only
                                 # the caller's own deadline (cluster/jobs/shedding.py)
    max_prompt_bytes = 1048576   # text of one request's messages (INVALID_ARGUMENT beyond);
                                 # its tokens are capped by the model's context

    [quotas.acme]                # per tenant, requests outside jobs; re-read when the file
    requests_in_flight = 8       # changes, no restart (cluster/jobs/quotas.py); 0: no limit
    tokens_per_minute = 200000   # prompt + max_tokens accepted in the last minute

    [cache]
    block_size = 16
    ttl_s = 300.0
    capacity_bytes = 1073741824  # per worker
    eviction = "reuse"           # "reuse" keeps reused blocks longer; "lru" is plain LRU
    kv_bits = 0                  # memory tier K/V: 0 (model precision), 8 or 4 bits
    disk_bytes = 0               # per worker disk tier; 0: none
    disk_dir = "cache"           # worker w's blocks in disk_dir/w (relative: to the run dir)
    disk_kv_bits = 0             # disk tier K/V: 0, 8 or 4 bits

    [model]
    dir = ""                     # an mlx-lm model directory; "" means the embedded default

    [engine]
    speculate = false            # prompt-lookup drafts verified in the decode batch
    speculate_max_k = 8          # the widest verify pass (1 to 8); each step picks its width
    max_batch = 32               # requests in prefill or decoding at once, per worker
    draft_model = ""             # a draft model directory (the model's tokenizer; needs
                                 # speculate); "": drafts by prompt lookup

    [frontend]
    host = "127.0.0.1"           # loopback; any other address needs TLS (cluster.tls)
    port = 0                     # 0: pick a free port (written to frontend.json)
    tls_cert = ""                # e.g. "tls/server.pem" (`orchard tls init`), relative to RUN
    tls_key = ""                 # e.g. "tls/server.key"
    client_ca = ""               # set: mutual TLS, clients need a certificate this CA signed
    allow_plaintext_lan = false  # serve a non-loopback host without TLS (warned at each start)
    lease_s = 10.0               # several frontends on one run dir: a killed one's jobs are
                                 # taken over by another 1 to 1.33 lease_s later

    [http]
    enabled = true               # the OpenAI-compatible HTTP API beside gRPC
    port = 0                     # 0: pick a free port (frontend.json's http_address)
    max_body_bytes = 8388608     # a JSON request body (413 beyond; file uploads: 200 MiB)
    header_timeout_s = 10.0      # the whole request head (line and headers), from connect
    body_timeout_s = 30.0        # the longest wait for the next piece of a request body
    max_connections_per_client = 64  # open connections per client address (429 beyond)

    [metrics]
    http = true                  # GET /metrics on the HTTP API's port (an admin key)
    dedicated = false            # also serve /metrics on a port of its own, without a key:
    host = "127.0.0.1"           # loopback only (a scraper on another machine uses the
    port = 9464                  # HTTP port with an admin key); 0 picks a free port
                                 # (frontend.json's metrics_address)

    [router]
    index_bytes = 2147483648     # the frontend router's prefix index:
                                 # 22 bytes a block at up to 32 workers, so 2 GiB is 97M blocks;
                                 # past it the least recently used blocks are forgotten first
                                 # (router/index.py). At least 1 MiB

    [telemetry]
    exporter = "file"            # "file" (OTLP JSON lines in RUN_DIR/traces), "otlp",
                                 # both ("file,otlp") or "none"
    metrics = ""                 # "file", "otlp" or "none"; "" follows exporter
    endpoint = ""                # for "otlp", e.g. "http://127.0.0.1:4318"
    protocol = "http"            # for "otlp": "http" (OTLP/HTTP protobuf) or "grpc"
    prices = ""                  # a price table TOML; "" means orchard's defaults

Keys live in this file only: ``write_default_config`` creates it with fresh random keys when a
run directory has none. Lower layers never see this object; they get plain values from it.
"""
from __future__ import annotations

import os
import secrets
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from router.index import DEFAULT_INDEX_BYTES
from router.kv.ledger import DEFAULT_EVICTION, Eviction

CONFIG_NAME = "orchard.toml"
ADDRESS_NAME = "frontend.json"


@dataclass(frozen=True, slots=True)
class Limits:
    max_requests_per_job: int = 50_000    # OpenAI's Batch API limit (a 200 MB file at most)
    max_pending_per_tenant: int = 100_000  # queued requests live in the job store, not memory
    max_pending_total: int = 200_000
    max_concurrent: int = 32  # one worker's decode batch (``[engine] max_batch``)
    request_timeout_s: float = 600.0
    max_prompt_bytes: int = 1 << 20
    max_ttft_s: float = 0.0  # 0: shed only past the caller's own deadline


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    ttl_s: float = 300.0
    capacity_bytes: int = 1 << 30
    eviction: Eviction = DEFAULT_EVICTION
    kv_bits: int = 0
    disk_bytes: int = 0
    disk_dir: str = "cache"
    disk_kv_bits: int = 0


@dataclass(frozen=True, slots=True)
class EngineSettings:
    speculate: bool = False  # off by default: see docs/design-notes.md, "Speculative decoding"
    speculate_max_k: int = 8
    max_batch: int = 32  # mlx_lm.server's decode batch; why in docs/design-notes.md
    draft_model: str = ""  # a model directory whose drafts replace prompt lookup's


@dataclass(frozen=True, slots=True)
class RouterConfig:
    index_bytes: int = DEFAULT_INDEX_BYTES  # the prefix index's budget (``router.index``)


MIN_INDEX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    exporter: str = "file"
    endpoint: str = ""
    protocol: str = "http"
    prices: str = ""
    metrics: str = ""


@dataclass(frozen=True, slots=True)
class FrontendTls:
    tls_cert: str = ""
    tls_key: str = ""
    client_ca: str = ""
    allow_plaintext_lan: bool = False


@dataclass(frozen=True, slots=True)
class HttpConfig:
    enabled: bool = True
    port: int = 0
    # a prompt of max_prompt_bytes (1 MiB) fits even with every byte escaped as \uXXXX (6 MiB)
    max_body_bytes: int = 8 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # the openai SDK opens one connection per request in flight: 64 lets one client run 8
    # times max_concurrent's default at once
    max_connections_per_client: int = 64


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    http: bool = True
    dedicated: bool = False
    host: str = "127.0.0.1"
    port: int = 9464  # the port OpenTelemetry's Prometheus exporter uses by default


@dataclass(frozen=True, slots=True)
class Config:
    run_dir: Path
    tenant_keys: dict[str, str]          # api key -> tenant name
    admin_keys: frozenset[str]
    limits: Limits = field(default_factory=Limits)
    cache: CacheConfig = field(default_factory=CacheConfig)
    model_dir: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    tls: FrontendTls = field(default_factory=lambda: FrontendTls())
    http: HttpConfig = field(default_factory=lambda: HttpConfig())
    router: RouterConfig = field(default_factory=RouterConfig)
    engine: EngineSettings = field(default_factory=EngineSettings)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    lease_s: float = 10.0                # a frontend's job lease ([frontend], cluster.jobs.lease)

    @property
    def db_path(self) -> Path:
        return self.run_dir / "jobs.sqlite3"

    @property
    def address_path(self) -> Path:
        return self.run_dir / ADDRESS_NAME

    def tls_files(self):
        """The server's ``cluster.tls.TlsFiles`` (paths under the run dir), or None."""
        from cluster.tls import TlsFiles

        if not self.tls.tls_cert:
            return None
        ca = self.tls.client_ca
        return TlsFiles(self.run_dir / self.tls.tls_cert, self.run_dir / self.tls.tls_key,
                        self.run_dir / ca if ca else None)

    def tenants(self) -> list[str]:
        return sorted(set(self.tenant_keys.values()))

    def key_for(self, tenant: str) -> str:
        """The first API key of ``tenant`` (for local tools running beside the cluster)."""
        for key, name in self.tenant_keys.items():
            if name == tenant:
                return key
        raise ValueError(f"no tenant {tenant!r} in {self.run_dir / CONFIG_NAME}; "
                         f"known tenants: {', '.join(self.tenants()) or 'none'}")


def default_run_dir() -> Path:
    return Path(os.environ.get("ORCHARD_RUN_DIR", "run"))


def _section(data: dict, name: str, path: Path) -> dict:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"{path}: [{name}] must be a table")
    return value


def _build(cls, values: dict, section: str, path: Path):
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)} in [{section}]; "
                         f"known: {', '.join(sorted(known))}")
    defaults = cls()
    for key, value in values.items():
        default = getattr(defaults, key)
        want = str if isinstance(default, StrEnum) else type(default)
        if want is float and isinstance(value, int):
            continue
        if not isinstance(value, want):
            raise ValueError(f"{path}: [{section}] {key} must be a {want.__name__}")
        if isinstance(default, StrEnum) and value not in set(type(default)):
            raise ValueError(f"{path}: [{section}] {key} must be one of "
                             f"{', '.join(type(default))}, got {value!r}")
    return cls(**{k: _typed(getattr(defaults, k), v) for k, v in values.items()})


def _typed(default, value):
    """``value`` as the type of the field's default: float for a float, the enum member for
    an enum (``"lru"`` becomes ``Eviction.LRU``)."""
    if isinstance(default, float):
        return float(value)
    return type(default)(value) if isinstance(default, StrEnum) else value


def _tenant_keys(data: dict, path: Path) -> dict[str, str]:
    keys: dict[str, str] = {}
    for i, tenant in enumerate(data.get("tenants", [])):
        name = tenant.get("name")
        api_keys = tenant.get("api_keys", [])
        if not isinstance(name, str) or not name:
            raise ValueError(f"{path}: tenants[{i}].name must be a non-empty string")
        if not api_keys or not all(isinstance(k, str) and k for k in api_keys):
            raise ValueError(f"{path}: tenants[{i}].api_keys must list non-empty strings")
        for key in api_keys:
            if key in keys and keys[key] != name:
                raise ValueError(f"{path}: an API key is listed for both {keys[key]!r} and {name!r}")
            keys[key] = name
    return keys


def load_config(run_dir: Path | str) -> Config:
    """Read ``run_dir/orchard.toml``; ``ValueError`` naming the key for anything wrong."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: start the cluster with "
                                f"`orchard up --run-dir {run_dir}` or write the file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    admin = _section(data, "admin", path).get("api_keys", [])
    if not all(isinstance(k, str) and k for k in admin):
        raise ValueError(f"{path}: [admin] api_keys must list non-empty strings")
    frontend = dict(_section(data, "frontend", path))
    host, port = frontend.pop("host", "127.0.0.1"), frontend.pop("port", 0)
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
        raise ValueError(f"{path}: [frontend] host must be a string and port an integer")
    lease_s = frontend.pop("lease_s", 10.0)
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or lease_s <= 0:
        raise ValueError(f"{path}: [frontend] lease_s must be a number of seconds > 0, "
                         f"got {lease_s!r}")
    config = Config(
        run_dir=run_dir,
        tenant_keys=_tenant_keys(data, path),
        admin_keys=frozenset(admin),
        limits=_build(Limits, _section(data, "limits", path), "limits", path),
        cache=_build(CacheConfig, _section(data, "cache", path), "cache", path),
        model_dir=str(_section(data, "model", path).get("dir", "")),
        host=host,
        port=port,
        telemetry=_build(TelemetryConfig, _section(data, "telemetry", path), "telemetry", path),
        tls=_build(FrontendTls, frontend, "frontend", path),
        http=_build(HttpConfig, _section(data, "http", path), "http", path),
        router=_build(RouterConfig, _section(data, "router", path), "router", path),
        engine=_build(EngineSettings, _section(data, "engine", path), "engine", path),
        metrics=_build(MetricsConfig, _section(data, "metrics", path), "metrics", path),
        lease_s=float(lease_s),
    )
    from cluster.config_checks import check  # the checks read these classes

    check(config, path)
    return config


def write_default_config(run_dir: Path | str, tenants: tuple[str, ...] = ("default",),
                         model_dir: str = "", **limits: int | float) -> Path:
    """Create ``run_dir/orchard.toml`` with fresh random keys unless it exists; return its path."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_NAME
    if path.exists():
        return path
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # it will hold prompts and keys
    lines = []
    for name in tenants:
        lines += ["[[tenants]]", f'name = "{name}"',
                  f'api_keys = ["sk-{name}-{secrets.token_urlsafe(18)}"]', ""]
    lines += ["[admin]", f'api_keys = ["sk-admin-{secrets.token_urlsafe(18)}"]', ""]
    lines += ["[limits]", *(f"{k} = {v!r}" for k, v in limits.items()), ""]
    cache = CacheConfig()
    lines += ["[cache]", f"block_size = {cache.block_size}", f"ttl_s = {cache.ttl_s}",
              f"capacity_bytes = {cache.capacity_bytes}  # per worker",
              f'eviction = "{cache.eviction}"  # "lru": plain LRU', ""]
    lines += ["[model]", f'dir = "{model_dir}"', ""]
    lines += ["[frontend]", 'host = "127.0.0.1"', "port = 0", ""]
    path.write_text("\n".join(lines))
    path.chmod(0o600)
    return path


def update_config(run_dir: Path | str, section: str, values: dict[str, str | int | bool]
                  ) -> Path:
    """Set ``values`` in ``[section]`` of ``run_dir/orchard.toml``, in place: the section is
    merged into (created when missing), every other key, section and comment stays as it was.
    The result must load (``load_config``), or the file is left unchanged; returns its path.
    """
    import tomlkit  # only the commands that edit the config need it

    path = Path(run_dir) / CONFIG_NAME
    before = path.read_text()
    try:
        document = tomlkit.parse(before)
    except tomlkit.exceptions.ParseError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    table = document.get(section)
    if table is None:
        table = document[section] = tomlkit.table()
    elif not isinstance(table, dict) or isinstance(table, tomlkit.items.InlineTable):
        raise ValueError(f"{path}: [{section}] must be a table of its own to be edited; "
                         f"write it as a [{section}] section")
    for key, value in values.items():
        table[key] = value
    _replace(path, tomlkit.dumps(document))
    try:
        load_config(run_dir)
    except ValueError as exc:
        _replace(path, before)
        raise ValueError(f"{exc} (with {', '.join(values)} set; {path} is unchanged)") from None
    return path


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once (a reader sees the old file or the new), mode 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)

"""What caching costs: the price table, and the effective input multiplier measured and forecast.

The effective input multiplier ``M`` prices a request's input tokens against what they would
cost with no cache at all (``M = 1``). Every input token is exactly one of two things::

    input ─┬─ cached    read from the store                         priced r (cache_read)
           └─ computed  prefilled by this request ─┬─ written      priced w (cache_write_<ttl>)
                                                   └─ uncached     priced u (uncached, 1.0)

``written`` is the part of ``computed`` that this request newly stored (full blocks only; a
block already stored by someone else is not written twice), so written and computed overlap:
a written token is prefilled *and* stored, and is priced once, at the write rate, which
includes the prefill (the convention of the providers that publish cache prices)::

    M = (u * (computed - written) + w * written + r * cached) / input

A job's ``M`` is token-weighted: the sum of its requests' numerators over the sum of their
inputs. ``M`` of an empty prompt is undefined and raises ``ValueError``.

The write rate depends on the store's TTL: ``cache_write_5m`` for a TTL up to 5 minutes,
``cache_write_1h`` above it (a TTL above one hour is priced at the 1-hour rate).

Forecasts (``forecast_request``, ``forecast_job`` in ``router.forecast``) produce the same
``TokenUsage`` before the work runs, so forecast and measured ``M`` use one formula.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping

DEFAULT_PRICES_PATH = Path(__file__).with_name("prices.toml")
FIVE_MINUTES_S = 300.0
_RATE_KEYS = ("uncached", "cache_read", "cache_write_5m", "cache_write_1h")


@dataclass(frozen=True, slots=True)
class Rates:
    """Multipliers of the uncached input price for one model."""

    uncached: float = 1.0
    cache_read: float = 0.1
    cache_write_5m: float = 1.25
    cache_write_1h: float = 2.0

    def write_rate(self, ttl_s: float) -> float:
        """The write multiplier for entries kept ``ttl_s`` seconds."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        return self.cache_write_5m if ttl_s <= FIVE_MINUTES_S else self.cache_write_1h


@dataclass(frozen=True, slots=True)
class PriceTable:
    """A versioned price table: default rates plus per-model overrides."""

    version: str = "builtin"
    default: Rates = Rates()
    models: Mapping[str, Rates] = field(default_factory=dict)

    def rates(self, model: str = "") -> Rates:
        return self.models.get(model, self.default)


def _rates(table: Mapping[str, object], base: Rates, where: str) -> Rates:
    unknown = set(table) - set(_RATE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown price keys {sorted(unknown)}; "
                         f"use only {', '.join(_RATE_KEYS)}")
    values: dict[str, float] = {}
    for key, value in table.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}.{key} must be a non-negative number, got {value!r}")
        values[key] = float(value)
    return replace(base, **values)


def parse_price_table(data: Mapping[str, object], source: str = "price table") -> PriceTable:
    """Build a ``PriceTable`` from parsed TOML; bad input raises ``ValueError`` naming the key."""
    version = data.get("version")
    if not isinstance(version, str) or not version:
        raise ValueError(f"{source}: set a non-empty string `version` (e.g. version = \"2026-11-01\")")
    default_table = data.get("default", {})
    models_table = data.get("models", {})
    if not isinstance(default_table, dict) or not isinstance(models_table, dict):
        raise ValueError(f"{source}: [default] and [models.\"ID\"] must be tables")
    default = _rates(default_table, Rates(), f"{source}: default")
    models = {}
    for model, table in models_table.items():
        if not isinstance(table, dict):
            raise ValueError(f"{source}: models.{model} must be a table of rates")
        models[model] = _rates(table, default, f"{source}: models.{model}")
    return PriceTable(version=version, default=default, models=models)


def load_price_table(path: str | Path | None = None) -> PriceTable:
    """Read a price table TOML file (orchard's defaults when ``path`` is None)."""
    path = Path(path) if path is not None else DEFAULT_PRICES_PATH
    if not path.is_file():
        raise FileNotFoundError(f"price table {path} does not exist; pass an existing TOML file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"price table {path} is not valid TOML: {exc}") from None
    return parse_price_table(data, str(path))


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """One request's (or a job's summed) input tokens split as priced: see the module doc."""

    input_tokens: int
    cached_tokens: int
    written_tokens: int

    def __post_init__(self) -> None:
        if min(self.input_tokens, self.cached_tokens, self.written_tokens) < 0:
            raise ValueError(f"token counts must be non-negative: {self}")
        if self.cached_tokens > self.input_tokens:
            raise ValueError(f"cached_tokens {self.cached_tokens} exceeds input_tokens "
                             f"{self.input_tokens}: cached tokens are part of the input")
        if self.written_tokens > self.computed_tokens:
            raise ValueError(f"written_tokens {self.written_tokens} exceeds computed_tokens "
                             f"{self.computed_tokens}: only prefilled prompt tokens are written")

    @property
    def computed_tokens(self) -> int:
        return self.input_tokens - self.cached_tokens

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(self.input_tokens + other.input_tokens,
                          self.cached_tokens + other.cached_tokens,
                          self.written_tokens + other.written_tokens)

    def cost(self, rates: Rates, ttl_s: float) -> float:
        """The numerator of ``M``: input priced in uncached-token units."""
        uncached = self.computed_tokens - self.written_tokens
        return (rates.uncached * uncached + rates.write_rate(ttl_s) * self.written_tokens
                + rates.cache_read * self.cached_tokens)

    def multiplier(self, rates: Rates, ttl_s: float) -> float:
        """``M``; an empty prompt has none and raises ``ValueError``."""
        if self.input_tokens == 0:
            raise ValueError("an empty prompt has no effective input multiplier")
        return self.cost(rates, ttl_s) / self.input_tokens


def total_usage(usages: Iterable[TokenUsage]) -> TokenUsage:
    total = TokenUsage(0, 0, 0)
    for usage in usages:
        total = total + usage
    return total


def job_multiplier(usages: Iterable[TokenUsage], rates: Rates, ttl_s: float) -> float | None:
    """Token-weighted ``M`` of a job; None for a job with no input tokens."""
    total = total_usage(usages)
    return total.multiplier(rates, ttl_s) if total.input_tokens else None


def _input_written(input_tokens: int, cached_tokens: int, end: int, block_size: int) -> int:
    start = math.ceil(cached_tokens / block_size) * block_size  # the first block not read
    return max(0, min(end, input_tokens) - start)


def measured_usage(input_tokens: int, cached_tokens: int, written_tokens: int,
                   block_size: int) -> TokenUsage:
    """The priced usage of a finished request from the engine's counts.

    The engine stores a request's new full blocks contiguously from its first block not read
    from cache: the prompt's blocks after prefill, then, when it finishes, the blocks that its
    output completed (the prompt's partial tail and output tokens). ``written_tokens`` counts
    all of them; the input part is the first ``input - start`` of them, where ``start`` is
    the first unread block's offset. Output tokens written are not input and stay out of M.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    start = math.ceil(cached_tokens / block_size) * block_size
    return TokenUsage(input_tokens, cached_tokens,
                      _input_written(input_tokens, cached_tokens, start + written_tokens,
                                     block_size))


def forecast_request(input_tokens: int, expected_cached: int, block_size: int,
                     output_tokens: int = 1, write_limit: int | None = None) -> TokenUsage:
    """The usage a request is expected to have, from the router's expected cached tokens.

    ``write_limit``: the request's last cache breakpoint (0: it writes nothing; None: no
    breakpoint): only the full blocks before it are written.

    The worker stores every full block of the prompt it does not hold and, when the request
    finishes, the block its output completes: after ``n`` output tokens it holds the K/V of
    ``input + n - 1`` tokens, in full blocks. ``expected_cached`` may be ``input_tokens - 1``
    for a fully held prompt that is a whole number of blocks: nothing is written then.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0 <= expected_cached <= max(0, input_tokens - 1):
        raise ValueError(f"expected_cached {expected_cached} must be in [0, input_tokens - 1] "
                         f"for a prompt of {input_tokens} tokens")
    held_end = (input_tokens + max(1, output_tokens) - 1) // block_size * block_size
    if write_limit is not None:
        held_end = min(held_end, write_limit // block_size * block_size)
    return TokenUsage(input_tokens, expected_cached,
                      _input_written(input_tokens, expected_cached, held_end, block_size))


@dataclass(frozen=True, slots=True)
class CostComparison:
    """Forecast against measured ``M`` for one request or job, priced by one table."""

    price_version: str
    forecast: TokenUsage
    measured: TokenUsage
    forecast_multiplier: float
    measured_multiplier: float

    @property
    def error(self) -> float:
        """Forecast minus measured (positive: the forecast was too pessimistic)."""
        return self.forecast_multiplier - self.measured_multiplier


def compare(forecast: TokenUsage, measured: TokenUsage, table: PriceTable, model: str,
            ttl_s: float) -> CostComparison:
    """Price a forecast and a measurement of the same work; both need input tokens."""
    rates = table.rates(model)
    return CostComparison(table.version, forecast, measured,
                          forecast.multiplier(rates, ttl_s), measured.multiplier(rates, ttl_s))

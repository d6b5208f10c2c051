"""Service models for the simulator: how long a worker takes to prefill, load and decode.

Two models answer the same three questions (``prefill_s``, ``step_s``, ``max_batch``):

- ``LinearService``: prefill at ``prefill_tps`` tokens/s, each running decode slowing it by
  ``decode_share``; decode at ``decode_tps`` tokens/s per request, however many run. It is
  orchard's own cost function, so it flatters orchard: no attention growth with context, no
  batch limit, no store load time.
- ``ProfileService``: a measured ``EngineProfile`` of the real engine (``orchard bench
  profile``): prefill seconds on a grid of (cached context, new tokens), decode step seconds
  on a grid of (context, batch size), the store's load seconds per block per tier, and the
  engine's batch limit. Between grid points it interpolates linearly; past the last point it
  extends the last segment (prefill's attention term grows faster than that, so very long
  prompts are under-charged, which flatters no policy in particular).

A profile may also hold speculative decoding's verify passes on a grid of (draft width,
batch size) at one context: ``verify_step_s`` scales the plain step at any context by the
measured pass's ratio to the plain step at that context.

``prefill_s`` and ``step_s`` time a whole request (``orchard simulate``'s offered load);
with a profile the simulator runs the engine's own step loop (``router.sim.steps``: chunked
prefill under a per-step token budget, decodes batched each step), timing each chunk by
``chunk_s`` and each batched decode step by ``step_s``.

A profile is checked before use: ``EngineProfile.check`` refuses one from another model or
block size, naming what differs.
"""
from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class EngineProfile:
    model: str
    revision: str
    block_size: int
    max_batch: int
    kv_bytes_per_token: int
    new_tokens: tuple[int, ...]               # prefill grid columns
    cached_tokens: tuple[int, ...]            # prefill grid rows
    prefill_s: tuple[tuple[float, ...], ...]  # [cached row][new column], first token included
    batch_sizes: tuple[int, ...]              # decode grid columns
    contexts: tuple[int, ...]                 # decode grid rows
    step_s: tuple[tuple[float, ...], ...]     # [context row][batch column]
    load_s_per_block: tuple[tuple[str, float], ...]  # (store tier, seconds per block)
    machine: str = ""
    # speculative decoding's verify pass: ``batch`` rows of ``width`` drafts each, at
    # ``verify_context`` tokens (empty: not measured)
    draft_widths: tuple[int, ...] = ()        # verify grid rows
    verify_s: tuple[tuple[float, ...], ...] = ()  # [width row][batch column]
    verify_context: int = 0

    def __post_init__(self) -> None:
        _check_grid("prefill", self.cached_tokens, self.new_tokens, self.prefill_s)
        _check_grid("decode", self.contexts, self.batch_sizes, self.step_s)
        if self.draft_widths or self.verify_s:
            _check_grid("verify", self.draft_widths, self.batch_sizes, self.verify_s)
            if self.draft_widths[0] < 1 or self.verify_context < 1:
                raise ValueError("profile: draft widths and the verify context start at >= 1")
        if self.block_size <= 0 or self.max_batch <= 0:
            raise ValueError("profile: block_size and max_batch must be positive")
        if not self.load_s_per_block:
            raise ValueError("profile: load_s_per_block needs at least the memory tier")

    def check(self, block_size: int, model: str | None = None) -> None:
        """Refuse this profile for a run on another model or block size, saying what differs."""
        differs = []
        if block_size != self.block_size:
            differs.append(f"block size {self.block_size} (the run uses {block_size})")
        if model is not None and model != self.model:
            differs.append(f"model {self.model!r} (the run uses {model!r})")
        if differs:
            raise ValueError("the profile was measured with " + " and ".join(differs)
                             + ": measure one with `orchard bench profile` for this setup")

    def load_s(self, tier: str = "memory") -> float:
        return dict(self.load_s_per_block)[tier]

    def write(self, path: str | Path) -> None:
        data = {"version": PROFILE_VERSION, **asdict(self)}
        data["load_s_per_block"] = dict(self.load_s_per_block)
        Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: str | Path) -> "EngineProfile":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile {str(path)!r} not found: write one with "
                                    f"`orchard bench profile --out {path}`")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {str(path)!r} is not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile {str(path)!r}: expected version {PROFILE_VERSION}, "
                             f"got {data.get('version') if isinstance(data, dict) else data!r}")
        try:
            return cls(
                model=str(data["model"]), revision=str(data["revision"]),
                block_size=int(data["block_size"]), max_batch=int(data["max_batch"]),
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                new_tokens=tuple(map(int, data["new_tokens"])),
                cached_tokens=tuple(map(int, data["cached_tokens"])),
                prefill_s=tuple(tuple(map(float, r)) for r in data["prefill_s"]),
                batch_sizes=tuple(map(int, data["batch_sizes"])),
                contexts=tuple(map(int, data["contexts"])),
                step_s=tuple(tuple(map(float, r)) for r in data["step_s"]),
                load_s_per_block=tuple((str(k), float(v))
                                       for k, v in data["load_s_per_block"].items()),
                machine=str(data.get("machine", "")),
                draft_widths=tuple(map(int, data.get("draft_widths", ()))),
                verify_s=tuple(tuple(map(float, r)) for r in data.get("verify_s", ())),
                verify_context=int(data.get("verify_context", 0)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"profile {str(path)!r} lacks or mistypes a field ({exc}): "
                             f"write it again with `orchard bench profile`") from None


class LinearService:
    """Prefill linear in uncached tokens, decode at a fixed speed per request, no batch limit."""

    max_batch = 0  # no limit

    def __init__(self, prefill_tps: float, decode_tps: float, decode_share: float) -> None:
        self.prefill_tps, self.decode_tps, self.decode_share = prefill_tps, decode_tps, decode_share

    def prefill_s(self, new: int, cached: int, running: int, context: int) -> float:
        return new / self.prefill_tps * (1.0 + self.decode_share * running)

    def step_s(self, batch: int, context: int) -> float:
        return 1.0 / self.decode_tps


class ProfileService:
    """The measured engine: prefill and decode steps interpolated on the profile's grids."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.max_batch = profile.max_batch
        self._load = profile.load_s("memory")

    def prefill_s(self, new: int, cached: int, running: int, context: int) -> float:
        """Load the cached blocks, prefill ``new`` tokens onto them, then one decode step of
        the ``running`` requests (the engine's step after an admission)."""
        p = self.profile
        prefill = _interp2(p.cached_tokens, p.new_tokens, p.prefill_s, cached, new)
        load = cached / p.block_size * self._load
        return prefill + load + (self.step_s(running, context) if running else 0.0)

    def step_s(self, batch: int, context: int) -> float:
        p = self.profile
        return _interp2(p.contexts, p.batch_sizes, p.step_s, context, batch)

    def verify_step_s(self, batch: int, width: int, context: int) -> float:
        """A verify pass of ``batch`` rows with ``width`` drafts each at ``context`` tokens:
        the measured pass over a plain step at the verify context, times the plain step here
        (``width`` 0: a plain step)."""
        p = self.profile
        if width == 0:
            return self.step_s(batch, context)
        if not p.draft_widths:
            raise ValueError("the profile has no verify passes: measure one with "
                             "`orchard bench profile` to simulate speculative decoding")
        over = (_interp2(p.draft_widths, p.batch_sizes, p.verify_s, width, batch)
                / self.step_s(batch, p.verify_context))
        return over * self.step_s(batch, context)

    def chunk_s(self, new: int, context: int) -> float:
        """One prefill chunk of ``new`` tokens onto ``context`` tokens already in the cache."""
        p = self.profile
        return _interp2(p.cached_tokens, p.new_tokens, p.prefill_s, context, new)

    def load_s(self, tokens: int) -> float:
        """Reading ``tokens`` cached tokens' K/V from the memory tier of the store."""
        return tokens / self.profile.block_size * self._load


def _check_grid(name: str, rows: Sequence[int], cols: Sequence[int],
                values: Sequence[Sequence[float]]) -> None:
    for axis in (rows, cols):
        if not axis or any(b <= a for a, b in zip(axis, axis[1:])):
            raise ValueError(f"profile: the {name} grid's axes must be non-empty and increasing")
    if len(values) != len(rows) or any(len(r) != len(cols) for r in values):
        raise ValueError(f"profile: the {name} grid is {len(rows)} x {len(cols)} but its values "
                         f"are not")
    if any(v < 0 for r in values for v in r):
        raise ValueError(f"profile: the {name} grid has a negative time")


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), the end segments extended; never below 0."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _interp2(rows: Sequence[int], cols: Sequence[int], values: Sequence[Sequence[float]],
             row: float, col: float) -> float:
    along = [_interp(cols, r, col) for r in values]
    return _interp(rows, along, row)

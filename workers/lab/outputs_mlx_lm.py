"""``orchard bench outputs --vs-mlx-lm``: the same extraction job through ``mlx_lm.server``.

``mlx_lm.server`` has log-probabilities (top 10) but no structured outputs: it accepts
``response_format`` and ignores it. So the comparison is of what each server does with the
same 200 requests, each against its own free-text run, interleaved round by round with
orchard's: the wall time of log-probabilities over free text, and the share of the
``response_format`` outputs that validate (with its wall time over free text). mlx-lm is
driven as its users drive it, by 8 concurrent HTTP clients (it batches 8 prompts and 32
decodes); orchard's side is its engine in-process, so absolute wall times are printed but only
the ratios compare.
"""
from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from workers.lab.outputs_bench import valid_json

CLIENTS = 8


@dataclass(frozen=True, slots=True)
class MlxLmRun:
    wall_s: float
    output_tokens: int
    texts: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MlxLmOutputs:
    free_wall_s: float
    logprobs_wall_s: float
    json_wall_s: float
    free_output_tokens: int
    json_output_tokens: int
    logprobs_wall_ratio: float
    json_schema_wall_ratio: float
    json_schema_valid_share: float


class MlxLmSide:
    """A running ``mlx_lm.server`` and the three request kinds of the outputs bench."""

    def __init__(self, model_dir: str, max_tokens: int, schema: dict) -> None:
        from cluster.bench.vs_mlx_lm import MlxLmServer

        self._tmp = tempfile.TemporaryDirectory(prefix="orchard-outputs-mlx-")
        self._server = MlxLmServer(str(model_dir), max_tokens,
                                   Path(self._tmp.name) / "mlx_lm_server.log")
        self._max_tokens = max_tokens
        self._schema = schema
        self._server.wait_ready()
        self._server.reply([{"role": "user", "content": "warm up"}], 2)
        self.runs: dict[str, list[MlxLmRun]] = {"free": [], "json": [], "logprobs": []}

    def close(self) -> None:
        self._server.stop()
        self._tmp.cleanup()

    def run(self, kind: str, chats: list[list[dict]]) -> None:
        extra = request_extra(kind, self._schema)
        start = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            replies = list(pool.map(
                lambda m: self._server.reply(m, self._max_tokens, extra), chats))
        wall = time.perf_counter() - start
        texts = tuple(r["choices"][0]["message"]["content"] or "" for r in replies)
        tokens = sum(int(r.get("usage", {}).get("completion_tokens", 0)) for r in replies)
        self.runs[kind].append(MlxLmRun(wall, tokens, texts))

    def figures(self) -> MlxLmOutputs:
        return outputs_figures(self.runs, self._schema)


def request_extra(kind: str, schema: dict) -> dict:
    """The body fields of a request of ``kind`` (free, logprobs or json) beside its messages."""
    return {"free": {},
            "logprobs": {"logprobs": True, "top_logprobs": 5},
            "json": {"response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": schema, "strict": True}}}}[kind]


def outputs_figures(runs: dict[str, list[MlxLmRun]], schema: dict) -> MlxLmOutputs:
    """Each kind's fastest round; the ratios over free text; the share of valid JSON."""
    best = {k: min(v, key=lambda run: run.wall_s) for k, v in runs.items()}
    free, constrained, logprobs = best["free"], best["json"], best["logprobs"]
    valid = sum(valid_json(t, schema) for t in constrained.texts)
    return MlxLmOutputs(
        round(free.wall_s, 3), round(logprobs.wall_s, 3), round(constrained.wall_s, 3),
        free.output_tokens, constrained.output_tokens,
        round(logprobs.wall_s / free.wall_s, 4), round(constrained.wall_s / free.wall_s, 4),
        round(valid / max(1, len(constrained.texts)), 4))

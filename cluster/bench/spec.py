"""``orchard bench spec [--json]``: speculative decoding on and off, and beside mlx_lm.server.

One worker's engine, in process (the engine a worker actor runs, without the frontend), on
the default model unless ``--model``. Runs with speculation on and off alternate round by
round (``--rounds``; the best of each counts), each on a fresh engine whose store is first
warmed with every prompt (one token each, untimed): a batch job's prefill is then mostly read
from the cache, and what is timed is what is left, decode.

1. **Copy-heavy job.** ``--requests`` (64) requests, each asking to quote, correct or
   reformat a passage of about ``--passage-tokens`` (300) tokens of its own prompt, greedy,
   ``--max-tokens`` (200) each. Output tokens per second with speculation on over off, at
   batch 1 and at ``--batch`` (8) rows (an engine of ``--batch`` + 1 seats, one kept for
   interactive requests): ``copy_speedup_batch1``, ``copy_speedup_batch8``
   (target >= 2.0 at batch 8).
2. **Chat job with nothing to copy.** The batch of ``orchard bench vs-mlx-lm`` (``--chats``
   16 conversations x 3 turns, 48 requests, 24-token replies): ``chat_speedup`` (target >= 0.97: no loss).
3. **Beside mlx_lm.server.** The copy-heavy requests through ``mlx_lm.server`` (its own
   batching, no draft) from ``--batch`` concurrent clients, against orchard's engine with
   speculation: ``vs_mlx_lm_copy_wall_ratio``, orchard's wall time over mlx-lm's (target <=
   0.5). ``--no-mlx-lm`` skips it (the figure is then null).

With ``--draft-model DIR`` the speculating runs draft with that model (``[engine]
draft_model``) in place of prompt lookup, and ``draft_prefill_over_target_prefill`` is what
the draft's prefill of the copy prompts costs (the prefix it recomputes as each request
joins) over the target's prefill of the same prompts, each prompt alone, best of three.

``greedy_identical`` is true when every output with speculation equals the output without.
Also printed: the acceptance rate (accepted over drafted tokens), the mean tokens accepted per
verify pass, and a verify pass's time over a plain decode step's (both measured in the
speculating runs of the copy job at ``--batch``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

TARGETS = {"copy_speedup_batch8": 2.0, "chat_speedup": 0.97, "vs_mlx_lm_copy_wall_ratio": 0.5}
_WORDS = ("orchard apple cache block prefix router token worker cluster batch tenant model "
          "memory store replay trace forecast input output river mountain garden pear cherry "
          "branch blossom harvest ladder basket season frost root").split()
_TASKS = ("Quote the following passage exactly, word for word:",
          "Correct the spelling mistakes in the following passage and write it out in full:",
          "Rewrite the following passage with every sentence on a line of its own:")


@dataclass(frozen=True, slots=True)
class SpecWorkload:
    requests: int = 64
    passage_tokens: int = 300
    max_tokens: int = 200
    batch: int = 8
    chats: int = 16           # conversations of 3 turns: 48 requests
    rounds: int = 1
    mlx_lm: bool = True
    seed: int = 0
    draft_model: str = ""     # a draft model directory for the speculating runs

    def __post_init__(self) -> None:
        for name in ("requests", "passage_tokens", "max_tokens", "batch", "chats", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    output_tokens: int
    outputs: tuple[tuple[int, ...], ...]
    stats: object = None  # workers.engine.draft.SpecStats of a speculating run

    @property
    def tokens_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _passage(rng: random.Random, tokens: int) -> str:
    """Sentences of orchard words, about ``tokens`` tokens (SmolLM2: about 1.3 a word)."""
    words, out = int(tokens / 1.3), []
    while len(out) < words:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randrange(6, 14))]
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out)


def _typos(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) // 12)):
        w = words[i]
        if len(w) > 3:
            words[i] = w[:1] + w[2] + w[1] + w[3:]
    return " ".join(words)


def copy_messages(w: SpecWorkload) -> list[list[dict]]:
    rng = random.Random(w.seed)
    out = []
    for i in range(w.requests):
        task = _TASKS[i % len(_TASKS)]
        passage = _passage(rng, w.passage_tokens)
        if i % len(_TASKS) == 1:
            passage = _typos(rng, passage)
        out.append([{"role": "user", "content": f"{task}\n\n{passage}"}])
    return out


def chat_messages(w: SpecWorkload) -> list[list[dict]]:
    from cluster.bench.vs_mlx_lm import Workload, batch_requests

    return batch_requests(Workload(chats=w.chats, seed=w.seed), 0)


def _run(loaded, prompts: list[list[int]], max_tokens: int, batch: int, speculate: bool,
         draft_model: str = "") -> Run:
    from workers.engine.engine import Engine, EngineConfig
    from workers.messages import GenerateRequest, GenerateResult, SamplingParams

    # the engine keeps its last seat for an interactive request: a batch job decodes
    # max_batch - 1 rows, so ``batch`` rows take one seat more
    config = EngineConfig(max_batch=batch + 1 if batch > 1 else 1, speculate=speculate,
                          draft_model=draft_model if speculate else "")
    engine = Engine(loaded, config, time.monotonic, time.time_ns)
    ns = engine.namespace("bench")

    def requests(tag: str, n: int):
        return [GenerateRequest(f"{tag}{i}", ns, tuple(p), SamplingParams(max_tokens=n),
                                batch=True) for i, p in enumerate(prompts)]

    engine.generate(requests("warm", 1))  # prompts into the store, untimed
    start = time.perf_counter()
    results = engine.generate(requests("r", max_tokens))
    wall = time.perf_counter() - start
    if not all(isinstance(r, GenerateResult) for r in results):
        raise RuntimeError(f"a benchmark request failed: {results}")
    return Run(wall, sum(len(r.output_tokens) for r in results),
               tuple(r.output_tokens for r in results), engine.spec_stats())


def _pair(loaded, prompts, max_tokens: int, batch: int, w: SpecWorkload, label: str
          ) -> tuple[Run, Run]:
    """Best run of each side over ``w.rounds``, the first side alternating."""
    runs: dict[bool, list[Run]] = {False: [], True: []}
    for k in range(w.rounds):
        for speculate in ((False, True) if k % 2 == 0 else (True, False)):
            runs[speculate].append(_run(loaded, prompts, max_tokens, batch, speculate,
                                        w.draft_model))
            print(f"{label} round {k} speculate={speculate}: {runs[speculate][-1].wall_s:.1f} s",
                  file=sys.stderr, flush=True)
    best = lambda rs: min(rs, key=lambda r: r.wall_s)
    return best(runs[False]), best(runs[True])


def _mlx_lm_wall(model_dir: str, messages: list[list[dict]], w: SpecWorkload) -> float:
    from cluster.bench.vs_mlx_lm import MlxLmServer

    with tempfile.TemporaryDirectory(prefix="orchard-spec-mlx-") as tmp:
        server = MlxLmServer(model_dir, w.max_tokens, Path(tmp) / "mlx_lm_server.log")
        try:
            server.wait_ready()
            server.chat([{"role": "user", "content": "warm up"}], 2, stream=False)
            start = time.perf_counter()
            with ThreadPoolExecutor(w.batch) as pool:
                list(pool.map(lambda m: server.chat(m, w.max_tokens, stream=False), messages))
            return time.perf_counter() - start
        finally:
            server.stop()


def _prefill_ratio(loaded, draft_dir: str, prompts: list[list[int]]) -> float:
    """The draft's prefill of ``prompts`` over the target's (each prompt alone, its body
    only, best of three): what recomputing the draft's prefix on admission costs."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from workers.model.model_dir import open_model_dir

    def prefill_s(model) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for p in prompts:
                cache = [KVCache() for _ in range(model.kv_shape.layers)]
                model.body(mx.array([p]), cache=cache)
                mx.eval([[c.keys, c.values] for c in cache])
            best = min(best, time.perf_counter() - start)
        return best

    return prefill_s(open_model_dir(draft_dir)) / prefill_s(loaded)


def bench_spec(model_dir: str, w: SpecWorkload) -> dict:
    from workers.model.model_dir import open_model_dir
    from workers.engine.chat import render_chat

    loaded = open_model_dir(model_dir)
    copy = copy_messages(w)
    copy_prompts = [render_chat(loaded.tokenizer, m) for m in copy]
    chat_prompts = [render_chat(loaded.tokenizer, m) for m in chat_messages(w)]
    off1, on1 = _pair(loaded, copy_prompts, w.max_tokens, 1, w, "copy batch 1")
    off8, on8 = _pair(loaded, copy_prompts, w.max_tokens, w.batch, w, f"copy batch {w.batch}")
    chat_off, chat_on = _pair(loaded, chat_prompts, 24, w.batch, w, "chat")
    mlx_wall = _mlx_lm_wall(model_dir, copy, w) if w.mlx_lm else None
    s = on8.stats
    plain_step = s.plain_s / s.plain_steps if s.plain_steps else None
    verify_pass = s.verify_s / s.verify_passes if s.verify_passes else None
    pairs = ((off1, on1), (off8, on8), (chat_off, chat_on))
    return {
        "model": model_dir, "workload": asdict(w), "draft_model": w.draft_model or None,
        "orchard_side": "one engine in process (a worker's engine, without the frontend)",
        "copy_speedup_batch1": on1.tokens_s / off1.tokens_s,
        "copy_speedup_batch8": on8.tokens_s / off8.tokens_s,
        "chat_speedup": chat_on.tokens_s / chat_off.tokens_s,
        "vs_mlx_lm_copy_wall_ratio": on8.wall_s / mlx_wall if mlx_wall else None,
        "greedy_identical": all(a.outputs == b.outputs for a, b in pairs),
        "copy_tokens_s_batch8": {"off": off8.tokens_s, "on": on8.tokens_s},
        "copy_wall_s_batch8": {"off": off8.wall_s, "on": on8.wall_s, "mlx_lm": mlx_wall},
        "acceptance_rate": s.accepted / s.drafted if s.drafted else None,
        "accepted_per_verify_pass": s.accepted / s.verify_passes if s.verify_passes else None,
        "verify_pass_over_plain_step": (verify_pass / plain_step
                                        if verify_pass and plain_step else None),
        "draft_s_per_verify_pass": s.draft_s / s.verify_passes if s.verify_passes else None,
        "draft_prefill_over_target_prefill": (_prefill_ratio(loaded, w.draft_model,
                                                             copy_prompts)
                                              if w.draft_model else None),
        "load_average": list(os.getloadavg()), "targets": TARGETS,
    }


def register_bench(sub: argparse._SubParsersAction) -> None:
    """Add ``spec`` to the ``orchard bench`` subcommands."""
    p = sub.add_parser("spec", help="speculative decoding on and off (copy-heavy and chat "
                                    "jobs), and beside mlx_lm.server")
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    d = SpecWorkload()
    for name in ("requests", "passage_tokens", "max_tokens", "batch", "chats", "rounds",
                 "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm.server side")
    p.add_argument("--draft-model", default="", metavar="DIR",
                   help="draft with this model directory (the target's tokenizer) in place "
                        "of prompt lookup")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model

    w = SpecWorkload(args.requests, args.passage_tokens, args.max_tokens, args.batch,
                     args.chats, args.rounds, not args.no_mlx_lm, args.seed, args.draft_model)
    figures = bench_spec(str(args.model or ensure_default_model()), w)
    if args.json:
        print(json.dumps(figures))
        return 0
    for key, value in figures.items():
        print(f"{key:<30} {value}")
    return 0

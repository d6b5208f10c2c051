"""``orchard bench cluster``: orchard's routing against round robin on local Ray workers.

The workload: ``conversations`` chats (default 8) of ``turns`` turns (default 6), sharing
``system_prompts`` system prompts (default 4, assigned round robin). Each turn's prompt is the
previous turn's prompt, the reply the model generated for it, and a new user message, all in
token space (what a chat template produces, less the template), so a turn can reuse the K/V of
everything before it, and sibling conversations can reuse their system prompt. Conversations
run concurrently, each one turn after another, as chat users do.

Both policies run in the same Ray cluster on fresh worker actors (empty caches), one after the
other: ``orchard`` (the frontend's router, fed by the workers' block events) and ``round_robin``
(cycling through the ready workers). Per policy: computed (prefilled) tokens, hit ratio
(cached / input tokens), wall time, TTFT p50 and p99 (the worker's request-received -> first
token, queueing on the worker included), and requests per worker.

The default sizes (256-token system prompts, 32-token user turns, 8-token replies on the
embedded SmolLM2-135M, 30 layers) keep one run of both policies to a few minutes on a 2-core
machine, where this model prefills about 100 tokens/s per core.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

from cluster.backend.bootstrap import Placement
from router.kv.stats import percentile


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 8
    turns: int = 6
    system_prompts: int = 4
    system_tokens: int = 256
    user_tokens: int = 32
    reply_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "system_tokens",
                     "user_tokens", "reply_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    requests: int
    input_tokens: int
    cached_tokens: int
    computed_tokens: int
    hit_ratio: float
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    per_worker: dict[str, int]
    retried: int


async def _conversation(backend, workload: Workload, index: int, vocab: int, namespace,
                        block_size: int, outcomes: list) -> None:
    from router.kv.key import hash_blocks
    from workers.messages import GenerateRequest, SamplingParams

    rng = random.Random(workload.seed * 1_000_003 + index)
    system = random.Random(workload.seed * 7919 + index % workload.system_prompts)
    prompt = [system.randrange(10, vocab) for _ in range(workload.system_tokens)]
    for turn in range(workload.turns):
        prompt += [rng.randrange(10, vocab) for _ in range(workload.user_tokens)]
        request = GenerateRequest(f"c{index:02d}t{turn:02d}", namespace, tuple(prompt),
                                  SamplingParams(max_tokens=workload.reply_tokens))
        outcome = await backend.generate(request, hash_blocks(prompt, block_size, namespace))
        outcomes.append(outcome)
        prompt += list(outcome.result.output_tokens)


async def run_policy(policy: str, model_dir: str, workers: int, workload: Workload,
                     placement: Placement = Placement()) -> PolicyResult:
    from cluster.backend.ray_backend import RayBackend
    from router.kv.key import Namespace

    backend = RayBackend(model_dir, workers, placement=placement, policy=policy)
    await backend.start()
    try:
        info = backend.model_info()
        namespace = Namespace("bench", info.model_id, info.revision)
        outcomes: list = []
        started = time.monotonic()
        await asyncio.gather(*(
            _conversation(backend, workload, i, info.vocab_size, namespace, info.block_size,
                          outcomes) for i in range(workload.conversations)))
        wall_s = time.monotonic() - started
    finally:
        await backend.close()
    results = [o.result for o in outcomes]
    input_tokens = sum(r.input_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    return PolicyResult(
        policy=policy, requests=len(results), input_tokens=input_tokens, cached_tokens=cached,
        computed_tokens=sum(r.computed_tokens for r in results),
        hit_ratio=cached / input_tokens if input_tokens else 0.0, wall_s=wall_s,
        ttft_p50_s=statistics.median(ttfts) if ttfts else 0.0,
        ttft_p99_s=percentile(ttfts, 0.99),
        per_worker=dict(sorted(Counter(o.worker_id for o in outcomes).items())),
        retried=sum(1 for o in outcomes if o.attempts > 1))


def bench_cluster(model_dir: str, workers: int, workload: Workload,
                  policies: tuple[str, ...] = ("orchard", "round_robin")) -> list[PolicyResult]:
    """Each policy on fresh workers in one embedded Ray cluster; results in policy order."""
    from cluster.backend import bootstrap

    placement = Placement()
    bootstrap.start_local(bootstrap.local_cpus(workers, placement))
    try:
        return [asyncio.run(run_policy(p, model_dir, workers, workload, placement))
                for p in policies]
    finally:
        bootstrap.shutdown()


def register_bench(sub) -> None:
    """Add ``cluster`` to the ``orchard bench`` subcommands."""
    p = sub.add_parser("cluster", help="orchard's routing vs round robin on local Ray workers")
    p.add_argument("--workers", type=int, default=4)
    for field, default in asdict(Workload()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_command)


def _command(args) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model

    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    workload = Workload(**{f: getattr(args, f) for f in asdict(Workload())})
    results = bench_cluster(str(args.model or ensure_default_model()), args.workers, workload)
    if args.json:
        print(json.dumps({"workers": args.workers, "workload": asdict(workload),
                          "policies": [asdict(r) for r in results]}, indent=2))
        return 0
    print(f"{workload.conversations} conversations x {workload.turns} turns, "
          f"{workload.system_prompts} system prompts of {workload.system_tokens} tokens, "
          f"{args.workers} workers")
    print(f"{'policy':<12} {'requests':>8} {'computed':>9} {'cached':>8} {'hit':>6} "
          f"{'wall':>7} {'TTFT p50':>9} {'TTFT p99':>9}  per worker")
    for r in results:
        print(f"{r.policy:<12} {r.requests:>8} {r.computed_tokens:>9} {r.cached_tokens:>8} "
              f"{r.hit_ratio:>6.1%} {r.wall_s:>6.1f}s {r.ttft_p50_s * 1e3:>7.0f}ms "
              f"{r.ttft_p99_s * 1e3:>7.0f}ms  {r.per_worker}")
    return 0

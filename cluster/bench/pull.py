"""``orchard bench pull``: TTFT with a prefix pulled from a peer over TTFT recomputing it.

Two workers (``cluster.backend.worker_actor.EngineWorker``) in this process, each serving
its stream on loopback as a Ray actor does on its node: w0 holds a ``prefix_tokens`` prefix
(it computed it once), and a request of that prefix and ``suffix_tokens`` more is sent to w1,
which either recomputes the prefix (its store emptied) or first pulls it from w0
(``cluster.backend.pull``). TTFT is the caller's: from the request sent to its first token,
the pull included.

The links. Loopback is not a network, and shaping it with ``tc netem`` needs network
namespaces this bench does not create, so the holder paces its own sending instead
(``RateLimit``: a rate limit inside the transfer stream, stated in the output as
``shaping``): 10 Gbit/s with 0.1 ms of delay and 1 Gbit/s with 0.5 ms, the delay once per
pull. The pull's other costs (its connection, authentication, framing, the checks and the
receiver's store writes) are real.

Figures: ``ttft_pull_over_recompute_10gbit`` and ``_1gbit`` (best of ``trials`` each) and
``outputs_identical`` (the pulled request's tokens equal the recomputed one's and the
holder's own, greedy); ``ladder`` gives the ratio at each length of ``--ladder`` (best of
``trials`` each; ``--ladder`` alone: ``DEFAULT_LADDER``) on both links, and
``pull_wins_from_tokens`` per link the shortest prefix from which the pull's TTFT is below the
recompute's at that length and every longer one of the ladder (null: not even at the longest);
``holder_tpot_during_pull_over_alone``: the holder's median decode TPOT while it serves pulls
of the prefix back to back, over its TPOT alone (both workers share the machine, so this
bounds from above what serving a pull costs the holder's decodes).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from cluster.backend.protocol import TokenChunk
from cluster.backend.pull import EngineBlocks, PullLog, pull as pull_blocks
from cluster.backend.wire import Prefilled, PullPlan, WorkerDone
from cluster.backend.worker_actor import EngineWorker
from router.kv.key import Namespace
from workers.engine.config import EngineConfig
from workers.messages import GenerateRequest, SamplingParams

SHAPING = "rate limit in the transfer stream (no netem shaping)"
LINKS = {"10gbit": (10e9 / 8, 0.0001), "1gbit": (1e9 / 8, 0.0005)}   # bytes/s, delay s
BLOCK = 16
DEFAULT_LADDER = (64, 128, 256, 512, 1024, 2000)   # prefix lengths, tokens
SECRET = b"bench-pull-secret-0123456789abcd"


class RateLimit:
    """Paces a holder's blocks to ``bytes_s``, with ``delay_s`` before a pull's first block
    (a pull's first block comes after ``idle_s`` with nothing sent)."""

    def __init__(self, bytes_s: float, delay_s: float, idle_s: float = 0.05) -> None:
        self._bytes_s, self._delay_s, self._idle_s = bytes_s, delay_s, idle_s
        self._free_at = 0.0

    async def __call__(self, nbytes: int) -> None:
        now = time.monotonic()
        start = now + self._delay_s if now - self._free_at > self._idle_s else self._free_at
        self._free_at = max(start, now) + nbytes / self._bytes_s
        await asyncio.sleep(max(0.0, self._free_at - now))


@dataclass(frozen=True, slots=True)
class LinkResult:
    link: str
    prefix_tokens: int
    ttft_pull_s: float
    ttft_recompute_s: float
    ttft_pull_over_recompute: float
    pulled_tokens: int
    pull_s: float
    outputs_identical: bool


async def _timed(worker: EngineWorker, request: GenerateRequest, pull: PullPlan | None
                 ) -> tuple[float, WorkerDone]:
    sent = time.perf_counter()
    first = None
    async with contextlib.aclosing(worker.generate(request, None, False, pull=pull)) as items:
        async for item in items:
            if isinstance(item, Prefilled) and first is None:
                first = time.perf_counter() - sent
            if isinstance(item, WorkerDone):
                return first if first is not None else time.perf_counter() - sent, item
    raise RuntimeError(f"{request.request_id} ended without a result")


async def _two_workers(model: str, link: str
                       ) -> tuple[EngineWorker, EngineWorker, int, Namespace]:
    """A holder (w0, serving pulls at ``link``'s rate) and a receiver (w1), both listening:
    the two workers, the holder's port and the bench's namespace."""
    rate, delay = LINKS[link]
    config = EngineConfig(block_size=BLOCK, kept_bytes=0)
    w0 = EngineWorker("w0", model, config, pace=RateLimit(rate, delay))
    w1 = EngineWorker("w1", model, config)
    hello = await w0.start()
    await w1.start()
    _, port = await w0.listen(SECRET)
    await w1.listen(SECRET)
    return w0, w1, port, Namespace("bench", hello.model.model_id, hello.model.revision)


async def _one_link(model: str, link: str, prefix_tokens: int, suffix_tokens: int,
                    trials: int, seed: int) -> LinkResult:
    w0, w1, port, ns = await _two_workers(model, link)
    try:
        rng = random.Random(seed)
        prompt = tuple(rng.randrange(100, 20_000) for _ in range(prefix_tokens + suffix_tokens))
        sampling = SamplingParams(max_tokens=8)
        _, own = await _timed(w0, GenerateRequest("warm", ns, prompt, sampling), None)
        plan = PullPlan("w0", "127.0.0.1", port, prefix_tokens // BLOCK, 1.0)
        best_pull = best_recompute = float("inf")
        identical, pulled = True, None
        for trial in range(trials):
            await w1.invalidate(ns, None)
            t_re, recomputed = await _timed(w1, GenerateRequest(f"re{trial}", ns, prompt,
                                                                sampling), None)
            await w1.invalidate(ns, None)
            t_pull, pulled = await _timed(w1, GenerateRequest(f"pull{trial}", ns, prompt,
                                                              sampling), plan)
            best_pull, best_recompute = min(best_pull, t_pull), min(best_recompute, t_re)
            identical &= (pulled.result.output_tokens == recomputed.result.output_tokens
                          == own.result.output_tokens)
            identical &= pulled.pulled.refused == ""
        return LinkResult(link, prefix_tokens, best_pull, best_recompute,
                          best_pull / best_recompute, pulled.pulled.tokens,
                          pulled.pulled.seconds, identical)
    finally:
        await w0.close()
        await w1.close()


async def _tpot_s(worker: EngineWorker, request: GenerateRequest) -> float:
    """The median time between a request's streamed tokens."""
    stamps = []
    async with contextlib.aclosing(worker.generate(request, None, True)) as items:
        async for item in items:
            if isinstance(item, TokenChunk):
                stamps.extend([time.perf_counter()] * len(item.token_ids))
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


async def _holder_slowdown(model: str, prefix_tokens: int, decode_tokens: int, seed: int
                           ) -> float:
    """The holder's decode TPOT while it serves pulls back to back (at 10 Gbit/s), over its
    TPOT alone. Both workers share this machine, so the receiver's checks and store writes
    compete with the holder's decodes too: an upper bound of what serving costs it."""
    w0, w1, port, ns = await _two_workers(model, "10gbit")
    try:
        rng = random.Random(seed + 1)
        prefix = tuple(rng.randrange(100, 20_000) for _ in range(prefix_tokens + 1))
        await _timed(w0, GenerateRequest("held", ns, prefix, SamplingParams(max_tokens=1)), None)
        decode = tuple(rng.randrange(100, 20_000) for _ in range(32))
        sampling = SamplingParams(max_tokens=decode_tokens)
        alone = await _tpot_s(w0, GenerateRequest("alone", ns, decode, sampling))
        plan = PullPlan("w0", "127.0.0.1", port, prefix_tokens // BLOCK, 1.0)
        blocks, failures = EngineBlocks(w1.runtime, "w1", BLOCK), PullLog()
        decoding = asyncio.create_task(_tpot_s(w0, GenerateRequest("busy", ns, decode, sampling)))
        while not decoding.done():
            await w1.invalidate(ns, None)
            await pull_blocks(plan, ns, prefix, SECRET, blocks, failures)
        return await decoding / alone
    finally:
        await w0.close()
        await w1.close()


def pull_wins_from(steps: Sequence[LinkResult], link: str) -> int | None:
    """The shortest prefix of the ladder from which a pull beat recomputing on ``link`` at
    every longer length too (None: it lost at the longest)."""
    wins = None
    for step in sorted((r for r in steps if r.link == link), key=lambda r: -r.prefix_tokens):
        if step.ttft_pull_s >= step.ttft_recompute_s:
            break
        wins = step.prefix_tokens
    return wins


def bench_pull(model: str, prefix_tokens: int, suffix_tokens: int, trials: int,
               ladder: tuple[int, ...] = (), seed: int = 0, decode_tokens: int = 64) -> dict:
    async def run() -> dict:
        links = {name: await _one_link(model, name, prefix_tokens, suffix_tokens, trials, seed)
                 for name in LINKS}
        slowdown = await _holder_slowdown(model, prefix_tokens, decode_tokens, seed)
        steps = [await _one_link(model, name, n, suffix_tokens, trials, seed)
                 for n in ladder for name in LINKS]
        return {
            "shaping": SHAPING, "prefix_tokens": prefix_tokens, "suffix_tokens": suffix_tokens,
            "trials": trials,
            **{f"ttft_pull_over_recompute_{n}": r.ttft_pull_over_recompute
               for n, r in links.items()},
            "outputs_identical": all(r.outputs_identical for r in [*links.values(), *steps]),
            "holder_tpot_during_pull_over_alone": slowdown,
            "links": [asdict(r) for r in links.values()],
            "ladder": [asdict(r) for r in steps],
            "pull_wins_from_tokens": ({name: pull_wins_from(steps, name) for name in LINKS}
                                      if ladder else {})}
    return asyncio.run(run())


def register_bench(sub) -> None:
    """Add ``pull`` to the ``orchard bench`` subcommands."""
    p = sub.add_parser("pull", help="TTFT with a prefix pulled from a peer over recomputing it")
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--ladder", nargs="?", default="",
                   const=",".join(map(str, DEFAULT_LADDER)),
                   help="prefix lengths, comma-separated: the ratio at each, and the length "
                        "from which a pull wins (alone: "
                        f"{','.join(map(str, DEFAULT_LADDER))})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_command)


def _command(args) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model

    if args.prefix_tokens < BLOCK or args.suffix_tokens < 1 or args.trials < 1:
        raise ValueError(f"--prefix-tokens must be >= {BLOCK}, --suffix-tokens and --trials "
                         ">= 1")
    try:
        ladder = tuple(int(n) for n in args.ladder.split(",") if n.strip())
    except ValueError:
        raise ValueError(f"--ladder: comma-separated token counts, got {args.ladder!r}") from None
    if any(n < BLOCK for n in ladder):
        raise ValueError(f"--ladder: every prefix length must be >= {BLOCK}")
    out = bench_pull(str(args.model or ensure_default_model()), args.prefix_tokens,
                     args.suffix_tokens, args.trials, ladder)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['prefix_tokens']}-token prefix held by w0, the request on w1 ({SHAPING})")
    for r in out["links"] + out["ladder"]:
        print(f"{r['link']:>7} {r['prefix_tokens']:>6} tokens: pull {r['ttft_pull_s'] * 1e3:8.1f}ms"
              f" (the pull {r['pull_s'] * 1e3:.1f}ms), recompute "
              f"{r['ttft_recompute_s'] * 1e3:8.1f}ms, ratio {r['ttft_pull_over_recompute']:.3f}")
    for name, tokens in out["pull_wins_from_tokens"].items():
        print(f"{name:>7}: a pull wins from {tokens} tokens" if tokens is not None
              else f"{name:>7}: a pull never wins on this ladder")
    print(f"outputs_identical {out['outputs_identical']}")
    print(f"holder_tpot_during_pull_over_alone {out['holder_tpot_during_pull_over_alone']:.3f}")
    return 0

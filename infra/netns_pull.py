"""One side of a pull between two workers on two hosts (network namespaces, ``netns.py``).

    ip netns exec NS_A python infra/netns_pull.py holder --model DIR --host 10.213.T.1 \\
        --secret HEX                      # prints {"host", "port", "output_tokens"}; serves
                                          # pulls until its stdin closes
    ip netns exec NS_B python infra/netns_pull.py receiver --model DIR --host 10.213.T.2 \\
        --secret HEX --holder 10.213.T.1:PORT   # prints what the pull did and both outputs

Both build the same prompt (``--tokens`` from ``--seed``). The holder computes it once and
serves its blocks at ``--link``'s rate: the rate limit inside the transfer stream
(``cluster.bench.pull.RateLimit``), this kernel offering no ``netem`` qdisc to shape the veth
itself. The receiver pulls the prompt's full blocks from the holder across the namespaces,
runs the request on them, then empties its store and recomputes it, and prints one JSON line:
the pull's outcome, the pulled request's cached and computed tokens, and both outputs (greedy).
The test that drives it: ``tests/cluster/backend/test_pull.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workers  # noqa: E402,F401  (OpenBLAS before mlx)
from cluster.backend.wire import PullPlan, WorkerDone  # noqa: E402
from cluster.backend.worker_actor import EngineWorker  # noqa: E402
from cluster.bench.pull import LINKS, RateLimit  # noqa: E402
from router.kv.key import Namespace  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.messages import GenerateRequest, SamplingParams  # noqa: E402

BLOCK = 16


async def _run(worker: EngineWorker, request: GenerateRequest, pull: PullPlan | None = None
               ) -> WorkerDone:
    async with contextlib.aclosing(worker.generate(request, None, False, pull=pull)) as items:
        return [item async for item in items][-1]


async def _worker(name: str, args, pace=None) -> tuple[EngineWorker, str, int, Namespace]:
    worker = EngineWorker(name, args.model, EngineConfig(block_size=BLOCK), pace=pace)
    hello = await worker.start()
    host, port = await worker.listen(bytes.fromhex(args.secret), args.host)
    return worker, host, port, Namespace("t", hello.model.model_id, hello.model.revision)


def _request(ns: Namespace, rid: str, args) -> GenerateRequest:
    rng = random.Random(args.seed)
    prompt = tuple(rng.randrange(1, args.vocab) for _ in range(args.tokens))
    return GenerateRequest(rid, ns, prompt, SamplingParams(max_tokens=args.max_tokens))


async def holder(args) -> None:
    worker, host, port, ns = await _worker("w0", args, RateLimit(*LINKS[args.link]))
    try:
        done = await _run(worker, _request(ns, "held", args))
        print(json.dumps({"host": host, "port": port,
                          "output_tokens": list(done.result.output_tokens)}), flush=True)
        await asyncio.to_thread(sys.stdin.read)   # serve pulls until the caller is done
    finally:
        await worker.close()


async def receiver(args) -> None:
    host, _, port = args.holder.rpartition(":")
    worker, _, _, ns = await _worker("w1", args)
    try:
        plan = PullPlan("w0", host, int(port), args.tokens // BLOCK, 1.0)
        pulled = await _run(worker, _request(ns, "pulled", args), plan)
        await worker.invalidate(ns, None)
        recomputed = await _run(worker, _request(ns, "recomputed", args))
        print(json.dumps({"pulled": asdict(pulled.pulled),
                          "cached_tokens": pulled.result.cached_tokens,
                          "computed_tokens": pulled.result.computed_tokens,
                          "output_tokens": list(pulled.result.output_tokens),
                          "recomputed_output_tokens": list(recomputed.result.output_tokens)}),
              flush=True)
    finally:
        await worker.close()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("holder", "receiver"))
    p.add_argument("--model", required=True, help="mlx-lm model directory")
    p.add_argument("--host", required=True, help="this namespace's address to listen on")
    p.add_argument("--secret", required=True, help="the link secret, hex")
    p.add_argument("--holder", default="", help="receiver: the holder's HOST:PORT")
    p.add_argument("--link", choices=sorted(LINKS), default="10gbit")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--vocab", type=int, default=250, help="prompt token ids below this")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args(argv)
    if args.role == "receiver" and ":" not in args.holder:
        p.error("receiver: --holder HOST:PORT is required")
    if args.tokens < BLOCK:
        p.error(f"--tokens must be at least one block ({BLOCK})")
    return args


if __name__ == "__main__":
    parsed = parse(sys.argv[1:])
    asyncio.run(holder(parsed) if parsed.role == "holder" else receiver(parsed))

"""Run a job on a multi-node cluster and kill one node mid-job (inside the head's namespace).

    ip netns exec HEAD_NS python infra/netns_job.py --address 10.213.T.1:6379 \\
        --model DIR --run-dir DIR --kill-netns orch<tag>1 --kill-address 10.213.T.2

Starts orchard (RayBackend joining the cluster, the router, the frontend on this namespace's
loopback), submits a job of token requests through the public API, waits until the worker on
``--kill-address`` is running requests, SIGKILLs every process of that node's namespace, waits
for the job, and prints one JSON line: what came back and where it ran.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workers  # noqa: E402,F401  (OpenBLAS before mlx)
from cluster.api.client import Client, token_request  # noqa: E402
from cluster.config import write_default_config  # noqa: E402
from cluster.daemon import UpOptions, run_cluster  # noqa: E402


def requests(n: int, max_tokens: int) -> list:
    shared = [100 + (i * 13) % 700 for i in range(64)]
    return [token_request(f"req-{i:03d}", shared + [900 + i * 7 + k for k in range(24)],
                          max_tokens) for i in range(n)]


def drive(run_dir: Path, args) -> dict:
    with Client.from_run_dir(run_dir, admin=True) as admin, Client.from_run_dir(run_dir) as client:
        placed = {w.worker_id: w.node for w in admin.workers()}
        job = client.submit(requests(args.requests, args.max_tokens))
        deadline = time.monotonic() + 120
        victim_running = 0
        while time.monotonic() < deadline:
            victim_running = sum(w.running for w in admin.workers() if w.node == args.kill_address)
            if victim_running > 0 or client.job(job.job_id).finished:
                break
            time.sleep(0.02)
        before = client.job(job.job_id)
        pids = subprocess.run(["ip", "netns", "pids", args.kill_netns], capture_output=True,
                              text=True).stdout.split()
        subprocess.run(["kill", "-9", *pids], capture_output=True)
        killed_at = time.monotonic()
        final = client.wait(job.job_id, poll_s=0.2, timeout_s=args.timeout)
        results = list(client.results(job.job_id))
        after = admin.workers()
    return {"placed": placed, "killed_pids": len(pids), "victim_running": victim_running,
            "done_before_kill": before.done, "total": final.total,
            "recovery_s": round(time.monotonic() - killed_at, 2),
            "results": len(results), "ok": sum(1 for r in results if r.ok),
            "errors": sorted({f"{r.error_code}: {r.error_message}" for r in results if not r.ok}),
            "retried": sum(1 for r in results if r.attempts > 1),
            "ran_on": sorted({r.worker_id for r in results if r.ok}),
            "workers_after": {w.worker_id: w.state for w in after}}


async def main(args) -> dict:
    run_dir = Path(args.run_dir)
    write_default_config(run_dir, model_dir=args.model, max_concurrent=8)
    stop, ready = asyncio.Event(), asyncio.Event()
    cluster = asyncio.create_task(run_cluster(
        UpOptions(run_dir, workers=args.workers, address=args.address), stop,
        lambda state: ready.set()))
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait({cluster, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if cluster.done():
        cluster.result()
    try:
        return await asyncio.to_thread(drive, run_dir, args)
    finally:
        stop.set()
        await cluster


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--kill-netns", required=True)
    parser.add_argument("--kill-address", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=240.0)
    print(json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)

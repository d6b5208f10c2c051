"""``orchard bench ...``: benchmarks that print measured figures.

``orchard bench engine [--json]`` runs the engine benchmark (``workers.lab.bench``, and the
scheduler's figures from ``workers.lab.bench_sched``) on the embedded default model
(SmolLM2-135M-Instruct, imported on first use) or
``--model DIR``; ``orchard bench vs-mlx-lm`` sets orchard beside ``mlx_lm.server``
(``cluster.bench.vs_mlx_lm``); ``orchard bench disk [--json]`` runs the disk tier benchmark
(``workers.lab.disk_bench``): TTFT of a long prefix from disk, memory and recomputed, read/write
bandwidth, decode TPOT while blocks are written behind; ``orchard bench pull [--json]``
(``cluster.bench.pull``): TTFT with a prefix pulled from a peer over recomputing it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from cluster.bench.telemetry import add_parsers as add_telemetry_benches


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks that print measured figures")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    e = sub.add_parser("engine", help="chat TTFT with and without the prefix store")
    e.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    e.add_argument("--turns", type=int, default=8)
    e.add_argument("--reply-tokens", type=int, default=32)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--long-prompt", type=int, default=4000,
                   help="tokens of the prompt admitted while 4 requests decode (decode stall)")
    e.add_argument("--stall-rounds", type=int, default=3)
    e.add_argument("--prefill-prompts", type=int, default=4,
                   help="cold prompts prefilled together, then one at a time")
    e.add_argument("--prefill-tokens", type=int, default=128, help="tokens of each of them")
    e.add_argument("--skip-turns", action="store_true",
                   help="only the scheduler's figures (decode stall, batched prefill)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=engine)
    _add_vs_mlx_lm(sub)
    d = sub.add_parser("disk", help="TTFT from the disk tier vs memory vs recomputed; bandwidth")
    d.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    d.add_argument("--prefix-tokens", type=int, default=2000)
    d.add_argument("--trials", type=int, default=3)
    d.add_argument("--decode-pairs", type=int, default=3,
                   help="decodes alone and with a spill, in alternating order")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=disk)
    o = sub.add_parser("outputs", help="structured outputs and logprobs against free text, "
                                       "in one engine's batch")
    o.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    o.add_argument("--requests", type=int, default=200)
    o.add_argument("--max-tokens", type=int, default=128)
    o.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best counts")
    o.add_argument("--vs-mlx-lm", action="store_true",
                   help="the same requests through mlx_lm.server, interleaved (its ratios)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.set_defaults(func=outputs)
    add_telemetry_benches(sub)  # telemetry (tracing overhead), forecast (job forecast error)
    from cluster.bench.api import register_bench  # `orchard bench api`: the gRPC path overhead
    register_bench(sub)
    from cluster.bench.cluster import register_bench as register_cluster_bench
    register_cluster_bench(sub)  # `orchard bench cluster`: routing vs round robin on Ray
    from cluster.bench.spans import register_bench as register_span_bench
    register_span_bench(sub)  # `orchard bench spans`: span cost of routing and the workers
    from cluster.bench.profile import register_bench as register_profile_bench
    register_profile_bench(sub)  # `orchard bench profile`: the engine's service profile
    from cluster.bench.batch import register_bench as register_batch_bench
    register_batch_bench(sub)  # `orchard bench batch`: a 50,000-request file end to end
    from cluster.bench.spec import register_bench as register_spec_bench
    register_spec_bench(sub)  # `orchard bench spec`: speculative decoding on and off
    from cluster.bench.frontends import register_bench as register_frontends_bench
    register_frontends_bench(sub)  # `orchard bench frontends`: two routers' belief drift
    from cluster.bench.overload import register_bench as register_overload_bench
    register_overload_bench(sub)  # `orchard bench overload`: a flood beside a batch job
    from cluster.bench.pull import register_bench as register_pull_bench
    register_pull_bench(sub)  # `orchard bench pull`: a prefix pulled from a peer vs recomputed
    from cluster.bench.cache_controls import register_bench as register_cache_bench
    register_cache_bench(sub)  # `orchard bench cache-controls`: read/write false, diagnosis
    from cluster.bench.agent_loop import register_bench as register_agent_bench
    register_agent_bench(sub)  # `orchard bench agent-loop`: a volatile line, its fixes
    from cluster.bench.ttl_forecast import register_bench as register_ttl_bench
    register_ttl_bench(sub)  # `orchard bench ttl-forecast`: forecast error, TTLs mixed
    p.set_defaults(func=lambda args: p.print_help() or 2)


def engine(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.lab.bench import bench_engine
    from workers.model.default_model import ensure_default_model

    if min(args.turns, args.reply_tokens, args.block_size, args.long_prompt, args.stall_rounds,
           args.prefill_prompts, args.prefill_tokens) < 1:
        raise ValueError("--turns, --reply-tokens, --block-size, --long-prompt, --stall-rounds, "
                         "--prefill-prompts and --prefill-tokens must be positive")
    model = args.model or ensure_default_model()
    out = {}
    if not args.skip_turns:
        result = bench_engine(model, turns=args.turns, reply_tokens=args.reply_tokens,
                              block_size=args.block_size)
        out = result.as_json()
        if not args.json:
            _print_turns(result)
    sched = _sched(model, args)
    out.update(sched)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    p = sched["prefill_tokens_per_s"]
    print(f"decode_stall_ratio {sched['decode_stall_ratio']:.2f} (target <= 2.0): TPOT p99 "
          f"{sched['tpot_admitting_p99_s'] * 1e3:.1f}ms while a {args.long_prompt}-token prompt "
          f"is admitted, {sched['tpot_idle_p99_s'] * 1e3:.1f}ms idle; ratio of medians "
          f"{sched['decode_stall_ratio_p50']:.2f}; in CPU time {sched['decode_stall_ratio_cpu']:.2f} "
          f"(p99), {sched['decode_stall_ratio_cpu_p50']:.2f} (medians)")
    print(f"prefill_tokens_per_s {p['batched_tokens_per_s']:.1f} batched, "
          f"{p['one_at_a_time_tokens_per_s']:.1f} one at a time "
          f"({p['prompts']} prompts of {p['prompt_tokens']} tokens)")
    return 0


def _sched(model, args: argparse.Namespace) -> dict:
    from workers.lab.bench_sched import as_json, batched_prefill, decode_stall
    from workers.engine.engine import Engine, EngineConfig

    budget = max(512, args.prefill_prompts * args.prefill_tokens)
    engine = Engine.open(model, EngineConfig(block_size=args.block_size, prefill_budget=budget))
    return as_json(decode_stall(engine, args.long_prompt, rounds=args.stall_rounds),
                   batched_prefill(engine, args.prefill_prompts, args.prefill_tokens))


def _print_turns(result) -> None:
    print(f"model {result.model}, system prompt {result.system_prompt_tokens} tokens")
    print("turn  prompt  cached  computed  ttft_warm  ttft_cold  ttft_floor")
    for t in result.turns:
        print(f"{t.turn:>4}  {t.prompt_tokens:>6}  {t.cached_tokens:>6}  {t.computed_tokens:>8}  "
              f"{t.ttft_warm_s * 1e3:>7.1f}ms {t.ttft_cold_s * 1e3:>7.1f}ms {t.ttft_floor_s * 1e3:>8.1f}ms")
    print(f"ttft_warm_over_floor {result.ttft_warm_over_floor:.3f} (target <= 1.2)")
    print(f"ttft_cold_over_warm  {result.ttft_cold_over_warm:.2f}")
    print(f"bytes_per_cached_token {result.bytes_per_cached_token:.0f} "
          f"(theoretical {result.theoretical_bytes_per_token}, target <= 1.1x)")


_WORKLOAD_FIELDS = ("system_words", "turns", "user_words", "reply_tokens", "chats",
                    "system_prompts", "history", "clients", "chat_rounds", "batch_rounds")


def _add_vs_mlx_lm(sub) -> None:
    from cluster.bench.vs_mlx_lm import PRESETS, Workload

    d = Workload()
    v = sub.add_parser("vs-mlx-lm", help="orchard beside mlx_lm.server: chat TTFT, batch wall")
    v.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    v.add_argument("--blas-threads", type=int, default=1, help="BLAS threads of both servers")
    v.add_argument("--preset", choices=sorted(PRESETS),
                   help="a workload shape (short-chat: 16 chats x 3 turns, 100-250-token "
                        "prompts, 24-token replies); the options below override it")
    for name in _WORKLOAD_FIELDS:
        v.add_argument("--" + name.replace("_", "-"), type=int,
                       help=f"default {getattr(d, name)}")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.set_defaults(func=vs_mlx_lm)


def vs_mlx_lm(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from cluster.bench.vs_mlx_lm import Workload, bench_vs_mlx_lm
    from workers.model.default_model import ensure_default_model

    if args.blas_threads < 1:
        raise ValueError("--blas-threads must be >= 1")
    given = {name: getattr(args, name) for name in _WORKLOAD_FIELDS
             if getattr(args, name) is not None}
    w = Workload.of(args.preset, **given)
    r = bench_vs_mlx_lm(str(args.model or ensure_default_model()), w, args.blas_threads)
    if args.json:
        print(json.dumps(r.as_json(), indent=2))
        return 0
    print(f"model {r.model}, {r.blas_threads} BLAS thread(s); orchard: {r.orchard_side}")
    print("round  turn  ttft orchard  (its worker)  ttft mlx-lm  ratio")
    for t in r.turns:
        print(f"{t.round:>5}  {t.turn:>4}  {t.ttft_orchard_s * 1e3:>10.0f}ms "
              f"{t.ttft_orchard_worker_s * 1e3:>11.0f}ms {t.ttft_mlx_lm_s * 1e3:>10.0f}ms "
              f"{t.ratio:>6.2f}")
    print(f"cold TTFT ratio   {r.cold_ttft_ratio:.2f} (target <= {r.targets['cold_ttft']}, "
          f"median of first turns)")
    print(f"warm TTFT ratio   {r.warm_ttft_ratio:.2f} (target <= {r.targets['warm_ttft']}, "
          f"median of turns 2..)")
    print(f"batch of {w.chats} chats, {w.chats * (w.history + 1)} requests: orchard {r.batch_wall_orchard_s:.1f}s, mlx-lm "
          f"{r.batch_wall_mlx_lm_s:.1f}s ({w.clients} clients), ratio {r.batch_wall_ratio:.2f} "
          f"(target <= {r.targets['batch_wall']})")
    b = r.batch_breakdown
    print(f"orchard's batch: {b.in_flight_mean:.1f} requests in flight on average; prompts "
          f"{b.prompt_tokens} tokens, {b.cached_tokens} read from the store; "
          f"{b.generated_tokens} generated; per request TTFT {b.ttft_s_mean:.2f}s, decode "
          f"{b.decode_s_mean:.2f}s, TPOT {b.tpot_s_mean * 1e3:.0f}ms")
    return 0


def disk(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.lab.disk_bench import bench_disk
    from workers.model.default_model import ensure_default_model

    if args.prefix_tokens < 32 or args.trials < 1 or args.decode_pairs < 1:
        raise ValueError("--prefix-tokens must be >= 32, --trials and --decode-pairs >= 1")
    r = bench_disk(args.model or ensure_default_model(), args.prefix_tokens, args.trials,
                   decode_pairs=args.decode_pairs,
                   progress=lambda line: print(f"bench disk: {line}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(r.as_json(), indent=2))
        return 0
    print(f"model {r.model}, prefix {r.prefix_tokens} tokens, {r.bytes_per_token} B/token")
    print(f"ttft recomputed {r.ttft_recomputed_s * 1e3:.1f}ms  memory {r.ttft_memory_s * 1e3:.1f}ms"
          f"  disk {r.ttft_disk_s * 1e3:.1f}ms (disk tokens per trial {list(r.disk_tokens_per_trial)})")
    print(f"disk_over_recomputed {r.disk_over_recomputed:.3f} (target <= 0.3)")
    print(f"write {r.write_mb_s:.0f} MB/s, read {r.read_mb_s:.0f} MB/s ({r.read_mb:.0f} MB, "
          f"page cache dropped)")
    print(f"decode tpot alone {r.tpot_alone_s * 1e3:.2f}ms, with write-behind "
          f"{r.tpot_with_spill_s * 1e3:.2f}ms (median ratio {r.tpot_ratio:.3f}, target <= 1.10; "
          f"{r.spill_mb:.0f} MB written in {r.spill_write_s:.2f}s)")
    if r.disk_token_cost is None:
        print("router's disk cost: not measured (no trial read from disk); the default stands")
    else:
        print(f"router's disk cost {r.disk_token_cost:.4f} prefill tokens per disk token "
              f"(the tier's lookups read at {r.tier_read_mb_s:.0f} MB/s, prefill "
              f"{r.prefill_tokens_s:.1f} tokens/s)")
    return 0


def outputs(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.lab.outputs_bench import run_outputs_bench
    from workers.model.default_model import ensure_default_model

    if args.requests < 1 or args.max_tokens < 1 or args.rounds < 1:
        raise ValueError("--requests, --max-tokens and --rounds must each be >= 1")
    result = run_outputs_bench(args.model or ensure_default_model(), args.requests,
                               args.max_tokens, args.rounds, vs_mlx_lm=args.vs_mlx_lm)
    figures = {**result.as_json(), "load_average": list(os.getloadavg())}
    if args.json:
        print(json.dumps(figures))
        return 0
    for key, value in figures.items():
        print(f"{key:<26} {value}")
    return 0

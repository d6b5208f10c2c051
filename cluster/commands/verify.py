"""``orchard verify --model DIR [--json]``: cached and uncached generation must agree.

Exits 0 when every case agrees (identical greedy tokens, log-probabilities within 1e-4),
1 when any case differs, 2 when the model cannot be checked (missing directory, unsupported
architecture).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="check that prefix reuse gives the same tokens and logits as recomputing")
    p.add_argument("--model", required=True, help="a local mlx-lm model directory")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cached block")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0, help="seed for the random test prompts")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.verify import verify_model

    if args.block_size <= 0 or args.max_tokens <= 0:
        raise ValueError("--block-size and --max-tokens must be positive")
    report = verify_model(args.model, args.block_size, args.max_tokens, args.seed)
    if args.json:
        print(json.dumps({
            "model": report.model, "passed": report.passed, "tolerance": report.tolerance,
            "greedy_token_agreement": report.agreement,
            "max_abs_logit_diff": report.max_abs_logit_diff,
            "cases": [dict(asdict(c), passed=c.passed) for c in report.cases]}, indent=2))
    else:
        for c in report.cases:
            mark = "ok  " if c.passed else "FAIL"
            print(f"{mark} {c.name:<40} tokens {c.tokens_equal}/{c.tokens_compared}  "
                  f"max|dlogit| {c.max_abs_logit_diff:.2e}  cached {c.cached_tokens}")
        print(f"greedy-token agreement {report.agreement:.4f}, largest |logit diff| "
              f"{report.max_abs_logit_diff:.2e} (tolerance {report.tolerance:g}): "
              f"{'PASS' if report.passed else 'FAIL'}")
    return 0 if report.passed else 1

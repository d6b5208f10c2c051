"""``orchard verify [--model DIR] [--json]``: cached and uncached generation must agree (on
the embedded default model unless ``--model`` names another).

Then one line per store setting: the disk tier (must agree exactly), and 8-bit and 4-bit K/V
(greedy agreement, largest logit difference and bytes per cached token, measured: quantized
K/V is not expected to be exact). ``--no-tiers`` skips them.

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
    p.add_argument("--model", help="a local mlx-lm model directory (default: the embedded model)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cached block")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0, help="seed for the random test prompts")
    p.add_argument("--no-tiers", action="store_true",
                   help="skip the disk tier and quantized K/V settings")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model
    from workers.lab.verify import verify_model

    if args.block_size <= 0 or args.max_tokens <= 0:
        raise ValueError("--block-size and --max-tokens must be positive")
    report = verify_model(str(args.model or ensure_default_model()), args.block_size, args.max_tokens, args.seed,
                          tiers=not args.no_tiers)
    if args.json:
        print(json.dumps({
            "model": report.model, "passed": report.passed, "tolerance": report.tolerance,
            "greedy_token_agreement": report.agreement,
            "max_abs_logit_diff": report.max_abs_logit_diff,
            "cases": [dict(asdict(c), passed=c.passed) for c in report.cases],
            "settings": [dict(asdict(s), greedy_token_agreement=s.agreement, passed=s.passed)
                         for s in report.settings]}, indent=2))
    else:
        for c in report.cases:
            mark = "ok  " if c.passed else "FAIL"
            print(f"{mark} {c.name:<40} tokens {c.tokens_equal}/{c.tokens_compared}  "
                  f"max|dlogit| {c.max_abs_logit_diff:.2e}  cached {c.cached_tokens}"
                  + "".join(f"  {note}" for note in c.notes))
        for s in report.settings:
            if s.skipped:
                print(f"skip {s.setting:<40} {s.skipped}")
                continue
            mark = ("ok  " if s.passed else "FAIL") if s.exact else "meas"
            print(f"{mark} {s.setting:<40} tokens {s.tokens_equal}/{s.tokens_compared}  "
                  f"max|dlogit| {s.max_abs_logit_diff:.2e}  agreement {s.agreement:.4f}  "
                  f"{s.bytes_per_token} B/token ({s.bytes_ratio:.3f}x)")
        print(f"greedy-token agreement {report.agreement:.4f}, largest |logit diff| "
              f"{report.max_abs_logit_diff:.2e} (tolerance {report.tolerance:g}): "
              f"{'PASS' if report.passed else 'FAIL'}")
    return 0 if report.passed else 1

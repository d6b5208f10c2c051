"""``orchard chat``: a multi-turn chat on one engine, turn by turn cached vs computed tokens.

(``orchard demo`` runs the whole cluster; this is the single-engine view of the same reuse.)

The embedded default model (SmolLM2-135M-Instruct) is imported on first use. Every turn sends the whole conversation
again; the table shows how much of it the prefix store supplied and what that did to TTFT.
"""
from __future__ import annotations

import argparse

SYSTEM = ("You are orchard's demo assistant. orchard serves language models from a cluster of "
          "Apple Silicon Macs: a router hashes each prompt's token blocks and sends it to the "
          "worker most likely to hold its cached prefix, and every worker keeps a prefix store "
          "of key and value tensors with least-recently-used eviction and a time to live. ")
QUESTIONS = (
    "What is a prefix cache?",
    "Why does the router hash blocks of tokens instead of whole prompts?",
    "What happens when a cached block expires?",
    "How are tenants kept apart?",
    "What does the effective input multiplier measure?",
    "Summarise the conversation so far.",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="multi-turn chat on one engine showing prefix reuse "
                                           "turn by turn")
    p.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    p.add_argument("--turns", type=int, default=len(QUESTIONS))
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.engine.chat import ChatSession
    from workers.engine.engine import Engine
    from workers.model.default_model import ensure_default_model
    from workers.messages import SamplingParams

    if not 1 <= args.turns <= len(QUESTIONS) or args.max_tokens < 1:
        raise ValueError(f"--turns must be 1..{len(QUESTIONS)} and --max-tokens positive")
    model = args.model or ensure_default_model()
    engine = Engine.open(model)
    print(f"orchard chat: model {engine.model_id} ({model})")
    chat = ChatSession(engine, "demo", SYSTEM * 6, SamplingParams(max_tokens=args.max_tokens))
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'computed':>9} {'written':>8} "
          f"{'TTFT':>9}  outcome")
    for turn, question in enumerate(QUESTIONS[: args.turns], start=1):
        r = chat.say(question)
        print(f"{turn:>4} {r.input_tokens:>7} {r.cached_tokens:>7} {r.computed_tokens:>9} "
              f"{r.written_tokens:>8} {r.ttft_s * 1e3:>7.1f}ms  {r.lookup.outcome.value} "
              f"({r.lookup.line()})")
    s = engine.store_stats()
    print(f"store: {s.ledger.blocks} blocks, {s.tensor_bytes / 2**20:.1f} MiB "
          f"({s.tensor_bytes // max(1, s.ledger.tokens)} bytes per cached token)")
    return 0

"""Write an OpenAI Batch JSONL of multi-turn chats that share system prompts.

    python examples/make_batch.py --conversations 8 --turns 3 --system-prompts 2 > batch.jsonl

Conversation ``c`` uses system prompt ``c % system_prompts``; its turn ``t`` carries the whole
history so far (earlier user messages and the assistant's recorded replies), the way a chat log
is replayed as a batch. So turn ``t + 1`` extends turn ``t``'s prompt, and conversations with the
same system prompt share its blocks: what orchard's prefix cache and router are built for.
Deterministic: the same arguments always write the same file.
"""
from __future__ import annotations

import argparse
import json
import sys

SYSTEM_PROMPTS = (
    "You are Orchard's support assistant for a fruit-logistics company. You answer questions "
    "about deliveries, cold-chain storage, customs paperwork and invoices. Be brief and exact; "
    "when a question needs an order number, ask for it. Never invent tracking data. "
    "Our depots are in Valencia, Rotterdam and Gdansk; deliveries leave daily at 06:00 UTC.",
    "You are a careful code reviewer. For each snippet, point out bugs first, then risky "
    "patterns, then style. Quote the line you are talking about. Prefer small, concrete "
    "suggestions over rewrites, and say when something is fine as it is.",
    "You are a patient maths tutor for secondary-school students. Explain each step, check "
    "the student's reasoning before giving an answer, and end with one practice question of "
    "the same kind. Use plain words and avoid notation the student has not used.",
    "You translate between English and Spanish for a hospital front desk. Keep medical terms "
    "exact, keep the register polite, and flag anything ambiguous instead of guessing. "
    "Return only the translation unless you flag an ambiguity.",
)
TOPICS = ("a late delivery", "a damaged pallet", "an invoice total", "a customs form",
          "a temperature alarm", "a new order", "a return", "a depot change",
          "a duplicate charge", "a missing signature")


def user_message(conversation: int, turn: int) -> str:
    topic = TOPICS[(conversation + turn) % len(TOPICS)]
    return (f"Conversation {conversation}, question {turn + 1}: I need help with {topic}. "
            f"What should I check first, and what do you need from me?")


def assistant_reply(conversation: int, turn: int) -> str:
    return (f"For question {turn + 1} of conversation {conversation}: first check the details "
            f"you already have, then send me the reference number so I can look it up.")


def batch_lines(conversations: int, turns: int, system_prompts: int, max_tokens: int,
                model: str) -> list[str]:
    if not 1 <= system_prompts <= len(SYSTEM_PROMPTS):
        raise ValueError(f"--system-prompts must be in 1..{len(SYSTEM_PROMPTS)}")
    lines = []
    for turn in range(turns):                       # turn-major: like real traffic over time
        for c in range(conversations):
            messages = [{"role": "system", "content": SYSTEM_PROMPTS[c % system_prompts]}]
            for t in range(turn):
                messages += [{"role": "user", "content": user_message(c, t)},
                             {"role": "assistant", "content": assistant_reply(c, t)}]
            messages.append({"role": "user", "content": user_message(c, turn)})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                    "temperature": 0}
            lines.append(json.dumps({"custom_id": f"conv{c:02d}-turn{turn + 1:02d}",
                                     "method": "POST", "url": "/v1/chat/completions",
                                     "body": body}))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="default")
    args = parser.parse_args(argv)
    for line in batch_lines(args.conversations, args.turns, args.system_prompts,
                            args.max_tokens, args.model):
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a request's cache controls cost: ``orchard bench cache-controls``.

On one engine (the default model unless ``--model``), interleaved round by round so that load
on a shared machine hits every variant alike, the best round of each counting:

- ``warm_ttft_s``: a chat whose prompt the store holds (every full block reused);
- ``read_false_ttft_s``: the same prompt with ``cache: {read: false}`` (computed whole, the
  seeds' diagnosis step), and ``read_false_ttft_ratio`` over warm;
- ``cold_ttft_s`` and ``write_false_ttft_s``: a prompt never seen, stored as always, and with
  ``cache: {write: false}`` (nothing stored: what writing the blocks costs is the difference);
- ``validate_ms`` and ``diagnosis_validate_ms``: the frontend's validation and tokenizing of
  a chat of ``--messages`` messages, and the same with ``cache_diagnostics: true``, which
  renders the prompt up to each message to place the divergence (``diagnosis_validate_ratio``).
  Asking for a diagnosis also traces the request before it is answered; that is the
  observer's cost, measured by ``orchard bench telemetry``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, replace

from cluster.api.chat import ChatTokenizer
from cluster.api.incoming import CacheIn, MessageIn, Messages, RequestIn, SamplingIn
from cluster.api.validate import new_request
from cluster.backend.protocol import ModelInfo
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.messages import CacheControls, GenerateRequest, GenerateResult, SamplingParams

SYSTEM = ("You are the support assistant of a garden centre. Answer in two sentences, name "
          "the product, and say when to water it. ")


@dataclass(frozen=True, slots=True)
class CacheControlsBench:
    model: str
    prompt_tokens: int
    rounds: int
    warm_ttft_s: float
    read_false_ttft_s: float
    read_false_ttft_ratio: float
    cold_ttft_s: float
    write_false_ttft_s: float
    validate_ms: float
    diagnosis_validate_ms: float
    diagnosis_validate_ratio: float

    def as_json(self) -> dict:
        return asdict(self)


def _messages(n: int, words: int) -> list[dict[str, str]]:
    """A chat of ``n`` messages, the first a system prompt of about ``words`` words."""
    out = [{"role": "system", "content": (SYSTEM * (1 + words // len(SYSTEM.split())))}]
    for i in range(1, n):
        role = "user" if i % 2 else "assistant"
        out.append({"role": role, "content": f"Turn {i}: what about the fern by the door?"})
    return out


def _ttft(engine: Engine, request: GenerateRequest) -> float:
    (result,) = engine.generate([request])
    if not isinstance(result, GenerateResult):
        raise RuntimeError(f"request {request.request_id} failed: {result.error}")
    return result.ttft_s


def run_cache_controls_bench(model_dir, words: int = 400, messages: int = 8, rounds: int = 3
                             ) -> CacheControlsBench:
    engine = Engine.open(model_dir, EngineConfig(kept_bytes=0))  # the store's reuse alone
    ns = engine.namespace("bench")
    chat = _messages(messages, words)
    prompt = tuple(engine.render_chat(chat))
    sampling = SamplingParams(max_tokens=1)

    def request(rid: str, tokens, cache: CacheControls = CacheControls()) -> GenerateRequest:
        return GenerateRequest(rid, ns, tuple(tokens), sampling, cache=cache)

    _ttft(engine, request("warm-up", prompt))
    best: dict[str, float] = {}
    for r in range(rounds):
        cold = tuple(engine.render_chat([{"role": "system", "content": f"Round {r}. "}, *chat]))
        unseen = tuple(engine.render_chat([{"role": "system", "content": f"Unseen {r}. "},
                                           *chat]))
        figures = {
            "warm": _ttft(engine, request(f"warm{r}", prompt)),
            "read_false": _ttft(engine, request(f"read{r}", prompt, CacheControls(read=False))),
            "cold": _ttft(engine, request(f"cold{r}", cold)),
            "write_false": _ttft(engine, request(f"write{r}", unseen,
                                                 CacheControls(write=False))),
        }
        for key, value in figures.items():
            best[key] = min(best.get(key, value), value)
    engine.close()
    plain, diagnosed = _validation_ms(model_dir, chat, rounds)
    return CacheControlsBench(
        str(model_dir), len(prompt), rounds, round(best["warm"], 4),
        round(best["read_false"], 4), round(best["read_false"] / best["warm"], 3),
        round(best["cold"], 4), round(best["write_false"], 4), round(plain, 3),
        round(diagnosed, 3), round(diagnosed / plain, 3))


def _validation_ms(model_dir, chat: list[dict[str, str]], rounds: int) -> tuple[float, float]:
    """(plain, with a diagnosis): the best of ``rounds`` validations of ``chat``, in ms."""
    tokenizer = ChatTokenizer(model_dir)
    try:
        model = ModelInfo("bench", "", vocab_size=1 << 20, max_context=1 << 20, model_dir="",
                          block_size=16, kv_bytes_per_token=1)
        plain = RequestIn("c", Messages(tuple(MessageIn(m["role"], m["content"])
                                              for m in chat)), SamplingIn(max_tokens=1))
        diagnosed = replace(plain, cache=CacheIn(diagnostics=True))
        times: dict[str, float] = {}
        for _ in range(rounds):
            for key, request in (("plain", plain), ("diagnosed", diagnosed)):
                start = time.perf_counter()
                new_request(request, "body", model, tokenizer.render)
                took = (time.perf_counter() - start) * 1e3
                times[key] = min(times.get(key, took), took)
        return times["plain"], times["diagnosed"]
    finally:
        tokenizer.close()


def register_bench(sub) -> None:
    b = sub.add_parser("cache-controls", help="what read: false, write: false and a cache "
                                              "diagnosis cost on one engine")
    b.add_argument("--model", help="mlx-lm model directory (default: the embedded model)")
    b.add_argument("--system-words", type=int, default=400)
    b.add_argument("--messages", type=int, default=8)
    b.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best counts")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    from workers.model.default_model import ensure_default_model

    if args.system_words < 1 or args.messages < 1 or args.rounds < 1:
        raise ValueError("--system-words, --messages and --rounds must each be >= 1")
    result = run_cache_controls_bench(args.model or ensure_default_model(), args.system_words,
                                      args.messages, args.rounds)
    figures = {**result.as_json(), "load_average": list(os.getloadavg())}
    if args.json:
        print(json.dumps(figures))
        return 0
    for key, value in figures.items():
        print(f"{key:<26} {value}")
    return 0

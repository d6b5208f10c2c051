"""``orchard bench vs-mlx-lm``: orchard's worker side by side with ``mlx_lm.server``.

Both serve the same model directory on this machine, loopback only, with OpenBLAS loaded the
same way (``workers.blas``, before mlx) and the same number of BLAS threads
(``OPENBLAS_NUM_THREADS``, ``--blas-threads``, inherited by every process either side starts).
The orchard side is a 1-worker Ray cluster (``orchard up --workers 1 --detach`` in a fresh
run directory, ``cluster.bench.api.ray_cluster``): the frontend (gRPC, the job store,
routing) hands each request over Ray to the worker actor's engine, as a cluster of one Mac
serves it.

1. **Chat.** One multi-turn chat: a system prompt of ``system_words`` words, then
   ``turns`` user messages of ``user_words`` words, each answered with ``reply_tokens`` greedy
   tokens. Every turn goes to both servers, interleaved (the first to be asked alternates from
   turn to turn), as a streamed request; TTFT is taken at the client, request sent -> first
   token received. Both histories carry orchard's reply, so both prompts are the same tokens.
   Turn 1 is cold (a system prompt neither has seen), turns 2.. are warm. The chat runs
   ``chat_rounds`` times, each with a new system prompt and messages; the ratios are medians of
   the per-turn ratios (first turns for cold, the others for warm).
2. **Batch.** ``chats`` multi-turn chats sharing ``system_prompts`` system prompts, each of
   ``history`` + 1 turns, every turn a request: a turn's prompt is the chat so far (the
   earlier questions with fixed replies) and its next question, so turn k + 1 extends turn
   k's prompt. The requests go turn by turn across the chats (every chat's first turn, then
   every chat's second, ...), as a batch over logged conversations runs. orchard gets them as
   one job, run at its configured concurrency (``[limits] max_concurrent`` and ``[engine]
   max_batch``, 32 by default: a batch job fills the decode batch); mlx-lm as the same
   requests, in the same order, from ``clients`` concurrent clients (8). orchard's store holds every chat's earlier turns; mlx-lm keeps 10 whole
   prompt caches, so by a chat's next turn its cache is gone and only the system prompt is
   found. The figure is the wall time from the first request sent to the last result
   received, best of ``batch_rounds``; the order of the two sides alternates from round to
   round, and each round's chats open with a question of their own, so no round finds
   another round's turns.

Ratios are orchard over mlx-lm (below 1: orchard is faster). Targets: warm TTFT <= 0.9,
cold TTFT <= 1.05, batch wall time <= 0.8.

``PRESETS["short-chat"]`` is the decode-bound shape: 16 chats x 3 turns on 2 system prompts,
prompts of about 100 to 250 tokens, 24-token replies. Where orchard's batch time goes is read
from the job's results (``BatchBreakdown``): the requests in flight on average (the engine's
rows per step), the prompt tokens computed and read from the store, the time to first tokens
and the decode time.
"""
from __future__ import annotations

import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from cluster.api.client import Client, chat_request

TARGETS = {"warm_ttft": 0.9, "cold_ttft": 1.05, "batch_wall": 0.8}
_WORDS = ("orchard apple cache block prefix router token worker cluster batch tenant model "
          "latency memory store evict expire replay trace forecast measured input output "
          "system prompt reply question answer policy river mountain garden").split()


@dataclass(frozen=True, slots=True)
class Workload:
    system_words: int = 700   # about 1,000 tokens with SmolLM2's tokenizer
    turns: int = 8
    user_words: int = 70      # about 100 new tokens a turn, the reply included
    reply_tokens: int = 24
    chats: int = 48
    system_prompts: int = 2
    history: int = 2          # earlier exchanges in each batch chat: history + 1 requests
    clients: int = 8
    chat_rounds: int = 1
    batch_rounds: int = 1
    seed: int = 0

    @classmethod
    def of(cls, preset: str | None, **given: int) -> Workload:
        """A preset's shape (``PRESETS``; None: the defaults), ``given`` fields over it."""
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(sorted(PRESETS))}, "
                             f"got {preset!r}")
        return cls(**{**PRESETS.get(preset or "", {}), **given})

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and value < (0 if name == "history" else 1):
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


PRESETS = {"short-chat": dict(system_words=60, turns=3, user_words=20, reply_tokens=24,
                              chats=16, system_prompts=2, history=2)}


@dataclass(frozen=True, slots=True)
class BatchBreakdown:
    """Where an orchard batch's wall time went, from its results."""

    wall_s: float
    requests: int
    in_flight_mean: float     # the requests' worker time summed over the wall: rows per step
    prompt_tokens: int
    cached_tokens: int        # read from the store, not computed
    generated_tokens: int
    ttft_s_mean: float        # at the worker: admission wait + prefill
    decode_s_mean: float      # at the worker: first token -> last
    tpot_s_mean: float


@dataclass(frozen=True, slots=True)
class Turn:
    round: int
    turn: int
    ttft_orchard_s: float
    ttft_mlx_lm_s: float
    ttft_orchard_worker_s: float  # the engine's own TTFT (request received -> first token)

    @property
    def ratio(self) -> float:
        return self.ttft_orchard_s / self.ttft_mlx_lm_s


@dataclass(frozen=True, slots=True)
class VsMlxLm:
    model: str
    blas_threads: int
    orchard_side: str
    turns: tuple[Turn, ...]
    cold_ttft_ratio: float          # median over the rounds' first turns of orchard / mlx-lm
    warm_ttft_ratio: float          # median over every later turn of orchard / mlx-lm
    batch_wall_orchard_s: float     # best of the rounds
    batch_wall_mlx_lm_s: float
    batch_wall_ratio: float
    batch_breakdown: BatchBreakdown  # orchard's best round
    targets: dict

    def as_json(self) -> dict:
        out = asdict(self)
        out["turns"] = [asdict(t) for t in self.turns]
        return out


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


# ---- mlx_lm.server -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlxLmServer:
    """``mlx_lm.server`` on loopback, with OpenBLAS loaded as orchard loads it."""

    _LAUNCH = ("import sys, workers.blas as b; b.ensure_openblas(); "
               "from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()")

    def __init__(self, model_dir: str, max_tokens: int, log: Path) -> None:
        self.port = _free_port()
        self._log = log
        cmd = [sys.executable, "-c", self._LAUNCH, "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--max-tokens", str(max_tokens), "--temp", "0"]
        self._proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                      cwd=Path(__file__).resolve().parents[2])

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError("mlx_lm.server exited: " + self._log.read_text()[-2000:])
            try:
                with urllib.request.urlopen(self._url("/v1/models"), timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise RuntimeError(f"mlx_lm.server did not answer within {timeout_s:.0f} s")

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def reply(self, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
        """One chat completion, not streamed, greedy, its body extended by ``extra``: the
        parsed reply (choices, usage)."""
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                           **(extra or {})}).encode()
        request = urllib.request.Request(self._url("/v1/chat/completions"), data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())

    def chat(self, messages: list[dict], max_tokens: int, stream: bool) -> tuple[float, str]:
        """(TTFT or total seconds, reply text) of one chat completion."""
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                           "stream": stream}).encode()
        request = urllib.request.Request(self._url("/v1/chat/completions"), data=body,
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        first, text = 0.0, []
        with urllib.request.urlopen(request, timeout=3600) as response:
            if not stream:
                reply = json.loads(response.read())
                return time.perf_counter() - start, reply["choices"][0]["message"]["content"]
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter() - start
                    text.append(delta)
        return first, "".join(text)


# ---- orchard -------------------------------------------------------------------------------

def _orchard_ttft(client: Client, messages: list[dict], max_tokens: int, rid: str
                  ) -> tuple[float, str, float]:
    """(TTFT at the client, reply text, the worker's own TTFT) of one streamed request."""
    start = time.perf_counter()
    first, text, worker = 0.0, "", 0.0
    for event in client.generate(chat_request(rid, messages, max_tokens)):
        if event.HasField("delta") and event.delta.text and not first:
            first = time.perf_counter() - start
        if event.HasField("result"):
            if not event.result.ok:
                raise RuntimeError(f"orchard failed {rid}: {event.result.error_message}")
            text, worker = event.result.text, event.result.ttft_s
    return first, text, worker


def _orchard_batch(client: Client, chats: list[list[dict]], max_tokens: int, tag: str
                   ) -> BatchBreakdown:
    start = time.perf_counter()
    job = client.submit([chat_request(f"{tag}-{i}", m, max_tokens) for i, m in enumerate(chats)])
    job = client.wait(job.job_id)
    wall = time.perf_counter() - start
    if job.state != "succeeded" or job.failed:
        raise RuntimeError(f"orchard job {job.job_id} ended {job.state} with {job.failed} failed")
    results = list(client.results(job.job_id))
    n = len(results)
    return BatchBreakdown(
        wall_s=wall, requests=n, in_flight_mean=sum(r.worker_s for r in results) / wall,
        prompt_tokens=sum(r.usage.prompt_tokens for r in results),
        cached_tokens=sum(r.usage.cached_tokens for r in results),
        generated_tokens=sum(r.usage.completion_tokens for r in results),
        ttft_s_mean=sum(r.ttft_s for r in results) / n,
        decode_s_mean=sum(r.worker_s - r.ttft_s for r in results) / n,
        tpot_s_mean=sum(r.tpot_s for r in results) / n)


def _mlx_batch(server: MlxLmServer, chats: list[list[dict]], max_tokens: int, clients: int
               ) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda m: server.chat(m, max_tokens, stream=False), chats))
    return time.perf_counter() - start


# ---- the workload --------------------------------------------------------------------------

def _system(rng: random.Random, w: Workload) -> str:
    return "You answer questions about orchards. Notes: " + _text(rng, w.system_words)


def batch_requests(w: Workload, round_: int) -> list[list[dict]]:
    """Every turn of every batch chat as a request's messages, turn by turn across the chats.

    The system prompts and messages are the same in every round but for the first question,
    which names the round: the system prompts stay shared across rounds, the turns do not.
    """
    rng = random.Random(w.seed + 1)
    systems = [_system(rng, w) for _ in range(w.system_prompts)]
    chats = []
    for i in range(w.chats):
        messages = [{"role": "system", "content": systems[i % w.system_prompts]}]
        turns = []
        for k in range(w.history + 1):
            question = _text(rng, w.user_words)
            messages = messages + [{"role": "user", "content":
                                    f"round {round_}: {question}" if k == 0 else question}]
            turns.append(messages)
            messages = messages + [{"role": "assistant",
                                    "content": _text(rng, w.reply_tokens // 2)}]
        chats.append(turns)
    return [chat[k] for k in range(w.history + 1) for chat in chats]


def run_chat(client: Client, server: MlxLmServer, w: Workload, round_: int) -> list[Turn]:
    """One chat turn by turn, interleaved; both histories carry orchard's replies."""
    rng = random.Random(w.seed * 1000 + round_)
    messages = [{"role": "system", "content": _system(rng, w)}]
    turns = []
    for turn in range(1, w.turns + 1):
        messages.append({"role": "user", "content": _text(rng, w.user_words)})
        asked = list(messages)
        rid = f"c{round_}-{turn}"
        if (turn + round_) % 2:
            orchard, reply, worker = _orchard_ttft(client, asked, w.reply_tokens, rid)
            mlx, _ = server.chat(asked, w.reply_tokens, stream=True)
        else:
            mlx, _ = server.chat(asked, w.reply_tokens, stream=True)
            orchard, reply, worker = _orchard_ttft(client, asked, w.reply_tokens, rid)
        turns.append(Turn(round_, turn, orchard, mlx, worker))
        _progress(f"chat round {round_} turn {turn}: orchard {orchard:.2f} s, "
                  f"mlx_lm.server {mlx:.2f} s")
        messages.append({"role": "assistant", "content": reply})
    return turns


def run_batch(client: Client, server: MlxLmServer, w: Workload
              ) -> tuple[BatchBreakdown, float]:
    """Best round of each side (orchard's with its breakdown), the first side alternating."""
    orchard: list[BatchBreakdown] = []
    mlx: list[float] = []
    for k in range(w.batch_rounds):
        tagged = batch_requests(w, k)
        if k % 2 == 0:
            orchard.append(_orchard_batch(client, tagged, w.reply_tokens, f"batch{k}"))
            mlx.append(_mlx_batch(server, tagged, w.reply_tokens, w.clients))
        else:
            mlx.append(_mlx_batch(server, tagged, w.reply_tokens, w.clients))
            orchard.append(_orchard_batch(client, tagged, w.reply_tokens, f"batch{k}"))
        _progress(f"batch round {k}: orchard {orchard[-1].wall_s:.1f} s, "
                  f"mlx_lm.server {mlx[-1]:.1f} s")
    return min(orchard, key=lambda b: b.wall_s), min(mlx)


def _progress(line: str) -> None:
    """A line on stderr as each measurement ends: a full run takes many minutes."""
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _mlx_server(model_dir: str, w: Workload, log_dir: Path) -> Iterator[MlxLmServer]:
    server = MlxLmServer(model_dir, w.reply_tokens, log_dir / "mlx_lm_server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def bench_vs_mlx_lm(model_dir: str, w: Workload, blas_threads: int) -> VsMlxLm:
    from cluster.bench.api import ray_cluster
    from cluster.config import Limits

    os.environ["OPENBLAS_NUM_THREADS"] = str(blas_threads)  # inherited by both servers
    warmup = [{"role": "user", "content": "warm up"}]
    with tempfile.TemporaryDirectory(prefix="orchard-vs-mlx-") as tmp, \
            _mlx_server(model_dir, w, Path(tmp)) as server, \
            ray_cluster(model_dir, telemetry="none", max_concurrent=Limits().max_concurrent
                        ) as client:
        _orchard_ttft(client, warmup, 2, "warmup")
        server.chat(warmup, 2, stream=True)
        turns = [t for k in range(w.chat_rounds) for t in run_chat(client, server, w, k)]
        batch_orchard, batch_mlx = run_batch(client, server, w)
    cold = [t.ratio for t in turns if t.turn == 1]
    warm = [t.ratio for t in turns if t.turn > 1] or cold
    return VsMlxLm(
        model=model_dir, blas_threads=blas_threads,
        orchard_side="1-worker Ray cluster (orchard up)", turns=tuple(turns),
        cold_ttft_ratio=statistics.median(cold), warm_ttft_ratio=statistics.median(warm),
        batch_wall_orchard_s=batch_orchard.wall_s, batch_wall_mlx_lm_s=batch_mlx,
        batch_wall_ratio=batch_orchard.wall_s / batch_mlx, batch_breakdown=batch_orchard,
        targets=TARGETS)

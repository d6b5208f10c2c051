"""The HTTP API's side of ``orchard bench api``: path overhead and streamed TTFT, HTTP vs gRPC.

Both measured with the clients people use: the ``openai`` SDK for HTTP (raw responses, so
that the SDK's model parsing is not counted) and ``cluster.api.client`` for gRPC, against the
same frontend, one request at a time, distinct prompts (every request routed and hashed like
new traffic):

- ``http_chat``: a non-streamed ``POST /v1/chat/completions`` with ``max_tokens=1``;
  overhead = wall time at the client - the worker's own time (the ``orchard-worker-ms``
  header, the same ``worker_s`` the gRPC figures subtract);
- TTFT: call -> first generated text at the client, streamed, ``max_tokens=8``, over gRPC
  ``Generate`` (first ``delta``) and over HTTP (first chunk with content), alternating.
"""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass

import httpx2  # the openai SDK's HTTP stack
import openai

from cluster.api.client import Client, chat_request
from router.kv.stats import percentile


@dataclass(frozen=True, slots=True)
class TtftFigures:
    path: str
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float


def _messages(i: int, prompt_words: int, tag: str) -> list[dict]:
    text = f"{tag} request {i}: " + " ".join(f"word{j}" for j in range(prompt_words))
    return [{"role": "user", "content": text}]


def sdk(http_address: str, api_key: str, nodelay: bool = True) -> openai.OpenAI:
    """The SDK with ``TCP_NODELAY`` on its sockets, as gRPC sets on its own.

    The SDK's HTTP stack writes a POST's headers and body in two sends; without
    ``TCP_NODELAY`` the body can wait for the server to acknowledge the headers, which Linux
    delays by up to 40 ms (docs/benchmarks.md has both clients measured).
    """
    if not nodelay:
        return openai.OpenAI(base_url=f"{http_address}/v1", api_key=api_key, max_retries=0)
    transport = httpx2.HTTPTransport(
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    return openai.OpenAI(base_url=f"{http_address}/v1", api_key=api_key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(transport=transport))


def measure_http_chat(client: openai.OpenAI, model: str, n: int, prompt_words: int,
                      offset: int = 0) -> tuple[list[float], list[float]]:
    walls, workers = [], []
    for i in range(offset, offset + n):
        start = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=_messages(i, prompt_words, "http"), max_tokens=1,
            temperature=0)
        body = json.loads(raw.content)
        walls.append(time.perf_counter() - start)
        if body["usage"]["completion_tokens"] != 1:
            raise RuntimeError(f"request {i}: unexpected answer {body}")
        workers.append(float(raw.headers["orchard-worker-ms"]) / 1e3)
    return walls, workers


def _ttft_grpc(client: Client, messages: list[dict]) -> float:
    start = time.perf_counter()
    first = None
    for event in client.generate(chat_request("", messages, 8)):
        if first is None and event.WhichOneof("event") == "delta" and event.delta.text:
            first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the gRPC stream produced no text")
    return first


def _ttft_http(client: openai.OpenAI, model: str, messages: list[dict]) -> float:
    start = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                temperature=0, stream=True):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the HTTP stream produced no text")
    return first


def measure_ttft(grpc_client: Client, client: openai.OpenAI, model: str, n: int,
                 prompt_words: int) -> list[TtftFigures]:
    grpc_s, http_s = [], []
    for i in range(n):  # alternating, so that both see the same machine load
        grpc_s.append(_ttft_grpc(grpc_client, _messages(i, prompt_words, "ttft-grpc")))
        http_s.append(_ttft_http(client, model, _messages(i, prompt_words, "ttft-http")))
    return [TtftFigures(path, n, percentile(values, 0.5) * 1e3, percentile(values, 0.99) * 1e3)
            for path, values in (("grpc", grpc_s), ("http", http_s))]

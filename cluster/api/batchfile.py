"""The OpenAI Batch file formats, for ``orchard submit`` and ``orchard results``.

Input, one JSON object per line (blank lines are skipped)::

    {"custom_id": "conv1-turn1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 32, "temperature": 0}}

``max_completion_tokens`` is accepted for ``max_tokens`` (default ``DEFAULT_MAX_TOKENS``);
``top_p``, ``seed``, ``stop``, ``response_format``, ``logprobs`` and ``top_logprobs`` are
honoured; ``model`` is informational (a cluster serves one model); any other field is refused
as over HTTP (``cluster.api.openai_fields``: nothing is accepted and dropped), and so are
streaming and tools (a line's answer is a line of text). Structural problems name the line here
(``line_shape``; the server also compiles each JSON schema when it accepts a file, so an
uncompilable one names its line and path); field values that need the model (the prompt's
length against the context) are checked when a request is dispatched, and become a failed
result.

Both sides read lines here. The server: ``line_shape`` as it accepts a file, ``request_of``
(the edges' typed ``RequestIn``, ``cluster.api.incoming``) as it dispatches a line. The client
(``orchard submit``): ``parse_batch``, the file as orchard.v1 requests for ``SubmitJob``
(``cluster.api.convert.request_to_pb``); ``line_of`` turns the server's ``requests[i]`` back
into the line.

Output, one line per request in submission order, as OpenAI writes it, with
``usage.prompt_tokens_details.cached_tokens`` and, when asked, ``choices[].logprobs``; failed
requests carry ``error`` instead of ``response``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable

from google.protobuf import json_format

from cluster.api import cache_fields, incoming, json_input, openai_fields, validate
from cluster.api.convert import request_to_pb
from cluster.api.openai_logprobs import TokenScore, chat_logprobs
from proto.orchard.v1 import orchard_pb2 as pb

URL = "/v1/chat/completions"
DEFAULT_MAX_TOKENS = 128
_SAMPLING_KEYS = ("temperature", "top_p")
INT32_MAX = 2**31 - 1   # max_tokens is an int32 on the wire
SEED_LIMIT = 2**64      # seed is a uint64


@dataclass(frozen=True, slots=True)
class Batch:
    requests: list[pb.Request]
    lines: list[int]       # 1-based line number of each request

    def line_of(self, message: str) -> str:
        """Rewrite a server message's leading ``requests[i]`` as ``line N``."""
        match = re.match(r"requests\[(\d+)\]\.?", message)
        if not match or int(match.group(1)) >= len(self.lines):
            return message
        rest = message[match.end():]
        return f"line {self.lines[int(match.group(1))]}: {rest}"


def _bad(name: str, lineno: int, what: str) -> ValueError:
    return ValueError(f"{name}:{lineno}: {what}")


def _sampling(body: dict, name: str, lineno: int) -> dict:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _bad(name, lineno, f"body.max_tokens must be an integer, got {max_tokens!r}")
    if not 1 <= max_tokens <= INT32_MAX:
        raise _bad(name, lineno, f"body.max_tokens must be between 1 and {INT32_MAX}, got "
                   f"{max_tokens}")
    params: dict = {"max_tokens": max_tokens}
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
            raise _bad(name, lineno, f"body.seed must be an integer from 0 to {SEED_LIMIT - 1}, "
                       f"got {seed!r}")
        params["seed"] = seed
    for key in _SAMPLING_KEYS:
        if key in body and body[key] is not None:
            value = body[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad(name, lineno, f"body.{key} must be a number, got {value!r}")
            params[key] = value
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad(name, lineno, "body.stop must be a string or a list of strings")
        params["stop"] = stops
    return params


def line_shape(text: str | bytes, name: str, lineno: int) -> dict:
    """One input line parsed and its shape checked (no tokenizing): the line as a dict, or a
    ``ValueError`` naming ``name:lineno``. What acceptance does per line, and all it does."""
    try:
        # decoded here: json.loads would guess UTF-16 or UTF-32 from the first bytes
        line = json_input.loads(text.decode() if isinstance(text, bytes) else text)
    except json_input.JsonInputError as exc:  # not JSON, too deep, a lone surrogate
        raise _bad(name, lineno, str(exc)) from None
    except UnicodeDecodeError as exc:
        raise _bad(name, lineno, f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                   f"column {exc.start + 1})") from None
    if not isinstance(line, dict):
        raise _bad(name, lineno, "each line must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _bad(name, lineno, "custom_id must be a non-empty string")
    if line.get("method", "POST") != "POST":
        raise _bad(name, lineno, f"method must be POST, got {line.get('method')!r}")
    if line.get("url", URL) != URL:
        raise _bad(name, lineno, f"url must be {URL}, got {line.get('url')!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise _bad(name, lineno, "body must be an object with messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise _bad(name, lineno, "body.messages must be a list of {role, content} objects")
    _sampling(body, name, lineno)
    try:
        openai_fields.check_fields(body, URL)
        openai_fields.check_batch_body(body)
        openai_fields.check_message_keys(messages)
        openai_fields.logprobs_of(body, URL)
        validate.format_of(body.get("response_format"), "response_format")  # compiled later
        _cache_shape(body, messages)
    except validate.FieldError as exc:
        raise _bad(name, lineno, f"body.{exc}") from None
    return line


def _cache_shape(body: dict, messages: list[dict]) -> None:
    """The cache controls' shape: what protobuf must carry (the rest is checked at dispatch)."""
    openai_fields.cache_of(body)
    if body.get("cache_control") is not None:
        cache_fields.control_ttl(body["cache_control"], "cache_control")
    for i, message in enumerate(messages):
        if message.get("cache_control") is not None:
            cache_fields.control_ttl(message["cache_control"], f"messages[{i}].cache_control")


def request_of(line: dict, name: str = "input", lineno: int = 0) -> incoming.RequestIn:
    """The request of a line that passed ``line_shape``."""
    body = line["body"]
    logprobs, top = openai_fields.logprobs_of(body, URL)
    try:
        return incoming.RequestIn(line["custom_id"], incoming.messages_of(body["messages"]),
                                  incoming.sampling(**_sampling(body, name, lineno)),
                                  response_format=body.get("response_format"),
                                  logprobs=logprobs, top_logprobs=top,
                                  cache=openai_fields.cache_of(body))
    except (TypeError, ValueError, OverflowError) as exc:
        # a value the request's fields cannot hold (line_shape names the common ones)
        raise _bad(name, lineno, f"body: {exc}") from None


def parse_line(text: str | bytes, name: str, lineno: int) -> pb.Request:
    request = request_of(line_shape(text, name, lineno), name, lineno)
    try:
        return request_to_pb(request)
    except (TypeError, ValueError, OverflowError, json_format.ParseError) as exc:
        # content protobuf cannot hold (the server checks the rest)
        raise _bad(name, lineno, f"body: {exc}") from None


def parse_batch(lines: Iterable[str | bytes], name: str = "input") -> Batch:
    """Parse an OpenAI Batch input file (lines of text, or of bytes as read in binary mode, so
    that a line that is not UTF-8 is named); ``ValueError`` naming ``name:line`` on bad
    input."""
    requests, numbers = [], []
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        requests.append(parse_line(text, name, lineno))
        numbers.append(lineno)
    if not requests:
        raise ValueError(f"{name}: no requests (the file is empty)")
    return Batch(requests, numbers)


def output_line(result: pb.Result, created_s: int) -> str:
    """One OpenAI Batch output line for ``result``."""
    line: dict = {"id": f"batch_req_{result.request_id}", "custom_id": result.custom_id}
    if not result.ok:
        line["response"] = None
        line["error"] = {"code": result.error_code, "message": result.error_message}
        return json.dumps(line)
    usage = result.usage
    logprobs = chat_logprobs([TokenScore(t.bytes, t.logprob, tuple(
        (a.bytes, a.logprob) for a in t.top_logprobs)) for t in result.logprobs])
    line["response"] = {
        "status_code": 200,
        "request_id": result.request_id,
        "body": {
            "id": f"chatcmpl-{result.request_id}",
            "object": "chat.completion",
            "created": created_s,
            "model": result.model,
            "choices": [{"index": 0, "finish_reason": result.finish_reason,
                         "logprobs": logprobs if result.logprobs else None,
                         "message": {"role": "assistant", "content": result.text}}],
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
                "cache_creation_input_tokens": usage.written_input_tokens,
                "cache_creation": cache_fields.cache_creation(usage.written_input_tokens,
                                                              usage.write_ttl_s),
            },
        },
    }
    line["error"] = None
    return json.dumps(line)


def output_lines(results: Iterable[pb.Result], created_s: int) -> list[str]:
    """Output lines in submission order."""
    return [output_line(r, created_s) for r in sorted(results, key=lambda r: r.index)]

"""OpenAI's request and response shapes, converted to and from orchard's own.

A request body (``/v1/chat/completions`` or ``/v1/completions``) is converted once, into the
typed ``RequestIn`` the gRPC servicer makes of its protobuf (``cluster.api.incoming``, which
says why that and not protobuf), and then takes the same validation as a gRPC call
(``cluster.api.validate``): the checks here are only about the JSON's shape (types, fields
orchard does not implement (``cluster.api.openai_fields``), numbers the gRPC fields could not
hold, so both edges accept the same requests), each raising a ``FieldError`` naming the body
field. A ``StoredResult`` becomes a completion object or a Batch output line (streamed chunks:
``cluster.api.openai_stream``), with its log-probabilities (``cluster.api.openai_logprobs``)
and, for a chat that offered tools, the calls cut out of its text (``Outputs``). Usage is
reported as OpenAI does, with the tokens read from a worker's prefix store as
``usage.prompt_tokens_details.cached_tokens``.

    chat body ──► RequestIn(Messages, sampling, response_format, logprobs, tools)
    completion body ──► RequestIn(Tokens, sampling, response_format, logprobs)
    StoredResult ──► chat.completion | text_completion | a Batch output line
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cluster.api import cache_fields, incoming, json_input, openai_fields, tool_calls
from cluster.api.batchfile import INT32_MAX, SEED_LIMIT
from cluster.api.incoming import RequestIn, SamplingIn, Tokens
from cluster.api.openai_fields import CHAT, COMPLETIONS
from cluster.api.openai_logprobs import (TokenBytes, chat_logprobs, completion_logprobs,
                                         scores_of)
from cluster.api.tool_calls import ToolFormat, ToolRequest
from cluster.api.validate import QUOTE_CHARS, FieldError
from cluster.jobs.store import StoredResult

ENDPOINTS = (CHAT, COMPLETIONS)
DEFAULT_MAX_TOKENS = {CHAT: 128, COMPLETIONS: 16}  # OpenAI's completions default is 16

TOKEN_LIMIT = 2**63  # token ids are int64 on the wire

Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class Streaming:
    stream: bool = False
    include_usage: bool = False


def _number(body: dict, key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(key, f"must be a number, got {_shown(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer past the largest float
        raise FieldError(key, f"must be a finite number, got {_shown(value)}") from None


def _integer(body: dict, key: str, high: int | None = None) -> int | None:
    """``body[key]``, an integer (of at most ``high``, what its protobuf field holds), or None
    when absent."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(key, f"must be an integer, got {_shown(value)}")
    if high is not None and value > high:
        raise FieldError(key, f"must be at most {high}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A value as an error quotes it: at most ``QUOTE_CHARS`` characters (a number may have
    thousands of digits)."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text)} characters)"


def sampling_params(body: dict, endpoint: str) -> SamplingIn:
    max_tokens = _integer(body, "max_tokens", INT32_MAX)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", INT32_MAX)
    if max_tokens is not None and max_tokens < -INT32_MAX:  # below what an int32 holds
        raise FieldError("max_tokens", f"must be >= 1, got {_shown(max_tokens)}")  # 0: later
    temperature = _number(body, "temperature")
    seed = _integer(body, "seed", SEED_LIMIT - 1)
    if seed is not None and seed < 0:
        raise FieldError("seed", f"must be >= 0, got {_shown(seed)}")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise FieldError("stop", "must be a string or a list of strings")
    return incoming.sampling(DEFAULT_MAX_TOKENS[endpoint] if max_tokens is None else max_tokens,
                             temperature=1.0 if temperature is None else temperature,
                             top_p=_number(body, "top_p"), seed=seed or 0, stop=stops)


def check_model(body: dict, model_id: str) -> None:
    model = body.get("model")
    if model != model_id:
        raise FieldError("model", f"unknown model {model!r}; this cluster serves {model_id!r} "
                         "(GET /v1/models)")


def streaming(body: dict) -> Streaming:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise FieldError("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise FieldError("stream_options", "must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise FieldError("stream_options.include_usage", "must be true or false")
    return Streaming(stream, include_usage)


def request_of(body: Any, endpoint: str, encode: Encode, custom_id: str = "",
               headers: dict[str, str] | None = None) -> RequestIn:
    """The request a chat or completion body asks for (unchecked beyond its JSON shape);
    ``headers`` (lower-case names) may name the client's session."""
    if not isinstance(body, dict):
        raise FieldError("body", "must be a JSON object")
    openai_fields.check_fields(body, endpoint)
    params = sampling_params(body, endpoint)
    logprobs, top = openai_fields.logprobs_of(body, endpoint)
    outputs = {"response_format": body.get("response_format"), "logprobs": logprobs,
               "top_logprobs": top, "cache": openai_fields.cache_of(body, headers)}
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise FieldError("messages", "must be a list of {role, content} objects")
        openai_fields.check_message_keys(messages)
        return RequestIn(custom_id, incoming.messages_of(messages), params, **outputs,
                         tools=tool_calls.parse_request(body))
    return RequestIn(custom_id, Tokens(tuple(_prompt_ids(body.get("prompt"), encode))), params,
                     **outputs)


def _prompt_ids(prompt: Any, encode: Encode) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list: the SDK sends this shape too
    if isinstance(prompt, str):
        if not prompt:
            raise FieldError("prompt", "empty; give some text")
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        for j, token in enumerate(prompt):
            if not -TOKEN_LIMIT <= token < TOKEN_LIMIT:  # the vocabulary is checked later
                raise FieldError(f"prompt[{j}]", f"token id {_shown(token)} is outside the "
                                 "vocabulary")
        return list(prompt)
    raise FieldError("prompt", "must be a string or a list of token ids (one prompt per "
                     "request; send several prompts as several requests or as a batch)")


# ------------------------------------------------------------------ responses

def usage(r: StoredResult) -> dict:
    """OpenAI's usage, with the prompt tokens this request stored in Anthropic's names (by
    the TTL they keep: ``cache_creation``)."""
    completion = len(r.output_tokens)
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": completion,
            "total_tokens": r.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
            "cache_creation_input_tokens": r.written_input_tokens,
            "cache_creation": cache_fields.cache_creation(r.written_input_tokens,
                                                          r.write_ttl_s)}


def completion_id(endpoint: str, request_id: str) -> str:
    return f"{'chatcmpl' if endpoint == CHAT else 'cmpl'}-{request_id}"


@dataclass(frozen=True, slots=True)
class Outputs:
    """What turns a result into OpenAI's answer beyond its text: each token's bytes (for
    log-probabilities) and, for a chat that offered tools, how the model writes calls."""

    token_bytes: TokenBytes
    tools: ToolRequest | None = None
    tool_format: ToolFormat | None = None

    @property
    def parses_calls(self) -> bool:
        return (self.tools is not None and self.tool_format is not None
                and self.tools.choice != "none")

    def message(self, text: str, request_id: str, finish_reason: str) -> tuple[dict, str]:
        """A chat answer's message and finish reason: the calls cut out of ``text`` (content
        the text outside them, or null) with ``tool_calls`` when it made any."""
        if not self.parses_calls:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = self.tool_format.parse(text, self.tools, f"call_{request_id}")
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in calls]}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def logprobs(self, endpoint: str, r: StoredResult) -> dict | None:
        if not r.logprobs:
            return None
        scores = scores_of(r.logprobs, self.token_bytes)
        return (chat_logprobs(scores) if endpoint == CHAT
                else completion_logprobs(scores, text=r.text))


def response_body(endpoint: str, r: StoredResult, model: str, created_s: int,
                  outputs: Outputs) -> dict:
    """The whole (non-streamed) response for a finished request."""
    choice = {"index": 0, "finish_reason": r.finish_reason,
              "logprobs": outputs.logprobs(endpoint, r)}
    if endpoint == CHAT:
        choice["message"], choice["finish_reason"] = outputs.message(r.text, r.request_id,
                                                                     r.finish_reason)
    else:
        choice["text"] = r.text
    body = {"id": completion_id(endpoint, r.request_id),
            "object": "chat.completion" if endpoint == CHAT else "text_completion",
            "created": created_s, "model": model, "choices": [choice], "usage": usage(r)}
    if r.diagnosis is not None:
        body["cache_diagnostics"] = cache_fields.diagnosis_body(r.diagnosis,
                                                                outputs.token_bytes)
    if r.verification is not None:
        body["cache_verify"] = cache_fields.verification_body(r.verification)
    return body


def batch_output_line(endpoint: str, r: StoredResult, model: str, created_s: int,
                      outputs: Outputs) -> dict:
    """One line of a Batch output (``ok``) or error file, as OpenAI writes it."""
    line: dict = {"id": f"batch_req_{r.request_id}", "custom_id": r.custom_id}
    if not r.ok:
        return {**line, "response": None,
                "error": {"code": r.error_code, "message": r.error_message}}
    return {**line, "error": None,
            "response": {"status_code": 200, "request_id": r.request_id,
                         "body": response_body(endpoint, r, model, created_s, outputs)}}


@dataclass(frozen=True, slots=True)
class BatchInput:
    requests: list[RequestIn]
    lines: list[int]  # the 1-based line of each request

    def on_line(self, exc: FieldError) -> FieldError:
        """``exc`` about ``requests[i]...`` (from validation) retold as ``line N...``."""
        match = re.match(r"requests\[(\d+)\]", exc.field)
        if match is None or int(match.group(1)) >= len(self.lines):
            return exc
        field = f"line {self.lines[int(match.group(1))]}{exc.field[match.end():]}"
        return type(exc)(field, str(exc).removeprefix(f"{exc.field}: "))


def batch_requests(lines: Sequence[str], endpoint: str, encode: Encode, model_id: str
                   ) -> BatchInput:
    """The requests of a Batch input file; ``FieldError`` naming ``line N`` on bad input.
    Every line names the batch's endpoint and the served model (``check_model``, as a chat
    request must)."""
    requests, numbers = [], []
    for number, text in enumerate(lines, start=1):
        if text.strip():
            requests.append(_batch_line(text, f"line {number}", endpoint, encode, model_id))
            numbers.append(number)
    if not requests:
        raise FieldError("input_file_id", "the input file has no requests")
    return BatchInput(requests, numbers)


def _batch_line(text: str, where: str, endpoint: str, encode: Encode, model_id: str
                ) -> RequestIn:
    try:
        line = json_input.loads(text)
    except json_input.JsonInputError as exc:
        raise FieldError(f"{where}.{exc.path}" if exc.path else where, exc.reason) from None
    if not isinstance(line, dict):
        raise FieldError(where, "each line must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise FieldError(f"{where}.custom_id", "must be a non-empty string")
    if line.get("method", "POST") != "POST" or line.get("url", endpoint) != endpoint:
        raise FieldError(f"{where}.url", f"every line must be POST {endpoint}, the batch's "
                         "endpoint")
    body = line.get("body")
    try:
        if isinstance(body, dict):
            check_model(body, model_id)
            openai_fields.check_batch_body(body)
        return request_of(body, endpoint, encode, custom_id)
    except FieldError as exc:
        raise FieldError(f"{where}.body.{exc.field}",
                         str(exc).removeprefix(f"{exc.field}: ")) from None

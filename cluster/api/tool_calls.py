"""Tool calls: the tools a chat request offers, how the model's output names calls, and the
grammar that enforces ``tool_choice``.

A request's ``tools`` (OpenAI's ``[{"type": "function", "function": {name, description,
parameters}}]``) are rendered by the model's own chat template, as are the assistant turns
that made calls and the ``tool`` turns that answered them, so a multi-step tool loop is one
growing conversation whose prefix the cache serves turn over turn. The model writes its calls
between its format's markers; ``ToolFormat.parse`` cuts them out of the text with the model's
own parser (mlx-lm's ``tool_parsers``, picked from the chat template) into
``choices[].message.tool_calls``::

    output   I'll check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
             └ content ┘└──────────── one call: id, function.name, function.arguments ─────┘

``tool_choice``: ``auto`` (the model decides; its calls are parsed), ``none`` (tools are
rendered, nothing is parsed), ``required`` and a named function: a grammar (``lark`` with the
calls' JSON schemas) makes the output one call (several with ``parallel_tool_calls``) of an
offered function whose arguments validate against its ``parameters``. Enforcement needs a
JSON call format (the markers around a ``{"name", "arguments"}`` object); a model whose
template renders no tools is refused with the model named.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster.api.validate import FieldError
from workers.messages import ResponseFormat

CHOICES = ("auto", "none", "required")
JSON_FORMATS = ("json_tools",)
COMPACT_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}  # parsers whose calls are {"name", "arguments"} JSON objects


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What a chat request asks of tools: the offer, the choice, one call or several."""

    tools: tuple[dict, ...]  # OpenAI function specs, validated
    choice: str = "auto"     # "auto", "none", "required", or "function" (``name``)
    name: str = ""
    parallel: bool = True

    def function_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def parse_request(body: dict) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body; None without
    tools. ``FieldError`` naming the field for anything malformed."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if tools is None:
        if choice not in (None, "none"):
            raise FieldError("tool_choice", "needs tools: pass the functions in tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise FieldError("tools", "must be a non-empty list of {type: function, function}")
    specs = tuple(_function(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [s["function"]["name"] for s in specs]
    if len(set(names)) != len(names):
        raise FieldError("tools", f"function names repeat: {names}")
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "must be true or false")
    mode, name = _choice(choice, names)
    return ToolRequest(specs, mode, name, parallel)


class ToolFormat:
    """How one model writes calls: its markers and parser (None from ``of`` when its chat
    template renders no tools)."""

    def __init__(self, model: str, start: str, end: str, parser: Callable, kind: str) -> None:
        self.model, self.start, self.end, self._parser, self.kind = model, start, end, parser, kind

    @classmethod
    def of(cls, model_dir: str | Path, model: str) -> ToolFormat | None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        wrapper = load_tokenizer(Path(model_dir))
        template = getattr(wrapper, "chat_template", "") or ""  # the HF tokenizer's, delegated
        if not wrapper.has_tool_calling or "tools" not in template:
            return None
        kind = _kind(wrapper)
        return cls(model, wrapper.tool_call_start, wrapper.tool_call_end, wrapper.tool_parser,
                   kind)

    def grammar(self, request: ToolRequest) -> ResponseFormat | None:
        """The constraint ``required`` or a named function imposes (None otherwise)."""
        if request.choice not in ("required", "function"):
            return None
        if self.kind not in JSON_FORMATS:
            raise FieldError("tool_choice", f"{request.choice!r} is enforced for JSON tool "
                             f"calls; model {self.model!r} writes {self.kind or 'its own'} calls")
        offered = [t["function"] for t in request.tools
                   if request.choice == "required" or t["function"]["name"] == request.name]
        call = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False} for f in offered],
            "x-guidance": COMPACT_JSON}
        one = f"{json.dumps(self.start)} \"\\n\" %json {json.dumps(call)} \"\\n\" {json.dumps(self.end)}"
        lark = f"start: call{'+' if request.parallel else ''}\ncall: {one}\n"
        return ResponseFormat("lark", pattern=lark)

    def parse(self, text: str, request: ToolRequest, id_prefix: str) -> tuple[str, list[ToolCall]]:
        """The text outside calls, and the calls (in order); malformed calls stay text."""
        if request.choice == "none":
            return text, []
        content, calls, rest = [], [], text
        while (at := rest.find(self.start)) >= 0:
            end = rest.find(self.end, at + len(self.start))
            if end < 0:
                break
            inner = rest[at + len(self.start):end]
            try:
                parsed = self._parser(inner, list(request.tools))
            except (ValueError, KeyError, TypeError):
                parsed = None
            if isinstance(parsed, dict) and parsed.get("name") in request.function_names():
                content.append(rest[:at])
                calls.append(ToolCall(f"{id_prefix}_{len(calls)}", parsed["name"],
                                      _arguments(parsed.get("arguments", {}))))
            else:
                content.append(rest[:end + len(self.end)])
            rest = rest[end + len(self.end):]
        content.append(rest)
        return "".join(content).strip() if calls else text, calls


def _function(tool: Any, path: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError(f"{path}.type", "must be \"function\" (the only tool type offered)")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise FieldError(f"{path}.function.name", "required: a non-empty string")
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict):
        raise FieldError(f"{path}.function.parameters", "must be a JSON schema object")
    if "description" in fn and not isinstance(fn["description"], str):
        raise FieldError(f"{path}.function.description", "must be a string")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise FieldError(f"{path}.function.{sorted(unknown)[0]}", "is not a function field")
    return {"type": "function", "function": {k: v for k, v in fn.items() if k != "strict"}}


def _choice(choice: Any, names: list[str]) -> tuple[str, str]:
    if choice is None:
        return "auto", ""
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise FieldError("tool_choice", f"must be one of {', '.join(CHOICES)} or "
                             "{type: function, function: {name}}")
        return choice, ""
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise FieldError("tool_choice", "must be a string or {type: function, function: {name}}")
    if fn.get("name") not in names:
        raise FieldError("tool_choice.function.name", f"{fn.get('name')!r} is not among tools "
                         f"({', '.join(names)})")
    return "function", fn["name"]


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _kind(wrapper) -> str:
    parser = wrapper.tool_parser
    module = getattr(parser, "__module__", "") or ""
    return module.rsplit(".", 1)[-1]

"""JSON from callers (HTTP bodies, Batch input lines), parsed and held to what protobuf holds.

Every JSON request becomes an orchard.v1 protobuf message, so JSON input gets the limits the
gRPC edge's decoder applies to protobuf bytes, refused with a message naming where:

    nesting deeper than MAX_NESTING      protobuf's recursion limit (the gRPC edge answers
                                         INVALID_ARGUMENT past it, ``cluster.api.edge``);
                                         Python's json recurses and fails at about 1000
                                         levels with a RecursionError, which is caught here
    a string with a lone surrogate       ``"\\ud800"`` parses to a Python string that no UTF-8
                                         encoder takes (protobuf's included)
    text that is not UTF-8               decoded strictly here: ``json.loads`` of bytes would
                                         guess UTF-16 or UTF-32 from the first bytes

The walks that look for the last two run only when the text could hold them (more than
``MAX_NESTING`` brackets; a ``\\uD800``-``\\uDFFF`` escape), so ordinary input costs two
substring counts over the parse.
"""
from __future__ import annotations

import json
import re
from typing import Any

# protobuf's recursion limit (upb's default, json_format's max_recursion_depth): a message
# nested deeper does not decode (tests/cluster/api/test_json_input.py pins the decoder to this value)
MAX_NESTING = 100
KEY_CHARS = 64  # a path shows at most this much of a key

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonInputError(ValueError):
    """JSON that cannot become a request; ``path`` is where in the document ("" for all of
    it), ``reason`` what is wrong and what to do."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


def loads(text: str | bytes) -> Any:
    """``text`` parsed as JSON; ``JsonInputError`` for anything protobuf would not hold."""
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as exc:
            raise JsonInputError("", f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
                                 f"offset {exc.start}); send UTF-8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonInputError("", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise JsonInputError("", f"not valid JSON ({exc})") from None
    if text.count("[") + text.count("{") > MAX_NESTING and _deeper_than(value, MAX_NESTING):
        raise _too_deep()
    if _SURROGATE_ESCAPE.search(text):
        _check_surrogates(value, "")
    return value


def _too_deep() -> JsonInputError:
    return JsonInputError("", f"nested deeper than {MAX_NESTING} levels of arrays and objects; "
                          "flatten it")


def _deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def _check_surrogates(value: Any, path: str) -> None:
    """Raise naming the first string (or key) that holds a lone surrogate; the depth is
    already known to be within ``MAX_NESTING``. The message never quotes the string (a
    surrogate in it would fail the answer's own encoding)."""
    if isinstance(value, str):
        if match := _SURROGATE.search(value):
            raise JsonInputError(path, f"not Unicode text (a lone surrogate "
                                 f"\\u{ord(match.group()):04x} at character {match.start()}); "
                                 "escape a character outside the BMP as a surrogate pair")
    elif isinstance(value, dict):
        for key, child in value.items():
            if _SURROGATE.search(key):
                _check_surrogates(key, f"{path} (a key)" if path else "(a key)")
            shown = key if len(key) <= KEY_CHARS else f"{key[:KEY_CHARS]}..."
            _check_surrogates(child, f"{path}.{shown}" if path else shown)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            _check_surrogates(child, f"{path}[{i}]")

"""Workload traces for the simulator: Mooncake-format JSONL in, typed requests out.

A line is ``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}``;
``hash_ids`` are the prompt's 512-token block ids (equal ids mean a reusable prefix block,
and an id always has the same parent). The last block may be partial. A line that is not
valid JSON, or lacks a field, or has a wrong type, is a ``ValueError`` naming the file and
line: the replay stops rather than run on a silently different workload.

``synthesize`` writes a trace of a different shape than the conversation trace (shared
system prompts of several lengths, short and long conversations, Poisson arrivals at a
chosen rate), so a policy tuned on one is checked on another.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# The Mooncake conversation trace, shipped with orchard (attribution in traces/README.md).
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str = ""                # its session key ("": none)
    write_blocks: int | None = None  # blocks before its last breakpoint (None: no breakpoint)


_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _parse(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg}); fix or remove the line") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with fields {', '.join(_FIELDS)}")
    missing = [f for f in _FIELDS if f not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    ts, n_in, n_out, ids = (row[f] for f in _FIELDS)
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise ValueError(f"{where}: timestamp must be non-negative milliseconds, got {ts!r}")
    for name, value in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    if n_in == 0:
        raise ValueError(f"{where}: input_length must be at least 1 token")
    if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{where}: hash_ids must be a list of non-negative integers")
    session, write_blocks = row.get("session", ""), row.get("write_blocks")
    if not isinstance(session, str):
        raise ValueError(f"{where}: session must be a string (a session key), got {session!r}")
    if write_blocks is not None and (not isinstance(write_blocks, int)
                                     or isinstance(write_blocks, bool) or write_blocks < 0):
        raise ValueError(f"{where}: write_blocks must be a non-negative integer, "
                         f"got {write_blocks!r}")
    unknown = set(row) - set(_FIELDS) - {"session", "write_blocks"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(ids), session, write_blocks)


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format trace, in arrival order (the first ``limit`` lines if given)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} not found: pass --trace FILE")
    out: list[TraceRequest] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            req = _parse(line, f"{path}:{number}")
            if out and req.arrival_s < out[-1].arrival_s:
                raise ValueError(f"{path}:{number}: timestamps must not go backwards")
            out.append(req)
    if not out:
        raise ValueError(f"trace {str(path)!r} has no requests")
    return out


@dataclass(frozen=True, slots=True)
class SynthShape:
    """The knobs of a synthetic trace (defaults: a busier, more shared, shorter workload)."""

    requests: int = 12000
    rate_per_s: float = 5.0
    system_prompts: int = 16
    system_blocks: tuple[int, ...] = (1, 2, 4, 8, 16)
    new_conversation: float = 0.35  # probability a request opens a conversation
    turn_blocks: tuple[int, int] = (1, 8)  # blocks a turn adds (uniform)
    think_s: tuple[float, float] = (5.0, 900.0)  # pause before a follow-up (uniform)
    output: tuple[int, int] = (20, 600)
    block_size: int = 512


def synthesize(shape: SynthShape, seed: int) -> list[TraceRequest]:
    """A Mooncake-shaped trace: Poisson arrivals, conversations on shared system prompts."""
    rng = random.Random(seed)
    next_id = 0
    systems = []
    for _ in range(shape.system_prompts):
        n = rng.choice(shape.system_blocks)
        systems.append(list(range(next_id, next_id + n)))
        next_id += n
    open_convs: list[tuple[float, list[int]]] = []  # (ready at, block ids so far)
    out, now = [], 0.0
    for _ in range(shape.requests):
        now += rng.expovariate(shape.rate_per_s)
        ready = [i for i, (t, _) in enumerate(open_convs) if t <= now]
        if ready and rng.random() >= shape.new_conversation:
            _, ids = open_convs.pop(rng.choice(ready))
        else:
            ids = list(rng.choice(systems))
        added = rng.randint(*shape.turn_blocks)
        ids = ids + list(range(next_id, next_id + added))
        next_id += added
        tail = rng.randint(1, shape.block_size)
        length = (len(ids) - 1) * shape.block_size + tail
        out.append(TraceRequest(round(now, 3), length, rng.randint(*shape.output), tuple(ids)))
        if rng.random() < 0.8:
            # the next turn shares every full block of this prompt (the tail block changes)
            open_convs.append((now + rng.uniform(*shape.think_s), ids[:-1]))
    return out


def write_trace(requests: list[TraceRequest], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as handle:
        for r in requests:
            row = {"timestamp": int(round(r.arrival_s * 1000)), "input_length": r.input_length,
                   "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            if r.session:
                row["session"] = r.session
            if r.write_blocks is not None:
                row["write_blocks"] = r.write_blocks
            handle.write(json.dumps(row) + "\n")

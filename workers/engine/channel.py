"""What crosses the engine thread's boundary (``workers.engine.runtime``), every message typed.

    caller's event loop                         engine thread
    ───────────────────                         ─────────────
    Command ──────────────────────────────────► Open | Submit | Abort | Call | Retire | Stop
    a run's Sink ◄── RunEvent ─────────────────┤ TokenDelta | Finished | Aborted | Failed
    a call's Reply ◄── Answer ─────────────────┘ Answered | Failed

Each is a frozen, slotted dataclass (``TokenDelta`` is the engine's own,
``workers.engine.sequence``), and each side dispatches on the type in one ``match``: the engine
thread on a ``Command``, the caller on a ``RunEvent`` (``EngineRuntime.run``) and on an
``Answer``. A ``Failed`` carries the exception the caller raises: a refused request
(``ValueError``), an engine that broke or left (``WorkerFailed``), or a bug in a call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Union

from router.kv.events import Tier
from router.kv.key import BlockHash
from router.kv.ledger import Holding
from workers.engine.engine import Engine, EngineConfig
from workers.engine.sequence import TokenDelta
from workers.messages import GenerateRequest, GenerateResult


# ---- out of the engine thread ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Finished:
    """A finished request and the worker's own wall time on it (cache writes included)."""

    result: GenerateResult
    worker_s: float


@dataclass(frozen=True, slots=True)
class Aborted:
    """The request was aborted by ``abort``: its run ends without a result."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The run or the call failed: the caller raises ``error``."""

    error: Exception


@dataclass(frozen=True, slots=True)
class Answered:
    """A call's value (``fn(engine)``, an opened engine)."""

    value: object


RunEvent = Union[TokenDelta, Finished, Aborted, Failed]
Answer = Union[Answered, Failed]
Sink = Callable[[RunEvent], None]       # called on the engine thread
Reply = Callable[[Answer], None]        # called on the engine thread


@dataclass(frozen=True, slots=True)
class Holdings:
    """A worker's blocks by tier and the sequence number of the last event batch they include.

    A block can be in both tiers at once (a block read back from disk stays there until its
    disk tier evicts it): it is then in both tuples, as the router's index keeps it.
    """

    seq: int
    blocks: tuple[BlockHash, ...]                # in the memory tier
    disk_blocks: tuple[BlockHash, ...] = ()      # in the disk tier

    @classmethod
    def of(cls, seq: int, held: Iterable[Holding]) -> "Holdings":
        held = list(held)
        return cls(seq, tuple(h.block for h in held if h.tier == Tier.MEMORY),
                   tuple(h.block for h in held if h.tier == Tier.DISK))


# ---- into the engine thread: commands --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Open:
    worker_id: str
    model_dir: str
    config: EngineConfig
    clock: Callable[[], float]
    reply: Reply


@dataclass(frozen=True, slots=True)
class Submit:
    worker_id: str
    request: GenerateRequest
    sink: Sink


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    worker_id: str
    fn: Callable[[Engine], object]
    reply: Reply


@dataclass(frozen=True, slots=True)
class Retire:
    worker_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Union[Open, Submit, Abort, Call, Retire, Stop]

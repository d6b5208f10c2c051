"""An agent-loop trace: multi-turn tool loops, half of them with a volatile system prompt line.

What agent clients send. Each session is one agent's conversation: a system prompt (the
agent's instructions and tool definitions, shared by every session of that agent), then
turns; a turn is a user message, then a loop of model calls: each call's answer is a tool
call whose result joins the conversation before the next call, until the last call answers
the user. Every model call is one request whose prompt is the whole conversation so far::

    system | user | call | tool | call | tool | answer | user | call | tool | answer | ...
    ^ request 1    ^ request 2    ^ request 3             ^ request 4    ^ request 5

For ``volatile_share`` of the sessions (spread evenly: every second one at 0.5) the client writes a per-message line (a timestamp, a
request id) into the system prompt, in its block ``volatile_block`` (after the agent's
preamble, before its tool definitions): as sent, every block from there on differs from
request to request, and only the blocks before it are reusable. The client's fix moves the
line to the end of the prompt, after a cache breakpoint (``write_blocks``: what follows it is
not written); every session carries a session key (``session``, its ``prompt_cache_key``).
``AgentVariant`` renders the same sessions each way, so one seed gives comparable traces.

Timing: sessions open as Poisson arrivals at ``session_rate_per_s``; a tool runs
``tool_s`` seconds (uniform) before the next call, a user thinks ``think_s`` seconds before
the next turn. Deterministic from the seed: the sessions are drawn first, then rendered.
Block ids: each agent's system prompt its own, each session's conversation blocks its own,
and every block that differs per request (after a volatile line, a partial tail) a fresh one.
"""
from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass

from router.sim.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class AgentShape:
    """The knobs of an agent-loop trace; token ranges are uniform (low, high)."""

    sessions: int = 400
    session_rate_per_s: float = 0.5
    agents: int = 4                              # distinct system prompts
    system_blocks: tuple[int, ...] = (4, 8, 12)  # an agent's system prompt, in blocks
    volatile_share: float = 0.5                  # sessions whose system prompt has the line
    volatile_block: int = 1                      # the system prompt's block that holds it
    volatile_tokens: int = 24                    # the line's tokens
    turns: tuple[int, int] = (1, 6)
    tool_calls: tuple[int, int] = (0, 5)         # per turn
    user_tokens: tuple[int, int] = (20, 400)
    call_tokens: tuple[int, int] = (20, 120)     # an answer that calls a tool
    tool_tokens: tuple[int, int] = (50, 3000)    # a tool's result
    answer_tokens: tuple[int, int] = (50, 400)   # the answer to the user
    tool_s: tuple[float, float] = (0.5, 20.0)
    think_s: tuple[float, float] = (10.0, 900.0)
    block_size: int = 512

    def __post_init__(self) -> None:
        if min(self.sessions, self.agents, self.block_size, self.volatile_tokens) < 1:
            raise ValueError("an agent-loop trace needs at least one session, agent, token "
                             "per block and volatile token")
        if self.session_rate_per_s <= 0:
            raise ValueError(f"session_rate_per_s must be positive, got {self.session_rate_per_s}")
        if not 0 <= self.volatile_share <= 1:
            raise ValueError(f"volatile_share is a share of sessions in [0, 1], "
                             f"got {self.volatile_share}")
        if not self.system_blocks or min(self.system_blocks) <= self.volatile_block:
            raise ValueError(f"every system prompt must have more than volatile_block "
                             f"({self.volatile_block}) blocks, got {self.system_blocks}")
        if self.volatile_block < 0:
            raise ValueError(f"volatile_block must be >= 0, got {self.volatile_block}")
        for name in ("turns", "tool_calls", "user_tokens", "call_tokens", "tool_tokens",
                     "answer_tokens", "tool_s", "think_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range 0 <= low <= high, got {(low, high)}")
        if self.turns[0] < 1:
            raise ValueError(f"turns must be at least 1 per session, got {self.turns}")


@dataclass(frozen=True, slots=True)
class AgentCall:
    """One model call of a session: its conversation so far, before any volatile line."""

    arrival_s: float
    session: int
    agent: int
    volatile: bool
    system_tokens: int         # the agent's system prompt, whole blocks
    conversation_tokens: int   # system prompt and messages so far
    output_tokens: int


class AgentVariant(enum.Enum):
    AS_SENT = "as_sent"              # the volatile line inside the system prompt
    BREAKPOINT = "with_breakpoint"   # the line moved after a breakpoint at the prompt's end


def agent_calls(shape: AgentShape, seed: int) -> list[AgentCall]:
    """Every session's model calls, in arrival order (ties by session, then call)."""
    rng = random.Random(seed)
    systems = [rng.choice(shape.system_blocks) * shape.block_size for _ in range(shape.agents)]
    calls: list[AgentCall] = []
    opened = 0.0
    for s in range(shape.sessions):
        opened += rng.expovariate(shape.session_rate_per_s)
        agent = rng.randrange(shape.agents)
        # spread evenly: at 0.5 every second session (1, 3, 5, ...) has the line
        volatile = int((s + 1) * shape.volatile_share) > int(s * shape.volatile_share)
        now, tokens = opened, systems[agent]
        for turn in range(rng.randint(*shape.turns)):
            if turn:
                now += rng.uniform(*shape.think_s)
            tokens += rng.randint(*shape.user_tokens)
            loops = rng.randint(*shape.tool_calls)
            for k in range(loops + 1):
                last = k == loops
                out = rng.randint(*(shape.answer_tokens if last else shape.call_tokens))
                calls.append(AgentCall(round(now, 3), s, agent, volatile, systems[agent],
                                       tokens, out))
                tokens += out
                if not last:
                    now += rng.uniform(*shape.tool_s)
                    tokens += rng.randint(*shape.tool_tokens)
    calls.sort(key=lambda c: (c.arrival_s, c.session, c.conversation_tokens))
    return calls


def session_key(session: int) -> str:
    return f"agent-session-{session}"


def render(calls: list[AgentCall], shape: AgentShape, variant: AgentVariant,
           session_keys: bool = False) -> list[TraceRequest]:
    """The calls as a trace, the volatile line placed by ``variant``; with ``session_keys``
    each request names its session."""
    bs = shape.block_size
    fresh = itertools.count()
    systems: dict[int, list[int]] = {}
    conversations: dict[int, list[int]] = {}  # a session's full blocks after its system prompt
    out = []
    for c in calls:
        system = systems.setdefault(c.agent, [])
        conversation = conversations.setdefault(c.session, [])
        full = c.conversation_tokens // bs
        while len(system) < min(full, c.system_tokens // bs):
            system.append(next(fresh))
        while len(system) + len(conversation) < full:
            conversation.append(next(fresh))
        stable = (system + conversation)[:full]
        length, write_blocks = c.conversation_tokens, None
        if c.volatile:
            length += shape.volatile_tokens
            if variant is AgentVariant.AS_SENT:
                stable = stable[:shape.volatile_block]
            else:
                write_blocks = full
        ids = stable + [next(fresh) for _ in range(-(-length // bs) - len(stable))]
        out.append(TraceRequest(c.arrival_s, length, c.output_tokens, tuple(ids),
                                session_key(c.session) if session_keys else "", write_blocks))
    return out


def agent_loop(shape: AgentShape, seed: int) -> list[TraceRequest]:
    """The trace as agent clients send it, each request with its session key."""
    return render(agent_calls(shape, seed), shape, AgentVariant.AS_SENT, session_keys=True)

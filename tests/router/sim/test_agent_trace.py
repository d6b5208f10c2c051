"""The agent-loop trace (``router.sim.agent_trace``): sessions whose conversation grows call
by call, the volatile line placed as sent or after a breakpoint, session keys, one trace a
seed."""
from __future__ import annotations

import pytest

from cluster.cli import main
from router.sim.agent_trace import (AgentCall, AgentShape, AgentVariant, agent_calls,
                                    agent_loop, render, session_key)
from router.sim.trace import TraceRequest, load_trace

TINY = AgentShape(block_size=4, volatile_block=1, volatile_tokens=2, system_blocks=(2,))
# two sessions on agent 0's 8-token system prompt; session 1 has the volatile line
CALLS = [AgentCall(0.0, 0, 0, False, 8, 10, 3), AgentCall(1.0, 1, 0, True, 8, 9, 3),
         AgentCall(2.0, 0, 0, False, 8, 17, 3), AgentCall(3.0, 1, 0, True, 8, 14, 3)]


def test_as_sent_a_volatile_line_leaves_only_the_blocks_before_it_shared():
    trace = render(CALLS, TINY, AgentVariant.AS_SENT)
    assert trace == [
        TraceRequest(0.0, 10, 3, (0, 1, 2)),          # system [0, 1], a partial tail
        TraceRequest(1.0, 11, 3, (0, 3, 4)),          # the line is in block 1: fresh from it
        TraceRequest(2.0, 17, 3, (0, 1, 5, 6, 7)),    # the conversation grew by 2 blocks
        TraceRequest(3.0, 16, 3, (0, 9, 10, 11))]     # nothing of session 1 is reused


def test_with_the_breakpoint_the_conversation_is_shared_and_the_line_not_written():
    trace = render(CALLS, TINY, AgentVariant.BREAKPOINT, session_keys=True)
    assert trace == [
        TraceRequest(0.0, 10, 3, (0, 1, 2), "agent-session-0"),
        TraceRequest(1.0, 11, 3, (0, 1, 3), "agent-session-1", write_blocks=2),
        TraceRequest(2.0, 17, 3, (0, 1, 4, 5, 6), "agent-session-0"),
        TraceRequest(3.0, 16, 3, (0, 1, 7, 8), "agent-session-1", write_blocks=3)]


SHAPE = AgentShape(sessions=40, session_rate_per_s=1.0, agents=2, system_blocks=(3, 5),
                   block_size=16, user_tokens=(5, 20), call_tokens=(3, 10),
                   tool_tokens=(5, 60), answer_tokens=(5, 30), turns=(1, 3), tool_calls=(0, 3))


def test_sessions_grow_call_by_call_and_every_second_one_is_volatile():
    calls = agent_calls(SHAPE, seed=3)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(calls, calls[1:]))
    assert {c.session for c in calls if c.volatile} == set(range(1, 40, 2))
    for s in range(40):
        mine = [c for c in calls if c.session == s]
        assert mine[0].conversation_tokens > mine[0].system_tokens in (48, 80)
        # each call's prompt is the last one's, its answer, and what came after it
        for a, b in zip(mine, mine[1:]):
            assert b.conversation_tokens > a.conversation_tokens + a.output_tokens - 1
            assert b.arrival_s > a.arrival_s
    trace = agent_loop(SHAPE, seed=3)
    by_session: dict[str, list[TraceRequest]] = {}
    for c, r in zip(calls, trace):
        assert r.session == session_key(c.session)
        by_session.setdefault(r.session, []).append(r)
    for s, requests in by_session.items():
        for a, b in zip(requests, requests[1:]):
            shared = 1 if int(s.rsplit("-", 1)[1]) % 2 else a.input_length // 16
            assert b.hash_ids[:shared] == a.hash_ids[:shared]
            assert b.hash_ids[shared] not in a.hash_ids  # fresh from there on
    assert agent_loop(SHAPE, seed=3) == trace != agent_loop(SHAPE, seed=4)


@pytest.mark.parametrize("change, message", [
    ({"sessions": 0}, "at least one session"),
    ({"session_rate_per_s": 0}, "session_rate_per_s must be positive"),
    ({"volatile_share": 1.5}, "volatile_share is a share"),
    ({"system_blocks": (1,)}, "more than volatile_block"),
    ({"tool_tokens": (10, 5)}, "tool_tokens must be a range"),
    ({"turns": (0, 2)}, "turns must be at least 1"),
])
def test_a_shape_that_cannot_be_drawn_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        AgentShape(**change)


def test_the_cli_writes_it_with_its_session_keys(tmp_path):
    path = tmp_path / "agents.jsonl"
    assert main(["simulate", "--synthesize", str(path), "--shape", "agent-loop",
                 "--seed", "1"]) == 0
    trace = load_trace(path)
    assert trace == agent_loop(AgentShape(), seed=1)
    assert len({r.session for r in trace}) == AgentShape().sessions

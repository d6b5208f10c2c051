"""``cluster.bench.cluster``: the chat workload ``orchard bench cluster`` runs, without Ray: its
sizes checked, and one conversation's turns on the in-process backend, each turn's prompt the
one before, its reply and a new user message, sibling conversations sharing a system prompt.
The two policies on Ray workers run only at the command line (minutes)."""
from __future__ import annotations

import asyncio

import pytest

from cluster.backend.local import LocalBackend
from cluster.bench.cluster import Workload, _conversation
from cluster.cli import main
from router.kv.key import Namespace
from tests.support.forged_models import tiny_model
from workers.engine.engine import EngineConfig

SMALL = Workload(conversations=2, turns=2, system_prompts=1, system_tokens=32, user_tokens=16,
                 reply_tokens=2)


def conversations(workload: Workload, count: int) -> list:
    """The outcomes of conversations 0 to ``count - 1``, one after another, on one worker."""
    async def run():
        backend = LocalBackend(tiny_model(), workers=1, engine=EngineConfig(block_size=16))
        await backend.start()
        try:
            info = backend.model_info()
            namespace = Namespace("bench", info.model_id, info.revision)
            outcomes: list = []
            for index in range(count):
                await _conversation(backend, workload, index, info.vocab_size, namespace,
                                    info.block_size, outcomes)
            return outcomes
        finally:
            await backend.close()
    return asyncio.run(run())


class TestTheWorkload:
    @pytest.mark.parametrize("field", ["conversations", "turns", "system_prompts",
                                       "system_tokens", "user_tokens", "reply_tokens"])
    def test_every_size_must_be_at_least_one_naming_its_flag(self, field):
        with pytest.raises(ValueError) as refused:
            Workload(**{field: 0})
        assert str(refused.value) == f"--{field.replace('_', '-')} must be >= 1"

    def test_the_command_refuses_no_workers_before_starting_anything(self, capsys):
        assert main(["bench", "cluster", "--workers", "0"]) == 2
        assert "--workers must be >= 1, got 0" in capsys.readouterr().err


class TestAConversation:
    def test_each_turn_extends_the_last_by_its_reply_and_a_user_message(self):
        outcomes = conversations(SMALL, 2)
        results = [o.result for o in outcomes]
        assert [r.request_id for r in results] == ["c00t00", "c00t01", "c01t00", "c01t01"]
        assert [r.input_tokens for r in results] == [48, 66] * 2
        assert all(len(r.output_tokens) == 2 for r in results)
        # a turn reuses all its conversation computed before (the last reply token's K/V is
        # computed by the next prefill); the second conversation's first turn, the 32-token
        # system prompt it shares with the first
        assert [r.cached_tokens for r in results] == [0, 49, 32, 49]

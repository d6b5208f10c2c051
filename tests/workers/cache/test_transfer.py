"""Blocks between two engines' stores (``workers.cache.transfer``): a holder's blocks (memory
or disk tier) served as frames, checked and kept by a receiver whose next request reuses them
with outputs equal to a recompute; every bad frame refused by what is wrong with it."""
from __future__ import annotations

import random

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from tests.support.forged_models import tiny_model
from workers.cache.disk_files import decode_block
from workers.cache.transfer import Adopted, PullRefused
from workers.engine.engine import Engine, EngineConfig
from workers.messages import GenerateRequest, GenerateResult, SamplingParams

BS = 16
SECRET = b"k" * 32
BLOCK_BYTES = BS * 2 * 2 * 2 * 16 * 4   # 16 tokens x K and V x 2 layers x 2 heads x 16 dims, f32


def _engine(**config) -> Engine:
    return Engine.open(tiny_model("llama"), EngineConfig(block_size=BS, cache_secret=SECRET,
                                                         **config))


def _prompt(n: int, seed: int = 1) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 250) for _ in range(n))


def _run(engine: Engine, prompt, rid: str) -> GenerateResult:
    (result,) = engine.generate([GenerateRequest(rid, engine.namespace("t"), tuple(prompt),
                                                 SamplingParams(max_tokens=8))])
    assert isinstance(result, GenerateResult), result
    return result


def _pull(holder: Engine, receiver: Engine, prompt, blocks: int) -> int:
    ns = receiver.namespace("t")
    plan = receiver.transfer.begin(ns, prompt, blocks)
    frames = holder.transfer.serve(holder.namespace("t"), prompt, plan.start, plan.stop)
    adopted = receiver.transfer.adopt(ns, prompt, plan.start, frames)
    assert adopted.refused == ""
    return adopted.stored


@pytest.fixture(scope="module")
def holder() -> Engine:
    engine = _engine()
    _run(engine, _prompt(100), "warm")   # 6 full blocks stored (96 tokens)
    return engine


def test_pulled_blocks_are_reused_with_outputs_equal_to_a_recompute(holder):
    prompt = _prompt(100)
    receiver = _engine()
    assert _pull(holder, receiver, prompt, 6) == 6
    pulled = _run(receiver, prompt, "after-pull")
    alone = _run(_engine(use_store=False), prompt, "recompute")
    assert (pulled.cached_tokens, pulled.computed_tokens) == (96, 4)
    assert pulled.output_tokens == alone.output_tokens
    assert receiver.written_tokens() == 0   # pulled, not computed here


def test_a_pull_asks_only_for_the_blocks_the_receiver_lacks(holder):
    prompt = _prompt(100)
    receiver = _engine()
    _run(receiver, prompt[:40], "head")   # 2 blocks of its own
    plan = receiver.transfer.begin(receiver.namespace("t"), prompt, 6)
    assert (plan.start, plan.stop) == (2, 6)
    assert _pull(holder, receiver, prompt, 6) == 4


def test_a_holder_serves_its_disk_tier_and_stops_where_it_lacks_blocks(tmp_path):
    disk = _engine(store_bytes=2 * BLOCK_BYTES, disk_bytes=1 << 24,
                   disk_dir=str(tmp_path), worker_id="w0")
    prompt = _prompt(100, seed=3)
    _run(disk, prompt, "warm")
    disk.flush_store()
    frames = disk.transfer.serve(disk.namespace("t"), prompt + _prompt(32, seed=4), 0, 8)
    assert len(frames) == 6   # 6 blocks held (2 in memory, 4 on disk); blocks 6, 7 never were
    assert [decode_block(f, tmp_path).record.identity.position for f in frames] == list(range(6))
    receiver = _engine()
    ns = receiver.namespace("t")
    assert receiver.transfer.adopt(ns, prompt, 0, frames) == Adopted(6)
    assert _run(receiver, prompt, "from-disk").cached_tokens == 96


def _refusal(frames, receiver: Engine, prompt, index: int = 0, stored: int = 0) -> str:
    adopted = receiver.transfer.adopt(receiver.namespace("t"), prompt, index, frames)
    assert adopted.stored == stored
    return adopted.refused


def test_a_block_corrupted_in_transit_is_refused_after_the_good_ones_before_it(holder):
    prompt = _prompt(100)
    frames = holder.transfer.serve(holder.namespace("t"), prompt, 0, 6)
    bad = bytearray(frames[3])
    bad[len(bad) // 2] ^= 0x40
    receiver = _engine()
    message = _refusal([*frames[:3], bytes(bad), *frames[4:]], receiver, prompt, stored=3)
    assert message.startswith("block 3: corrupted in transit")
    assert _run(receiver, prompt, "after-corrupt").cached_tokens == 48   # blocks 0-2 kept


def test_blocks_of_another_model_are_refused():
    prompt = _prompt(100)
    other = Engine.open(tiny_model("llama", template="tools"),   # same weights, another id
                        EngineConfig(block_size=BS, cache_secret=SECRET))
    _run(other, prompt, "warm-other")
    frames = other.transfer.serve(other.namespace("t"), prompt, 0, 2)
    rev = other.revision
    assert _refusal(frames, _engine(), prompt) == (
        f"block 0: a block of model 'llama-tools' revision {rev!r}; this worker serves "
        f"'llama' revision {rev!r}")


def test_blocks_whose_tokens_are_not_the_prompts_are_refused(holder):
    prompt = _prompt(100)
    frames = holder.transfer.serve(holder.namespace("t"), prompt, 0, 2)
    other = (prompt[0] + 1,) + prompt[1:]
    assert _refusal(frames, _engine(), other) == "block 0: its token ids are not the prompt's"


def test_a_block_sent_for_another_position_is_refused(holder):
    prompt = _prompt(100)
    frames = holder.transfer.serve(holder.namespace("t"), prompt, 0, 2)
    message = _refusal([frames[1]], _engine(), prompt[16:], 0)
    assert message.startswith("block 0: its hash or identity is not the prompt's block ")


def test_a_receiver_without_room_refuses_the_pull():
    assert _engine().kv_bytes_per_token * BS == BLOCK_BYTES
    receiver = _engine(store_bytes=4 * BLOCK_BYTES)   # 4 blocks of memory
    with pytest.raises(PullRefused, match=r"no room: 6 blocks take 49152 bytes, this worker's "
                                          r"memory tier holds 32768"):
        receiver.transfer.begin(receiver.namespace("t"), _prompt(100), 6)


def test_a_worker_without_a_store_neither_serves_nor_takes_blocks(holder):
    off = _engine(use_store=False)
    assert off.transfer.serve(off.namespace("t"), _prompt(100), 0, 6) == []
    with pytest.raises(PullRefused, match="keeps no prefix store"):
        off.transfer.begin(off.namespace("t"), _prompt(100), 6)

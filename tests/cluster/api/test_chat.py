"""The frontend's tokenizer (``cluster.api.chat``): it renders the chat template exactly as the
worker's engine does, on its thread pool, and gives back the memory large prompts took."""
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.api.chat import ChatTokenizer
from tests.support.forged_models import tiny_model
from tests.support.paths import REPO
from workers.engine.engine import Engine


CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there, café ☕?"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And again"}]

MEMORY_PROBE = """
import asyncio, sys
from tests.support.forged_models import tiny_model
from cluster.api.chat import ChatTokenizer

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6

async def main():
    tokenizer = ChatTokenizer(tiny_model())
    text = ("The quick brown fox jumps over the lazy dog. " * 30000)[:1 << 20]
    before = rss_mb()
    for _ in range(3):
        await tokenizer.off_loop(tokenizer.render, [{"role": "user", "content": text}])
    print(rss_mb() - before)

asyncio.run(main())
"""


class TestTokenize:
    def test_frontend_rendering_matches_the_engine(self):
        engine = Engine.open(tiny_model())
        tokenizer = ChatTokenizer(tiny_model())
        assert tokenizer.render(CHAT) == engine.render_chat(CHAT)
        assert tokenizer.render_prefix(CHAT[:2]) == engine.render_chat(CHAT[:2],
                                                                       add_generation_prompt=False)
        # a later turn extends an earlier one: what makes multi-turn prefix reuse possible
        assert tokenizer.render(CHAT)[:len(tokenizer.render_prefix(CHAT[:2]))] == \
            tokenizer.render_prefix(CHAT[:2])
        assert tokenizer.decode(tokenizer.encode("plain text")) == "plain text"

    def test_concurrent_renders_on_the_pool_agree(self):
        tokenizer = ChatTokenizer(tiny_model())
        chats = [[{"role": "user", "content": f"question {i}: " + "why? " * (200 * i)}]
                 for i in range(6)]

        async def main():
            return await asyncio.gather(*(tokenizer.off_loop(tokenizer.render, c) for c in chats))

        assert asyncio.run(main()) == [tokenizer.render(c) for c in chats]
        tokenizer.close()

    @pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")
    def test_memory_comes_back_after_large_prompts(self):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True,
                             timeout=300, check=True, cwd=REPO)
        growth_mb = float(out.stdout.strip().splitlines()[-1])
        assert growth_mb < 64, f"RSS grew {growth_mb:.0f} MB after three 1 MiB prompts"

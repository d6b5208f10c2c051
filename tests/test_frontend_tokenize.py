"""The frontend tokenizes exactly as the worker's engine renders the chat template."""
import workers  # noqa: F401
from cluster.api.chat import ChatTokenizer
from forged_models import tiny_model
from workers.engine import Engine

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there, café ☕?"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And again"}]


def test_frontend_rendering_matches_the_engine():
    engine = Engine.open(tiny_model())
    tokenizer = ChatTokenizer(tiny_model())
    assert tokenizer.render(CHAT) == engine.render_chat(CHAT)
    assert tokenizer.render_prefix(CHAT[:2]) == engine.render_chat(CHAT[:2],
                                                                   add_generation_prompt=False)
    # a later turn extends an earlier one: what makes multi-turn prefix reuse possible
    assert tokenizer.render(CHAT)[:len(tokenizer.render_prefix(CHAT[:2]))] == \
        tokenizer.render_prefix(CHAT[:2])
    assert tokenizer.decode(tokenizer.encode("plain text")) == "plain text"

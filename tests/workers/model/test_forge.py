"""The model forge: a loadable mlx-lm directory, deterministic, with a real tokenizer."""
from __future__ import annotations

import hashlib
import json

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx_lm

from cluster.cli import main
from tests.support.forged_models import TINY, tiny_model
from workers.model.forge import ForgeSpec, forge


def test_forged_directory_loads_offline_with_mlx_lm():
    path = tiny_model("llama")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    model, tokenizer = mlx_lm.load(str(path))
    assert len(model.layers) == 2
    ids = tokenizer.encode("Hello orchard")
    assert tokenizer.decode(ids).strip() == "Hello orchard"
    assert config["vocab_size"] == 32000


def test_chat_template_renders_turns_as_prefixes():
    _, tokenizer = mlx_lm.load(str(tiny_model("llama")))
    one = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    two = one + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    first = tokenizer.apply_chat_template(one, add_generation_prompt=True)
    second = tokenizer.apply_chat_template(two, add_generation_prompt=True)
    assert second[: len(first)] == first
    assert "[SYSTEM]" in tokenizer.decode(first)


def test_forge_is_deterministic(tmp_path):
    a = forge(tmp_path / "a", ForgeSpec(seed=3, **TINY))
    b = forge(tmp_path / "b", ForgeSpec(seed=3, **TINY))
    c = forge(tmp_path / "c", ForgeSpec(seed=4, **TINY))
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(a) == digest(b) != digest(c)


def test_bad_specs_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="choose one of"):
        forge(tmp_path / "x", ForgeSpec(arch="mamba"))
    with pytest.raises(ValueError, match="kv_heads"):
        forge(tmp_path / "x", ForgeSpec(heads=4, kv_heads=3))
    assert not (tmp_path / "x").exists()


def test_cli_forge(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["model", "forge", "--out", str(out), "--arch", "qwen2", "--layers", "1",
                 "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"]) == 0
    assert "forged qwen2" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert main(["model", "forge", "--out", str(out), "--heads", "3"]) == 2

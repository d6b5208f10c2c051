"""Opening a model directory (``workers.model.model_dir``): what is wrong with an incomplete or
unloadable one, said exactly; an architecture with non-standard caches refused; and the
vocabulary projection of the body (``LoadedModel.head``) equal to the model's output where the
architecture is known to end there."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from tests.support.engine_requests import prompt_of
from tests.support.forged_models import tiny_model
from workers.engine.engine import Engine
from workers.model.model_dir import check_model_dir, open_model_dir


class TestOpening:
    def test_model_directory_errors(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="orchard model forge"):
            Engine.open(tmp_path / "missing")
        broken = tmp_path / "broken"
        shutil.copytree(tiny_model("llama"), broken)
        (broken / "model.safetensors").unlink()
        with pytest.raises(ValueError, match="incomplete: no \\*.safetensors"):
            Engine.open(broken)
        (tmp_path / "odd").mkdir()
        shutil.copy(tiny_model("llama") / "tokenizer.json", tmp_path / "odd")
        shutil.copy(tiny_model("llama") / "model.safetensors", tmp_path / "odd")
        (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
        with pytest.raises(ValueError, match="cannot load"):
            Engine.open(tmp_path / "odd")


    def test_sliding_window_architecture_is_refused(self):
        with pytest.raises(ValueError, match="RotatingKVCache.*standard KVCache"):
            Engine.open(tiny_model("llama", sliding=True))


class TestTheHead:
    @pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
    def test_the_vocabulary_projection_of_the_body_is_the_models_output(self, arch):
        loaded = open_model_dir(tiny_model(arch))
        tokens = mx.array([prompt_of(12, seed=70)])
        whole = loaded.model(tokens)
        assert loaded.head is not None
        assert float(mx.abs(loaded.head(loaded.body(tokens)) - whole).max()) == 0.0
        # an architecture not known to end at the projection: no head, the whole model instead
        other = dataclasses.replace(loaded, config={**loaded.config, "model_type": "gemma3"})
        assert other.head is None


class TestChecking:
    """``check_model_dir`` on directories written by hand: each missing piece named."""

    def _complete(self, path, config: dict | None = None):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
        (path / "model.safetensors").write_bytes(b"")
        (path / "tokenizer.json").write_text("{}")
        return path

    def test_a_complete_directory_gives_its_config(self, tmp_path):
        path = self._complete(tmp_path / "m", {"model_type": "qwen2", "vocab_size": 7})
        assert check_model_dir(path) == {"model_type": "qwen2", "vocab_size": 7}

    @pytest.mark.parametrize("missing, message", [
        ("config.json", "incomplete: config.json is missing"),
        ("model.safetensors", "incomplete: no *.safetensors weights"),
        ("tokenizer.json", "incomplete: no tokenizer (expected one of tokenizer.json, "
                           "tokenizer.model, tokenizer_config.json)")])
    def test_each_missing_piece_is_named(self, tmp_path, missing, message):
        path = self._complete(tmp_path / "m")
        (path / missing).unlink()
        with pytest.raises(ValueError) as refused:
            check_model_dir(path)
        assert str(refused.value) == f"model directory {path} is {message}"

    def test_a_config_without_a_model_type_or_not_json_is_refused(self, tmp_path):
        path = self._complete(tmp_path / "m", {"vocab_size": 7})
        with pytest.raises(ValueError, match="has no model_type: it is not an mlx-lm model"):
            check_model_dir(path)
        (path / "config.json").write_text("{")
        with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
            check_model_dir(path)

    def test_a_missing_directory_says_how_to_make_one(self, tmp_path):
        with pytest.raises(FileNotFoundError) as missing:
            check_model_dir(tmp_path / "none")
        assert str(missing.value) == (
            f"model directory {tmp_path / 'none'} does not exist: pass an mlx-lm model "
            f"directory, or make one with `orchard model forge --out {tmp_path / 'none'}`")

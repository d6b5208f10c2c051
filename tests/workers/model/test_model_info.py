"""What a model directory holds, read without loading it (``workers.model.model_info``): a
directory written by hand (a config, a tokenizer file, safetensors of chosen dtypes and
shapes) gives exact sizes, parameter counts, dtype, quantization and K/V bytes a token;
``list_models`` lists the unreadable ones with their reason."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from workers.model.model_import import PROVENANCE
from workers.model.model_info import ModelInfo, inspect_model, list_models

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "vocab_size": 300, "max_position_embeddings": 512}


def model_dir(path: Path, tensors: dict[str, mx.array], config: dict = CONFIG) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")  # read by nothing here: it only has to exist
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    return path


def float_tensors() -> dict[str, mx.array]:
    return {"model.embed_tokens.weight": mx.zeros((300, 64), mx.float16),
            "model.norm.weight": mx.zeros((64,), mx.float32)}


class TestInspect:
    def test_a_float_directory_exactly(self, tmp_path):
        path = model_dir(tmp_path / "tiny", float_tensors())
        info = inspect_model(path)
        assert info == ModelInfo(
            path=path.resolve(), architecture="llama", layers=2, hidden=64, heads=4,
            kv_heads=2, head_dim=16, intermediate=128, vocab_size=300, max_context=512,
            parameters=300 * 64 + 64, dtype="float16", quantization=None,
            weight_bytes=(path / "model.safetensors").stat().st_size, provenance={})
        # K and V, 2 layers, 2 heads of 16, 2 bytes a value (float16, the most numerous)
        assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2

    def test_packed_weights_count_32_over_bits_values_a_word_and_scales_count_nothing(
            self, tmp_path):
        quantization = {"group_size": 32, "bits": 4,
                        "model.embed_tokens": {"group_size": 32, "bits": 8}}
        tensors = {"model.embed_tokens.weight": mx.zeros((300, 16), mx.uint32),  # 8-bit
                   "model.embed_tokens.scales": mx.zeros((300, 2), mx.float16),
                   "model.embed_tokens.biases": mx.zeros((300, 2), mx.float16),
                   "model.layers.0.mlp.up_proj.weight": mx.zeros((128, 8), mx.uint32),  # 4-bit
                   "model.layers.0.mlp.up_proj.scales": mx.zeros((128, 2), mx.float16),
                   "model.layers.0.mlp.up_proj.biases": mx.zeros((128, 2), mx.float16),
                   "model.norm.weight": mx.zeros((64,), mx.bfloat16)}
        info = inspect_model(model_dir(tmp_path / "q", tensors,
                                       dict(CONFIG, quantization=quantization)))
        assert info.parameters == 300 * 16 * 32 // 8 + 128 * 8 * 32 // 4 + 64
        assert info.quantization == "4-bit, group 32 (model.embed_tokens 8-bit)"
        assert info.dtype == "bfloat16"  # the float16 scales are not the weights' dtype
        assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2

    def test_a_nested_text_config_and_missing_sizes_take_their_defaults(self, tmp_path):
        text = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
                "head_dim": 32}
        info = inspect_model(model_dir(tmp_path / "mm", {"w": mx.zeros((2, 2), mx.float32)},
                                       {"model_type": "gemma3", "text_config": text}))
        assert (info.architecture, info.layers, info.heads, info.kv_heads, info.head_dim) == (
            "gemma3", 3, 4, 4, 32)
        assert (info.intermediate, info.vocab_size, info.max_context) == (0, 0, 0)
        assert (info.dtype, info.parameters) == ("float32", 4)
        assert info.kv_bytes_per_token == 2 * 3 * 4 * 32 * 4

    def test_the_provenance_record_and_the_json_form(self, tmp_path):
        path = model_dir(tmp_path / "tiny", float_tensors())
        (path / PROVENANCE).write_text(json.dumps({"format": "gguf", "source": "/x.gguf"}))
        info = inspect_model(path)
        assert info.provenance == {"format": "gguf", "source": "/x.gguf"}
        as_json = info.as_json()
        assert as_json["path"] == str(path.resolve()) and as_json["kv_bytes_per_token"] == 256
        assert as_json["provenance"] == info.provenance
        assert set(as_json) == {"path", "architecture", "layers", "hidden", "heads",
                                "kv_heads", "head_dim", "intermediate", "vocab_size",
                                "max_context", "parameters", "dtype", "quantization",
                                "weight_bytes", "kv_bytes_per_token", "provenance"}
        json.dumps(as_json)  # plain values only


class TestTruncatedHeaders:
    def test_a_file_without_its_8_byte_length_is_truncated(self, tmp_path):
        path = model_dir(tmp_path / "cut", float_tensors())
        (path / "model.safetensors").write_bytes(b"\x10\0\0")
        with pytest.raises(ValueError, match=r"model\.safetensors is truncated: no "
                                             r"safetensors header$"):
            inspect_model(path)

    def test_a_header_shorter_than_its_length_says_is_cut_short(self, tmp_path):
        path = model_dir(tmp_path / "cut", float_tensors())
        (path / "model.safetensors").write_bytes(struct.pack("<Q", 100) + b"{}")
        with pytest.raises(ValueError, match=r"model\.safetensors is truncated: its "
                                             r"safetensors header is cut short$"):
            inspect_model(path)


class TestListModels:
    def test_every_directory_by_name_the_unreadable_with_their_reason(self, tmp_path):
        model_dir(tmp_path / "b-tiny", float_tensors())
        (tmp_path / "a-broken").mkdir()
        (tmp_path / "a-broken" / "config.json").write_text("{}")
        (tmp_path / ".staging").mkdir()
        (tmp_path / "notes.txt").write_text("not a model")
        broken, tiny = list_models(tmp_path)
        assert broken == (tmp_path / "a-broken", f"model directory {tmp_path / 'a-broken'} "
                                                 f"is incomplete: no *.safetensors weights")
        assert isinstance(tiny, ModelInfo) and tiny.path == (tmp_path / "b-tiny").resolve()

    def test_a_root_that_does_not_exist_lists_nothing(self, tmp_path):
        assert list_models(tmp_path / "none") == []

"""A GGUF file read into an mlx-lm model's parts (``workers.model.gguf_import``): the config
from the ``llama.*`` keys, the weights under mlx-lm's names in Hugging Face row order, the
quantization kept or dequantized; the tensor table read from the header; and each file it
refuses, by what is wrong with it. Whole imports through ``import_model``:
``test_model_import.py``."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType

from tests.support import model_files as mf
from workers.model.gguf_import import _bits, _cast, _tensor_types, read_gguf


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return mf.tiny_weights()


@pytest.fixture(scope="module")
def float_file(tmp_path_factory, weights):
    return mf.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", weights)


def partial_gguf(path, tensors: dict[str, np.ndarray], **keys):
    """A llama GGUF with only ``tensors`` and the ``llama.*`` keys named (writer methods)."""
    writer = GGUFWriter(str(path), "llama")
    for method, value in keys.items():
        getattr(writer, method)(value)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class TestReadGGUF:
    def test_a_float_file_gives_the_config_and_the_weights_that_went_in(self, float_file,
                                                                        weights):
        model = read_gguf(float_file, "float32")
        expected = mf.tiny_config()
        assert model.config == dict(expected, rms_norm_eps=pytest.approx(1e-5))
        assert model.quantization is None
        assert set(model.weights) == set(weights)  # tied embedding: no lm_head
        for name, value in weights.items():  # Q and K rows back in Hugging Face order
            got = model.weights[name]
            assert got.dtype == mx.float32 and np.array_equal(np.array(got), value), name

    def test_a_file_with_its_own_output_tensor_is_untied(self, tmp_path, weights):
        head = np.full((len(mf.vocabulary()), mf.HIDDEN), 0.5, np.float32)
        path = mf.write_gguf(tmp_path / "untied.gguf", dict(weights, **{"lm_head.weight": head}))
        model = read_gguf(path)
        assert model.config["tie_word_embeddings"] is False
        assert np.array_equal(np.array(model.weights["lm_head.weight"]), head)

    def test_float16_casts_every_tensor(self, float_file, weights):
        model = read_gguf(float_file, "float16")
        assert {w.dtype for w in model.weights.values()} == {mx.float16}
        name = "model.layers.1.self_attn.k_proj.weight"
        assert np.array_equal(np.array(model.weights[name]), weights[name].astype(np.float16))

    def test_keep_leaves_each_2d_tensor_quantized_and_the_rest_float16(self, tmp_path,
                                                                        weights):
        model = read_gguf(mf.write_gguf(tmp_path / "q8.gguf", weights, Q.Q8_0), "keep")
        assert model.quantization == {"group_size": 32, "bits": 8}
        name = "model.layers.0.mlp.up_proj"
        assert model.weights[f"{name}.weight"].dtype == mx.uint32
        assert model.weights[f"{name}.weight"].shape == (mf.INTERMEDIATE, mf.HIDDEN * 8 // 32)
        assert model.weights[f"{name}.scales"].shape == (mf.INTERMEDIATE, mf.HIDDEN // 32)
        assert model.weights["model.norm.weight"].dtype == mx.float16

    def test_the_tokenizer_comes_from_the_files_vocabulary(self, float_file):
        tokenizer = read_gguf(float_file).tokenizer
        vocab = mf.vocabulary()
        assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == mf.CONTROL
        assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
        assert tokenizer("is the")["input_ids"] == [vocab.index("is"), vocab.index("Ġthe")]

    def test_an_unknown_dtype_is_refused_naming_the_choices(self, float_file):
        with pytest.raises(ValueError, match=r"^unknown dtype 'int8': choose one of float32, "
                                             r"float16, bfloat16, keep$"):
            read_gguf(float_file, "int8")


class TestTheTensorTable:
    def test_each_tensor_name_with_its_ggml_type(self, tmp_path, weights):
        types = _tensor_types(mf.write_gguf(tmp_path / "q41.gguf", weights, Q.Q4_1))
        assert len(types) == len(weights)
        assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == 3  # Q4_1
        assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == 0  # F32

    def test_a_file_without_the_magic_is_not_gguf(self, tmp_path):
        path = tmp_path / "x.gguf"
        path.write_bytes(b"GGML" + bytes(40))
        with pytest.raises(ValueError, match=r"x\.gguf is not a GGUF file \(no GGUF magic"):
            _tensor_types(path)

    def test_a_version_other_than_2_or_3_is_refused(self, tmp_path):
        path = tmp_path / "v1.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
        with pytest.raises(ValueError, match=r"v1\.gguf: unsupported GGUF version"):
            _tensor_types(path)

    def test_an_unknown_metadata_value_type_is_refused(self, tmp_path):
        path = tmp_path / "odd.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
                         + struct.pack("<I", 77))
        with pytest.raises(ValueError, match=r"unknown GGUF metadata value type 77"):
            _tensor_types(path)

    def test_a_huge_string_length_is_a_truncated_header_not_a_huge_read(self, tmp_path):
        path = tmp_path / "cut.gguf"
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 60))
        with pytest.raises(ValueError, match=r"cut\.gguf is truncated: its GGUF header is cut "
                                             r"short"):
            _tensor_types(path)


class TestIncompleteFiles:
    def test_a_file_without_the_embedding_tensor(self, tmp_path):
        path = partial_gguf(tmp_path / "e.gguf", {"output.weight": np.zeros((8, 4), np.float32)})
        with pytest.raises(ValueError, match=r"e\.gguf has no token_embd\.weight tensor"):
            read_gguf(path)

    def test_a_missing_hyperparameter_is_named(self, tmp_path):
        path = partial_gguf(tmp_path / "h.gguf",
                            {"token_embd.weight": np.zeros((8, 4), np.float32)})
        with pytest.raises(ValueError, match=r"h\.gguf has no llama\.embedding_length in its "
                                             r"metadata"):
            read_gguf(path)

    def test_rope_scaling_is_refused(self, tmp_path):
        path = partial_gguf(tmp_path / "r.gguf",
                            {"token_embd.weight": np.zeros((8, 4), np.float32)},
                            add_embedding_length=4, add_head_count=1,
                            add_rope_scaling_type=RopeScalingType.LINEAR)
        with pytest.raises(ValueError, match=r"r\.gguf uses rope scaling"):
            read_gguf(path)


class TestQuantizedLayers:
    def test_the_bit_width_follows_from_the_packed_width(self, tmp_path):
        w, scales, _ = mx.quantize(mx.zeros((4, 64)), group_size=32, bits=4)
        assert (w.shape, scales.shape) == ((4, 8), (4, 2))
        assert _bits(tmp_path, "w", w, scales) == 4
        with pytest.raises(ValueError, match=r"tensor w has a packed width \(7 words for 64 "
                                             r"columns\) that is no MLX quantization"):
            _bits(tmp_path, "w", w[:, :7], scales)

    def test_keep_names_the_commonest_width_and_each_layer_that_differs(self, tmp_path):
        tensors = {}
        for stem, bits in (("a", 4), ("b", 4), ("embed", 8)):
            w, scales, biases = mx.quantize(mx.ones((4, 64)), group_size=32, bits=bits)
            tensors.update({f"{stem}.weight": w, f"{stem}.scales": scales,
                            f"{stem}.biases": biases})
        tensors["norm.weight"] = mx.ones((64,), mx.float32)
        kept, quantization = _cast(tmp_path, tensors, "keep")
        assert quantization == {"group_size": 32, "bits": 4,
                                "embed": {"group_size": 32, "bits": 8}}
        assert set(kept) == set(tensors) and kept["norm.weight"].dtype == mx.float16
        plain, none = _cast(tmp_path, tensors, "float32")
        assert none is None and set(plain) == {"a.weight", "b.weight", "embed.weight",
                                               "norm.weight"}
        assert np.allclose(np.array(plain["embed.weight"]), 1.0, atol=1e-2)

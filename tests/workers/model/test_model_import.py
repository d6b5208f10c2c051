"""``orchard model import``: GGUF files and Hugging Face directories written by the tests
themselves become mlx-lm directories whose logits are those of the weights that went in; bad
inputs get an error naming the file, and leave nothing in ``--out``."""
from __future__ import annotations

import json

import numpy as np
import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from gguf import GGMLQuantizationType as Q
from mlx_lm import load as mlx_load
from mlx_lm.utils import _get_classes

from cluster.cli import main
from tests.support import model_files as mf
from workers.model.model_import import PROVENANCE, import_model

PROMPT = [5, 70, 120, 33, 200, 7, 1, 90, 44, 3]


def reference_logits(weights: dict[str, np.ndarray]) -> np.ndarray:
    config = mf.tiny_config()
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return np.array(model(mx.array([PROMPT]))[0])


def imported_logits(path) -> np.ndarray:
    model, _ = mlx_load(str(path))
    return np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))


def assert_nothing_left(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.import-")]


@pytest.fixture(scope="module")
def weights():
    return mf.tiny_weights()


def test_float_gguf_imports_with_the_weights_that_went_in(tmp_path, weights):
    src = mf.write_gguf(tmp_path / "tiny-f32.gguf", weights)
    out = import_model(src, tmp_path / "tiny", "float32")
    diff = np.abs(imported_logits(out) - reference_logits(weights)).max()
    assert diff < 1e-5, f"logits differ by {diff}: Q/K rows or names mapped wrongly"
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is True and "quantization" not in config
    record = json.loads((out / PROVENANCE).read_text())
    assert record["format"] == "gguf" and record["source_bytes"] == src.stat().st_size


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_1, Q.Q4_0])
def test_quantized_gguf_dequantizes_to_the_same_values_as_ggml(tmp_path, weights, kind):
    src = mf.write_gguf(tmp_path / f"tiny-{kind.name}.gguf", weights, kind)
    out = import_model(src, tmp_path / "tiny", "float32")
    expected = reference_logits(mf.quantized_reference(weights, kind))
    assert np.abs(imported_logits(out) - expected).max() < 1e-4


def test_keep_leaves_the_layers_quantized(tmp_path, weights):
    src = mf.write_gguf(tmp_path / "tiny-q8.gguf", weights, Q.Q8_0)
    out = import_model(src, tmp_path / "tiny", "keep")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8}
    expected = reference_logits(mf.quantized_reference(weights, Q.Q8_0))
    got = imported_logits(out)
    # The whole model computes in float16 (the scales' dtype): about 1% at logits near 1.
    assert np.abs(got - expected).max() < 2e-2
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_gguf_tokenizer_and_chat_template_come_across(tmp_path, weights):
    from transformers import AutoTokenizer

    out = import_model(mf.write_gguf(tmp_path / "t.gguf", weights), tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    vocab = mf.vocabulary()
    text = "is the theme"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert vocab.index("Ġthe") in ids and vocab.index("is") in ids  # merges applied
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert rendered.count(vocab.index("<|im_start|>")) == 2  # control tokens stay whole
    pieces = ["<|im_start|>", *"user", "Ċ", *"hi", "<|im_end|>", "Ċ", "<|im_start|>",
              *"ass", "is", *"tant", "Ċ"]  # Ċ: the byte-level symbol of a newline
    assert rendered == [vocab.index(p) for p in pieces]


def test_hugging_face_directory_imports_through_mlx_lm(tmp_path, weights):
    src = mf.write_hf_dir(tmp_path / "hf", weights)
    out = import_model(src, tmp_path / "tiny", "float16")
    assert np.abs(imported_logits(out) - reference_logits(weights)).max() < 5e-3
    assert json.loads((out / PROVENANCE).read_text())["format"] == "safetensors"
    header = (out / "model.safetensors").read_bytes()[:4096]
    assert b'"F16"' in header and b'"F32"' not in header


def test_cli_import_then_inspect(tmp_path, weights, capsys):
    src = mf.write_gguf(tmp_path / "t.gguf", weights, Q.Q4_1)
    out = tmp_path / "tiny"
    assert main(["model", "import", str(src), "--out", str(out), "--dtype", "keep"]) == 0
    assert main(["model", "inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert info["architecture"] == "llama" and info["layers"] == 2
    assert info["quantization"] == "4-bit, group 32"
    assert info["dtype"] == "float16"  # scales and norms; K/V follow the activations
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert info["parameters"] == sum(v.size for v in weights.values())
    assert info["provenance"]["source"] == str(src)


# --- bad input: an error naming the file, nothing left in --out -------------------------------

def test_unsupported_architecture(tmp_path, weights):
    src = mf.write_gguf(tmp_path / "m.gguf", weights, arch="mamba")
    with pytest.raises(ValueError, match=r"m\.gguf: architecture 'mamba' is not supported"):
        import_model(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_unsupported_quantization_type(tmp_path, weights):
    src = mf.write_gguf(tmp_path / "q5.gguf", weights, Q.Q5_0)
    with pytest.raises(ValueError, match=r"q5\.gguf: tensor .* quantization type Q5_0"):
        import_model(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_truncated_file(tmp_path, weights):
    src = mf.write_gguf(tmp_path / "cut.gguf", weights)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"cut\.gguf .*truncated"):
        import_model(src, tmp_path / "out")
    src.write_bytes(data[:100])  # cut inside the header
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated"):
        import_model(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_directory_missing_its_tokenizer(tmp_path, weights):
    src = mf.write_hf_dir(tmp_path / "hf", weights, tokenizer=False)
    with pytest.raises(ValueError, match=r"hf is missing its tokenizer"):
        import_model(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_chat_template_that_fails_to_render(tmp_path, weights):
    bad = "{% for m in messages %}{{ raise_exception('roles must alternate') }}{% endfor %}"
    src = mf.write_gguf(tmp_path / "tpl.gguf", weights, chat_template=bad)
    with pytest.raises(ValueError, match=r"tpl\.gguf: its chat template fails to render"):
        import_model(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_a_failed_import_leaves_the_previous_directory(tmp_path, weights):
    out = import_model(mf.write_gguf(tmp_path / "good.gguf", weights), tmp_path / "tiny")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError):
        import_model(mf.write_gguf(tmp_path / "m.gguf", weights, arch="mamba"), out)
    assert (out / "model.safetensors").read_bytes() == before


def test_cli_reports_bad_input_with_exit_code_2(tmp_path, capsys):
    assert main(["model", "import", str(tmp_path / "nope.gguf"), "--out",
                 str(tmp_path / "o")]) == 2
    assert "nope.gguf does not exist" in capsys.readouterr().err


def test_hugging_face_directory_of_an_unknown_architecture(tmp_path, weights):
    src = mf.write_hf_dir(tmp_path / "hf", weights)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, model_type="nosuchmodel")))
    with pytest.raises(ValueError, match=r"hf: mlx-lm cannot convert this model "
                                         r"\(model_type 'nosuchmodel'\)"):
        import_model(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")

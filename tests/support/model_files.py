"""Factories for the model-import tests: a tiny llama written as GGUF (with the ``gguf``
package, laid out the way llama.cpp's converter lays it out) and as a Hugging Face directory.

Both carry the same random weights (``tiny_weights``, Hugging Face names and row order) and the
same byte-level BPE tokenizer: the 256 byte symbols, a few merges and three control tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ a"]
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS


def vocabulary() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = CONTROL + list(bytes_to_unicode().values())
    return tokens + ["".join(m.split(" ")) for m in MERGES]


def tiny_config() -> dict:
    return {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 512,
            "vocab_size": len(vocabulary()), "tie_word_embeddings": True,
            "bos_token_id": 0, "eos_token_id": 2}


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under mlx-lm's names, in Hugging Face row order."""
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary())

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab, HIDDEN),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": mat(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": mat(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": mat(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": mat(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32)})
    return w


def quantized_reference(weights: dict[str, np.ndarray], kind) -> dict[str, np.ndarray]:
    """What the weights become after a round trip through GGML quantization ``kind``."""
    from gguf import quants

    return {k: quants.dequantize(quants.quantize(v, kind), kind) if v.ndim == 2 else v
            for k, v in weights.items()}


def write_gguf(path: Path, weights: dict[str, np.ndarray], kind=None, arch: str = "llama",
               chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write ``weights`` as llama.cpp does: GGUF names, Q and K rows permuted, 2-D tensors
    quantized to ``kind`` (a ``gguf.GGMLQuantizationType``) or float32 when ``kind`` is None."""
    from gguf import GGUFWriter, quants
    from mlx_lm.gguf import permute_weights, translate_weight_names

    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    tokens = vocabulary()
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in CONTROL else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)
    for name, value in weights.items():
        if ".q_proj." in name:
            value = np.asarray(permute_weights(value, HEADS))
        elif ".k_proj." in name:
            value = np.asarray(permute_weights(value, HEADS, KV_HEADS))
        gguf_name = translate_weight_names(name)
        if kind is not None and value.ndim == 2:
            writer.add_tensor(gguf_name, quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_tokenizer():
    """The same tokenizer as a Hugging Face fast tokenizer (for the Hugging Face directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(vocabulary())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in MERGES]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=CONTROL[0],
                                        eos_token=CONTROL[2])
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL[1:2]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_hf_dir(path: Path, weights: dict[str, np.ndarray], tokenizer: bool = True) -> Path:
    """A Hugging Face safetensors directory: config.json, model.safetensors, tokenizer files."""
    import mlx.core as mx

    path.mkdir(parents=True)
    config = dict(tiny_config(), architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights.items()}, metadata={"format": "pt"})
    if tokenizer:
        byte_level_tokenizer().save_pretrained(str(path))
    return path

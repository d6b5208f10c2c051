"""Forge a local mlx-lm model directory: random float32 weights, a real tokenizer, a chat template.

No model hub is reachable where orchard runs its demo and tests, so orchard makes its own model:
an mlx-lm architecture (llama, mistral, qwen2, qwen3) instantiated from a deterministic seed,
saved as ``config.json`` + ``model.safetensors``, with mistral-common's 32k SentencePiece
tokenizer (``tokenizer.model.v1``) converted to a Hugging Face ``tokenizer.json`` and a
role-tagged chat template. ``mlx_lm.load(DIR)`` loads the result offline, like any other model
directory. The weights are random, so the text is gibberish, but every tensor shape, the
attention (grouped-query, rotary) and the K/V cache are those of a real model.

Forged models serve tests and shape experiments (any size, any of the four architectures, in
well under a second of prefill); the embedded default is a real model (``workers.model.default_model``).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# A chat template whose rendering of turn k is a prefix of the rendering of turn k+1, so a
# multi-turn conversation can reuse the previous turn's blocks.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '[' + message['role'] | upper + ']\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[ASSISTANT]\n' }}{% endif %}"
)

# The same turns, plus tools in the JSON tool-call style (``<tool_call>`` around a JSON object
# with ``name`` and ``arguments``: mlx-lm's ``json_tools`` parser): the functions offered are
# listed in the system turn, an assistant's calls are rendered as the model would write them,
# and a tool's result is a turn of its own. Prefix-stable like the plain template.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '[TOOLS]\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}"
    "{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{{ '[' + message['role'] | upper + ']\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for tool_call in message['tool_calls'] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{ tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}"
    "{{ '}\n</tool_call>' }}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[ASSISTANT]\n' }}{% endif %}"
)
TEMPLATES = {"plain": CHAT_TEMPLATE, "tools": TOOLS_CHAT_TEMPLATE}

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ForgeSpec:
    """The size of a forged model. The default prefills 1,000 tokens well under a second."""

    arch: str = "llama"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    max_context: int = 4096
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # raw config.json overrides
    template: str = "plain"  # the chat template: "plain", or "tools" (renders tool calls)

    def config(self, vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"cannot forge architecture {self.arch!r}: choose one of {', '.join(ARCHITECTURES)}")
        if self.layers <= 0 or self.hidden <= 0 or self.heads <= 0 or self.kv_heads <= 0:
            raise ValueError("layers, hidden, heads and kv_heads must all be positive")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must divide by heads ({self.heads}) and heads by "
                f"kv_heads ({self.kv_heads}): pick e.g. --hidden 256 --heads 4 --kv-heads 2")
        config = {
            "model_type": self.arch,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden // self.heads,
            "rms_norm_eps": 1e-5,
            "vocab_size": vocab_size,
            "max_position_embeddings": self.max_context,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,  # a separate random head: varied greedy tokens
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "float32",
            "orchard_forge": {"seed": self.seed},
        }
        config.update(self.extra)
        return config


def _spm_path() -> Path:
    import mistral_common

    path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall mistral-common (pip install mistral-common)")
    return path


def _write_tokenizer(out: Path, template: str = "plain") -> tuple[int, int, int]:
    """Write tokenizer files into ``out``; return (vocab size, bos id, eos id)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(_spm_path(), Path(tmp) / "tokenizer.model")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False}))
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}: choose one of "
                         f"{', '.join(TEMPLATES)}")
    tokenizer.chat_template = TEMPLATES[template]
    tokenizer.save_pretrained(str(out))
    return len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id


def _write_weights(out: Path, config: dict[str, Any], seed: int) -> None:
    import workers  # noqa: F401  (OpenBLAS before mlx)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def forge(out: Path | str, spec: ForgeSpec | None = None) -> Path:
    """Write a complete model directory to ``out`` (replacing it atomically); return its path."""
    spec = spec or ForgeSpec()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".forge-", dir=out.parent))
    try:
        vocab, bos, eos = _write_tokenizer(staging, spec.template)
        config = spec.config(vocab, bos, eos)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_weights(staging, config, spec.seed)
        (staging / "orchard-forge.json").write_text(
            json.dumps(asdict(spec), indent=2, default=str) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out

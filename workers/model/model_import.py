"""Import a model into an mlx-lm directory orchard can serve: from GGUF or a Hugging Face dir.

``import_model(SRC, OUT, dtype)`` accepts

- a GGUF file of a llama-family model (``workers.model.gguf_import`` reads it), or
- a Hugging Face safetensors directory (``config.json``, ``*.safetensors``, a tokenizer), which
  mlx-lm's own converter (``mlx_lm.convert.convert``) turns into an MLX directory.

Every import is written to a temporary directory next to ``OUT`` and renamed into place only
once it is complete and checked: the chat template renders a short conversation, and
``open_model_dir`` loads it (mlx-lm, standard K/V caches). A failure leaves ``OUT`` untouched.
The directory records where it came from in ``orchard-model.json`` (``PROVENANCE``): the
source path, its size and xxh3 hash, the format, the dtype, and the package it was shipped in.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import xxhash

from workers.model.gguf_import import DTYPES

PROVENANCE = "orchard-model.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_PROBE = [{"role": "system", "content": "You are brief."},
          {"role": "user", "content": "Hello"},
          {"role": "assistant", "content": "Hi."},
          {"role": "user", "content": "What is 2 + 2?"}]


def import_model(src: Path | str, out: Path | str, dtype: str = "float32",
                 shipped_in: str | None = None) -> Path:
    """Write the mlx-lm directory for ``src`` at ``out`` (replacing it atomically)."""
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist: pass a .gguf file or a Hugging Face "
                                f"model directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        if src.is_dir():
            fmt, template_source = "safetensors", _import_hf(src, staging, dtype)
        else:
            fmt, template_source = "gguf", _import_gguf(src, staging, dtype)
        _check_chat_template(staging, template_source)
        _check_loads(staging, src)
        _write_provenance(staging, src, fmt, dtype, shipped_in)
        staging.chmod(0o755)  # mkdtemp makes it private; a model directory is not
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def _import_gguf(src: Path, staging: Path, dtype: str) -> Path:
    import mlx.core as mx

    from workers.model.gguf_import import read_gguf

    model = read_gguf(src, dtype)
    config = dict(model.config)
    if model.quantization:
        config["quantization"] = model.quantization
    config["torch_dtype"] = dtype if dtype != "keep" else "float16"
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(staging / "model.safetensors"), model.weights,
                        metadata={"format": "mlx"})
    model.tokenizer.save_pretrained(str(staging))
    return src


def _import_hf(src: Path, staging: Path, dtype: str) -> Path:
    """mlx-lm's converter, after the checks that make its errors readable."""
    from mlx_lm.convert import convert

    config_file = src / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{src} has no config.json: it is not a Hugging Face model directory")
    if not list(src.glob("*.safetensors")):
        raise ValueError(f"{src} has no *.safetensors weights (convert .bin checkpoints to "
                         f"safetensors first)")
    if not any((src / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{src} is missing its tokenizer: expected tokenizer.json or "
                         f"tokenizer.model next to config.json")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
    target = staging / "model"  # mlx-lm refuses to write into an existing directory
    try:
        convert(str(src), mlx_path=str(target), dtype=None if dtype == "keep" else dtype)
    except ValueError as exc:
        raise ValueError(f"{src}: mlx-lm cannot convert this model "
                         f"(model_type {model_type!r}): {exc}") from None
    for item in target.iterdir():
        item.rename(staging / item.name)
    target.rmdir()
    return src / "tokenizer_config.json"


def _check_chat_template(staging: Path, source: Path) -> None:
    """Render a short conversation; name the source file when the template is missing or fails."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(staging), local_files_only=True)
    if not tokenizer.chat_template:
        raise ValueError(f"{source} has no chat template: orchard serves chat requests, so the "
                         f"model needs one (add chat_template to its tokenizer_config.json)")
    try:
        text = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 raises its own classes, and templates call raise_exception
        raise ValueError(f"{source}: its chat template fails to render a conversation "
                         f"(system, user, assistant, user): {type(exc).__name__}: {exc}") from None
    if "What is 2 + 2?" not in text:
        raise ValueError(f"{source}: its chat template drops the messages (the last user "
                         f"message is not in the rendered prompt)")


def _check_loads(staging: Path, src: Path) -> None:
    from workers.model.model_dir import open_model_dir

    try:
        open_model_dir(staging)
    except ValueError as exc:
        raise ValueError(f"{src}: the imported directory does not load: {exc}") from None


def _write_provenance(staging: Path, src: Path, fmt: str, dtype: str,
                      shipped_in: str | None) -> None:
    record: dict[str, Any] = {"source": str(src.resolve()), "format": fmt, "dtype": dtype}
    files = [src] if src.is_file() else sorted(src.glob("*.safetensors"))
    digest = xxhash.xxh3_64()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    record["source_bytes"] = sum(f.stat().st_size for f in files)
    record["source_xxh3"] = digest.hexdigest()
    if shipped_in:
        record["shipped_in"] = shipped_in
    (staging / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")


def read_provenance(path: Path) -> dict[str, Any]:
    """Where the model directory ``path`` came from, as recorded at import (or forge) time."""
    record = path / PROVENANCE
    if record.is_file():
        return json.loads(record.read_text())
    forged = path / "orchard-forge.json"
    if forged.is_file():
        return {"format": "forged (random weights)", **json.loads(forged.read_text())}
    return {}

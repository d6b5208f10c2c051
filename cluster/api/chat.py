"""Tokenization at the frontend: chat messages through the model's own chat template.

The frontend tokenizes before a request is routed (a job's requests when they are dispatched,
``cluster.api.intake.prepare``), so that validation (vocabulary, context length) and the cache
key (block hashes of the token ids) see exactly the tokens the worker will prefill. The tokenizer and template come from the model directory, the same files
``mlx_lm.load`` reads on the workers.

Tokenizing is CPU-heavy (about 4 s for 1 MiB of text with the forged model's tokenizer on one
core), so the frontend never does it on its event loop: ``off_loop`` runs validation and
tokenization on a small thread pool. No lock is shared with the loop. The chat template is
rendered to text (Jinja, read-only) and encoded by a ``tokenizers.Tokenizer`` of its own that
only ever encodes: concurrent encodes borrow it shared, and ``encode_batch`` releases the GIL
while Rust encodes (plain ``encode`` holds it throughout: the loop stalled 8.9 s behind two
1 MiB prompts), so the loop keeps serving while a pool thread encodes. (Hugging Face's wrapper re-applies
truncation and padding settings on every call, a mutable borrow, which is why two threads
calling it at once fail with "Already borrowed"; only ``decode`` goes through it here.)

Memory: encoding 4 MiB of text allocates a few hundred MB of temporaries in the encoding
thread's malloc arena, which glibc keeps after they are freed: RSS went from 164 MB to 468 MB
after three 4 MiB prompts, and back to 212 MB after ``malloc_trim``. After a large encode the
pool thread trims the heap, where the C library offers it: three 1 MiB prompts now leave RSS
10 MB above where it started (142 MB before), three 4 MiB ones 17 to 36 MB (195 MB before).
The encoder's own copy of the tokenizer costs about 38 MB once.

``token_bytes`` gives each token's own UTF-8 bytes (log-probabilities show them, and a token may
hold part of a character), read from the grammar library's view of the same tokenizer
(``llguidance``, which the constraints already use), made on first use.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

POOL_THREADS = 2          # two big prompts at once still leave the loop free
TRIM_AFTER_CHARS = 64 << 10  # trim the heap after encoding this much text


def _malloc_trim() -> Callable[[], None]:
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:  # not glibc (macOS): its allocator returns freed memory by itself
        return lambda: None
    return lambda: trim(0)


class ChatTokenizer:
    def __init__(self, model_dir: str | Path, threads: int = POOL_THREADS):
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer  # heavy import, paid once per frontend

        path = Path(model_dir)
        if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path} has no tokenizer files: point [model] dir at an "
                                    "mlx-lm model directory")
        self._tok = AutoTokenizer.from_pretrained(str(path))
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(f"{path}: the tokenizer has no chat template; "
                             "send token ids instead of messages")
        self._encoder = Tokenizer.from_str(self._tok.backend_tokenizer.to_str())
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._trim = _malloc_trim()
        self._bytes = None  # llguidance's tokenizer, for token_bytes (made on first use)

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the tokenizer's thread pool (validation that tokenizes)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None
               ) -> list[int]:
        """Token ids of ``messages`` under the chat template, ready for the assistant's turn;
        ``tools`` (OpenAI function specs) rendered as the template renders them."""
        return self._apply(messages, True, tools)

    def render_prefix(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None
                      ) -> list[int]:
        """Token ids of ``messages`` as the start of a longer conversation (no turn opened)."""
        return self._apply(messages, False, tools)

    def _apply(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict] | None) -> list[int]:
        extra = {} if tools is None else {"tools": tools}
        text = self._tok.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes (a piece of UTF-8 text, possibly part of a character)."""
        if self._bytes is None:
            import llguidance.hf

            self._bytes = llguidance.hf.from_tokenizer(self._tok)
        return [self._bytes.decode_bytes([t]) for t in token_ids]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the chat template's output is encoded (no special tokens
        added: the template writes its own)."""
        # encode_batch releases the GIL while Rust encodes (encode holds it throughout)
        ids = self._encoder.encode_batch([text], add_special_tokens=False)[0].ids
        if len(text) >= TRIM_AFTER_CHARS:
            self._trim()
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids))

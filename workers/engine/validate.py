"""What a request must be for an engine to run it: ``check_request`` raises ``ValueError``
saying what to fix, before anything is queued (``Engine.submit``), so the other requests are
untouched. The engine adds the one check that needs its state: a request id already running."""
from __future__ import annotations

from router.kv.key import Namespace
from workers.messages import GenerateRequest


def check_request(req: GenerateRequest, vocab_size: int, max_context: int,
                  cache_secret: bytes) -> None:
    """Raise ``ValueError`` saying what to fix when ``req`` cannot run on this model."""
    s = req.sampling
    if not isinstance(req.namespace, Namespace):
        raise ValueError(f"request {req.request_id}: namespace must be a router.kv.key.Namespace")
    if req.namespace.secret != cache_secret:
        raise ValueError(f"request {req.request_id}: its namespace is hashed with another "
                         "cache secret than this worker's; start workers from the cluster "
                         "that routes to them")
    if not req.prompt:
        raise ValueError(f"request {req.request_id}: the prompt is empty; send at least one token")
    bad = next((t for t in req.prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"request {req.request_id}: token id {bad} is outside the vocabulary "
            f"[0, {vocab_size}); tokenize with this model's tokenizer")
    if s.max_tokens <= 0:
        raise ValueError(f"request {req.request_id}: max_tokens must be >= 1, got {s.max_tokens}")
    if len(req.prompt) + s.max_tokens > max_context:
        raise ValueError(
            f"request {req.request_id}: prompt ({len(req.prompt)} tokens) plus max_tokens "
            f"({s.max_tokens}) exceeds the model's context of {max_context}; "
            f"shorten the prompt or lower max_tokens")
    if s.temperature < 0 or not 0 < s.top_p <= 1:
        raise ValueError(
            f"request {req.request_id}: need temperature >= 0 and 0 < top_p <= 1, "
            f"got {s.temperature} and {s.top_p}")

"""The engine: batching, prefill, decode, the engine thread and kept caches."""

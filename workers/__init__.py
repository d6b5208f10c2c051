"""The MLX worker: model loading, the prefix store, batching, generation and KV events.

Importing this package first loads OpenBLAS on Linux (see ``workers.blas``), so that every
process that runs MLX through orchard uses it, Ray actor processes included.
"""
from workers.blas import ensure_openblas

ensure_openblas()

"""Shared pytest set-up: the project root on sys.path, and OpenBLAS before any MLX import."""
import workers  # noqa: F401  (loads OpenBLAS before mlx on Linux)

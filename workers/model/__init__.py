"""Model files: opening, inspecting, importing and forging mlx-lm model directories."""

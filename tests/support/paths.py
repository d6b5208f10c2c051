"""Where things are, for tests wherever they sit under tests/."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository's root

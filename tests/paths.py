"""Where things are, for every test: the repository root and its recipes. `tests/` is on sys.path."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
TINY_RECIPE = RECIPES / "tiny-cpu.yaml"

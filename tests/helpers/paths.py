"""Paths the tests share: the repository root, the default tiny recipe and the loop tests' variant."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = ROOT / "recipes" / "tiny-addition.yaml"
"""The embedded default (tiny model, addition task): what `make run` trains."""
TINY_RECIPE = ROOT / "tests" / "recipes" / "tiny-addition-loop.yaml"
"""The default with the RL schedule the integration and vLLM tiers count on (its header says why)."""

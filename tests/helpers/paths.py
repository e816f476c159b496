"""Paths the tests share: the repository root and the default tiny recipe."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_RECIPE = ROOT / "recipes" / "tiny-addition.yaml"
"""The default recipe (tiny model, addition task) the integration and vLLM tiers run."""

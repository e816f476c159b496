"""KV-scale sync: FP8 KV-cache scales recomputed from the policy at every refit.

Owns: the calibration data (a bounded window of the sequences the engine finished most
recently; before any has finished, a fixed, seeded set of random sequences), the calibration
pass (the model's keys and values over it, `CausalLM.kv_amax`), and the rule from maxima to
scales, scale[layer, kv_head] = max(amax * margin, tiny) / 448 (the largest calibration value
lands at 448 / margin in e4m3: the amax scaling of Micikevicius et al. 2022, "FP8 Formats for
Deep Learning", per head). Recalibrated after every refit, because the keys' range moves with
the weights; a caller may hand in scales computed elsewhere instead.

Does not own: quantisation itself and re-encoding of cached entries (kv_cache.py), or when
to calibrate (engine.py).

Read more: docs/generation.md, "FP8 KV cache and KV-scale sync".
"""

from __future__ import annotations

from collections import deque

import torch

from rl_core.generation.native.kv_cache import FP8_E4M3_MAX
from rl_core.generation.native.model import CausalLM

MIN_SCALE = 1e-8  # keeps a scale positive when a head's keys/values are all zero


class KVScaleSync:
    """Recent sequences and the calibration pass that turns them into FP8 KV scales."""

    def __init__(self, model: CausalLM, margin: float = 2.0, max_tokens: int = 8192, max_sequences: int = 64,
                 seed: int = 0):
        if margin < 1.0:
            raise ValueError(f"kv_scale_margin is {margin}; it must be >= 1 (1 = no headroom above the "
                             "calibration maximum).")
        self.model = model
        self.margin = margin
        self.max_tokens = max_tokens
        self.window: deque[list[int]] = deque(maxlen=max_sequences)
        self.seed = seed
        self.calibrations = 0
        self.last_num_tokens = 0

    def observe(self, ids: list[int]) -> None:
        """Remember one finished sequence (prompt + completion) for the next calibration."""
        if len(ids) < 2:
            return
        self.window.append(list(ids[: self.model.max_positions]))
        while sum(map(len, self.window)) > self.max_tokens and len(self.window) > 1:
            self.window.popleft()

    def sequences(self) -> list[list[int]]:
        """The calibration data: the window, or seeded random tokens while it is empty."""
        if self.window:
            return list(self.window)
        gen = torch.Generator().manual_seed(self.seed)
        length = min(64, self.model.max_positions)
        return torch.randint(0, self.model.spec.vocab_size, (8, length), generator=gen).tolist()

    @torch.no_grad()
    def calibrate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale) [layers, kv_heads], float32, from the current weights."""
        sequences = self.sequences()
        k_amax, v_amax = self.model.kv_amax(sequences)
        self.calibrations += 1
        self.last_num_tokens = sum(map(len, sequences))
        return scales_from_amax(k_amax, self.margin), scales_from_amax(v_amax, self.margin)


def scales_from_amax(amax: torch.Tensor, margin: float) -> torch.Tensor:
    return (amax.float() * margin).clamp(min=MIN_SCALE) / FP8_E4M3_MAX

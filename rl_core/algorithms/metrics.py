"""Metric pairs of losses and estimators, and how they reduce across chunks.

Owns: the one convention every `LossOutput.metrics` entry (and every metric dict returned
by the functions of `rl_core.algorithms`) follows, and the two helpers that apply it: a
metric is a pair `(sum, count)`; a step reports `total sum / total count` (0 when the count
is 0), except names ending in `_min` / `_max`, which report the extreme of `sum / count` over
the chunks with count > 0. Extremes are emitted as `(value, 1.0)` (or `(0.0, 0.0)` for a
chunk without a valid element), so a reducer unaware of the convention still reports the
mean of the per-chunk extremes, not garbage.

Does not own: where metrics are logged (the train pump) or their names' prefixes.

Read more: docs/algorithms.md, "Policy losses" (metric pairs).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

Pair = tuple[float, float]


def reduce_kind(name: str) -> str:
    """`min`, `max` or `mean`: how the metric `name` reduces across chunks."""
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "mean"


def merge_metrics(acc: dict[str, list[float]], new: Mapping[str, Pair]) -> None:
    """Fold one chunk's pairs into the accumulator `acc` (name -> [sum, count]) in place."""
    for name, (s, c) in new.items():
        kind = reduce_kind(name)
        cur = acc.get(name)
        if cur is None:
            acc[name] = [float(s), float(c)]
            continue
        if kind == "mean":
            cur[0] += float(s)
            cur[1] += float(c)
            continue
        if c <= 0:
            continue
        value = float(s) / float(c)
        if cur[1] <= 0:
            acc[name] = [value, 1.0]
            continue
        old = cur[0] / cur[1]
        acc[name] = [min(old, value) if kind == "min" else max(old, value), 1.0]


def finalize_metrics(acc: Mapping[str, list[float] | Pair]) -> dict[str, float]:
    """The reported value of every accumulated metric (see the module docstring)."""
    return {name: (s / c if c else 0.0) for name, (s, c) in acc.items()}


def masked_sum_pair(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of x over mask, number of mask elements) as 0-dim tensors (no device sync)."""
    m = mask.to(x.dtype) if x.is_floating_point() else mask
    return (x.detach() * m).sum(), mask.sum()


def masked_extreme_pair(x: torch.Tensor, mask: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(min or max of x over mask > 0, 1) as 0-dim tensors, or (0, 0) when the mask is empty (no device sync)."""
    x = x.detach()
    valid = mask > 0
    fill = torch.full_like(x, math.inf if kind == "min" else -math.inf)
    sel = torch.where(valid, x, fill)
    value = sel.min() if kind == "min" else sel.max()
    has = valid.any()
    return torch.where(has, value, torch.zeros_like(value)), has.to(x.dtype)


def pairs_to_floats(metrics: Mapping[str, tuple]) -> dict[str, Pair]:
    """Tensor (or float) pairs -> float pairs, with one device-to-host transfer for all of them."""
    names = list(metrics)
    flat = []
    for n in names:
        for v in metrics[n]:
            flat.append(v.detach().to(torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                        else torch.tensor(float(v), dtype=torch.float64))
    if not flat:
        return {}
    devices = {t.device for t in flat}
    if len(devices) > 1:
        flat = [t.cpu() for t in flat]
    values = torch.stack(flat).tolist()
    return {n: (values[2 * i], values[2 * i + 1]) for i, n in enumerate(names)}

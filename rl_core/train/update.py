"""The one update rule every trainer applies at the end of a step.

Owns: dividing the step's summed gradients by its total normalizer (tokens, sequences or
whatever the loss's reduction counts), clipping by global norm (none = no limit), refusing
a non-finite norm (`FloatingPointError`, the controller's retry signal), the optimizer step,
and the metrics `grad_norm`, `loss` (the step's mean) and `skipped_update` (1 when nothing
had a gradient). `apply_update` takes the three actions as callables so the torch trainer,
the critic and the data-parallel backends (FSDP2 scaling, Megatron's optimizer) share the
rule; `local_update` is it for a plain module and a torch optimizer; `scheduled_lr`, the
rate of each RL step (`trainer.lr_schedule`). Also a step's sums until `finish` (`StepSums`,
every trainer), and what the one-process trainers share: `local_microbatches` (token budgets,
packing: `chunk_rows`, `rows_in_order`) and `LocalStep` (open/abort, update, checkpoint state).
Does not own: the forward/backward of microbatches, how sums reach this rank (data_parallel
all-reduces them first), versions or the other metrics of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from rl_core.algorithms.metrics import finalize_metrics, merge_metrics
from rl_core.packing import PackedRows, microbatch_rows, select_rows
from rl_core.types import TrainChunk


def scheduled_lr(cfg: Any, rl_step: int, total_steps: int) -> float:
    """The learning rate of the update that makes weight version `rl_step + 1` under
    `cfg.lr_schedule` (`cfg`: the recipe's `trainer` section) over a run of `total_steps` RL
    steps: a linear warm-up over `warmup_steps`, then constant, or a linear or half-cosine
    decay from `cfg.lr` towards `cfg.lr * min_lr_ratio` at `total_steps` (transformers'
    get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup, with a floor)."""
    sched = cfg.lr_schedule
    if rl_step < sched.warmup_steps:
        return cfg.lr * (rl_step + 1) / sched.warmup_steps
    if sched.type == "constant":
        return cfg.lr
    span = max(total_steps - sched.warmup_steps, 1)
    progress = min(max((rl_step - sched.warmup_steps) / span, 0.0), 1.0)
    shape = 1.0 - progress if sched.type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * shape)


def set_lr(optimizer: Any, lr: float) -> None:
    """Every parameter group of `optimizer` at learning rate `lr`."""
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass
class StepSums:
    """What one split step accumulates until `finish` (a fresh record per step): the loss sum and
    the normalizer it is divided by once (`apply_update`), the loss's metric pairs
    (`rl_core.algorithms.metrics`), the samples and trained tokens, and this process's compute time."""

    normalizer: float = 0.0
    loss_sum: float = 0.0
    metrics: dict[str, list[float]] = field(default_factory=dict)
    num_samples: int = 0
    num_tokens: int = 0
    compute_s: float = 0.0

    def backward(self, out: Any, mb: TrainChunk) -> None:
        """Backpropagate one microbatch's loss sum (`out`: a `LossOutput`) and add its sums."""
        out.loss_sum.backward()
        self.normalizer += out.normalizer
        self.loss_sum += float(out.loss_sum.detach().item())
        merge_metrics(self.metrics, out.metrics)  # `_min`/`_max` reduce as extremes
        self.num_samples += mb.num_samples
        self.num_tokens += mb.num_valid_tokens()

    def add(self, other: StepSums) -> None:
        """Add another process's sums (its compute time stays its own)."""
        self.normalizer += other.normalizer
        self.loss_sum += other.loss_sum
        merge_metrics(self.metrics, other.metrics)
        self.num_samples += other.num_samples
        self.num_tokens += other.num_tokens

    def report(self) -> dict[str, float]:
        """The step's metrics of these sums: the loss metrics' values, `num_samples`, `num_tokens`."""
        return {**finalize_metrics(self.metrics), "num_samples": float(self.num_samples),
                "num_tokens": float(self.num_tokens)}


def apply_update(normalizer: float, loss_sum: float, max_grad_norm: float | None, *,
                 scale: Callable[[float], None], clip: Callable[[float], float], step: Callable[[], None],
                 what: str) -> dict[str, float]:
    """grads /= normalizer (`scale`), clip to `max_grad_norm` (`clip` returns the norm before
    clipping), then `step`; with nothing to train (normalizer 0) only `skipped_update`.
    `what` names the step in the error (e.g. "gradient norm at RL step 3")."""
    if normalizer <= 0:
        return {"skipped_update": 1.0}
    scale(normalizer)
    grad_norm = float(clip(max_grad_norm if max_grad_norm is not None else math.inf))
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite {what} ({grad_norm})")
    step()
    return {"grad_norm": grad_norm, "loss": loss_sum / normalizer, "skipped_update": 0.0}


def local_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, normalizer: float, loss_sum: float,
                 max_grad_norm: float | None, what: str) -> dict[str, float]:
    """`apply_update` for a module whose gradients are all local; gradients are zeroed after,
    whatever happens."""
    params = [p for p in model.parameters() if p.grad is not None]

    def scale(total: float) -> None:
        # one multi-tensor multiply (the same products as a `mul_` per tensor): the per-tensor loop left
        # the GPU idle while Python launched ~290 small kernels
        if params:
            torch._foreach_mul_([p.grad for p in params], 1.0 / total)

    try:
        return apply_update(normalizer if params else 0.0, loss_sum, max_grad_norm, scale=scale,
                            clip=lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm),
                            step=optimizer.step, what=what)
    finally:
        optimizer.zero_grad(set_to_none=True)


def chunk_rows(chunk: TrainChunk, size: int, max_tokens: int = 0, packed: bool = False) -> list[range | list[int]]:
    """The rows of each microbatch of `chunk` (`rl_core.packing.microbatch_rows`): at most `size`
    samples and, with `max_tokens` > 0 (`trainer.max_tokens_per_microbatch`), at most that many
    tokens as the model sees them (packed or padded)."""
    lengths = chunk.attention_mask.sum(dim=1).tolist() if max_tokens > 0 else [0] * chunk.num_samples
    return microbatch_rows(lengths, size, max_tokens, packed)


def local_microbatches(chunk: TrainChunk, size: int, device: torch.device,
                       on_skip: Callable[[TrainChunk], None] | None = None, max_tokens: int = 0,
                       packed: bool = False) -> Iterator[tuple[TrainChunk, PackedRows | None]]:
    """The chunk's microbatches (`chunk_rows`) on `device`, each with its `PackedRows` when
    `packed` (else None), skipping those without a trained token (nothing to forward or
    backward); `on_skip(mb)` is called for each skipped one."""
    for rows in chunk_rows(chunk, size, max_tokens, packed):
        mb = select_rows(chunk, rows)
        if mb.num_valid_tokens() > 0:
            yield mb.to(device), (PackedRows.of(mb.attention_mask).to(device) if packed else None)
        elif on_skip is not None:
            on_skip(mb)


def rows_in_order(pieces: list[tuple[range | list[int], torch.Tensor]], width: int) -> torch.Tensor:
    """[n, width] from each microbatch's per-token result [rows, w] (w <= width, zeros after),
    each at its rows of the chunk (`chunk_rows`' microbatches cover every row once)."""
    padded = [(rows, torch.nn.functional.pad(t, (0, width - t.shape[1]))) for rows, t in pieces]
    if all(isinstance(rows, range) for rows, _ in padded):  # consecutive runs, in order
        return torch.cat([t for _, t in padded])
    out = padded[0][1].new_zeros((sum(len(rows) for rows, _ in padded), width))
    for rows, t in padded:
        out[torch.tensor(rows, dtype=torch.long, device=out.device)] = t
    return out


class LocalStep:
    """begin / abort of the split step, and the state of a checkpoint (version, optimizer steps,
    optimizer), for a trainer with `self.model`, `self.optimizer`, `self.version`, `self.optimizer_steps` and
    `self._loss` (None while no step is open); the step's sums are `self._step`; `_name` prefixes
    its errors."""

    _name = "trainer"

    def _reset_step(self) -> None:
        self._step = StepSums()

    def _open_step(self, loss) -> None:
        if self._loss is not None:
            raise RuntimeError(f"{self._name} begin() called while a step is open; call finish() or abort() first")
        self._loss = loss
        self._reset_step()
        self.optimizer.zero_grad(set_to_none=True)

    def _require_open(self, method: str) -> None:
        if self._loss is None:
            raise RuntimeError(f"{self._name} {method}() called without begin()")

    def abort(self) -> None:
        """Drop the open step: gradients cleared, no update."""
        self.optimizer.zero_grad(set_to_none=True)
        self._loss = None
        self._reset_step()

    def _update(self, max_grad_norm: float | None, what: str) -> dict[str, float]:
        """`local_update` of `self.model` by the open step's sums, counted in `optimizer_steps`; a
        non-finite gradient norm drops the step (`abort`) and raises."""
        try:
            metrics = local_update(self.model, self.optimizer, self._step.normalizer, self._step.loss_sum,
                                   max_grad_norm, what)
        except FloatingPointError:
            self.abort()
            raise
        self.optimizer_steps += 1 - int(metrics["skipped_update"])
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "optimizer_steps": self.optimizer_steps,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.optimizer.load_state_dict(state["optimizer"])

"""The split step API for data-parallel trainers whose ranks follow a rank-0 driver.

Owns, for the fsdp2 and megatron backends alike: the public `TrainerBackend` methods as
commands (`spmd.CommandChannel`); how a chunk is divided over data-parallel ranks (a
contiguous block of samples per rank, or shares by tokens under a token budget; every rank
runs the same number of microbatches, packed with `trainer.packing`: a rank whose share is
used up runs a zero-weight dummy, so the collectives line up); the
sum-form accounting of a step (loss sums, normalizers and metric pairs all-reduced at
`finish`, then one division of the gradients by the step's total normalizer, as
`TorchTrainer`); the gathering of per-rank logprobs; and the step's FLOPs/MFU metrics,
summed over the data-parallel ranks.
Does not own: the model, its sharding, gradient scaling and clipping or the optimizer (the
backend hooks `_model_logprobs`, `_scale_grads`, `_clip_grads`, `_optimizer_step`, ...). Read
more: docs/distributed-training.md, "How the processes work together".
"""

from __future__ import annotations

import abc
import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_core.algorithms.flops import FlopsCounter, FlopsSpec, flops_metrics, peak_flops_per_s
from rl_core.packing import PackedRows, microbatch_rows, select_rows, split_rows
from rl_core.protocols import PolicyLoss
from rl_core.train.update import StepSums, apply_update, scheduled_lr, set_lr
from rl_core.train.spmd import INIT, CommandChannel
from rl_core.types import TrainChunk


class DataParallelTrainer(abc.ABC):
    """Base of the multi-process backends (see the module doc); subclasses fill the hooks."""

    reference_dir: str | None = None  # the KL reference's directory; `make_trainer` sets it
    reference_is_base = False  # LoRA: the reference is the policy with its adapters off (no model of its own)

    @contextlib.contextmanager
    def _constructing(self, **call: Any):
        """The frame of a backend's constructor (its arguments: `call`), on every rank of an
        initialised process group: the command channel and `cfg`, `device`, `temperature` set; on
        rank 0 of several, the call published first, so the worker ranks build alongside, and
        awaited at the end (whether the body built or raised)."""
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised process group: build it with "
                               "rl_core.train.make_trainer (which calls rl_core.distributed.init_distributed)")
        self.channel = CommandChannel.shared(call["cfg"].collective_timeout_s, call["cfg"].worker_heartbeat_timeout_s)
        seq = self._driver_init(dict(call, model_dir=str(call["model_dir"])))
        try:
            self.cfg = call["cfg"]
            self.device = torch.device(call["device"])
            self.temperature = call["logprob_temperature"]
            self.lr_total_steps = call.get("lr_total_steps", 0)  # the RL steps trainer.lr_schedule spans
            yield
        finally:
            if seq is not None:
                self.channel.complete(seq)

    def _setup_step_state(self, dp_rank: int, dp_size: int, dp_group, version: int) -> None:
        """The split step's state of this rank in its data-parallel group (inside `_constructing`)."""
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.microbatch_size = self.cfg.microbatch_size
        self.max_tokens = self.cfg.max_tokens_per_microbatch  # 0: microbatch_size samples, no token budget
        self.max_grad_norm = self.cfg.max_grad_norm
        self.version = version
        self.optimizer_steps = 0
        self._loss: PolicyLoss | None = None
        self._closed = False
        self._flops: FlopsCounter | None = None  # this rank's passes since the last reduction (built lazily)
        self._rl_flops = [0.0, 0.0]  # (train, forward-only) FLOPs of all ranks, summed over one RL step
        self._rl_compute_s = 0.0
        self._reset_step()

    def _flops_counter(self) -> FlopsCounter:
        """Model FLOPs of this rank's microbatches (`rl_core.algorithms.flops`), counted from `self.hf_config`."""
        if self._flops is None:
            self._flops = FlopsCounter(FlopsSpec.from_hf_config(self.hf_config))
        return self._flops

    def _driver_init(self, kwargs: dict) -> int | None:
        """Rank 0 in a multi-process group: publish the constructor call; returns its sequence number."""
        if self.channel.is_driver and self.channel.world_size > 1:
            return self.channel.publish(INIT, (), kwargs)
        return None

    # ------------------------------------------------------------------ public API (rank 0)

    def begin(self, loss: PolicyLoss) -> None:
        if self._loss is not None:
            raise RuntimeError("begin() called while a step is open; call finish() or abort() first")
        self.channel.call(self, "begin", loss)

    def train_microbatches(self, chunk: TrainChunk) -> None:
        if self._loss is None:
            raise RuntimeError("train_microbatches() called without begin()")
        self.channel.call(self, "train_microbatches", chunk.to("cpu"))

    def finish(self, advance_version: bool = True) -> dict[str, float]:
        """One optimizer step; `advance_version=False` for inner mini-steps of an RL step."""
        if self._loss is None:
            raise RuntimeError("finish() called without begin()")
        return self.channel.call(self, "finish", advance_version)

    def abort(self) -> None:
        self.channel.call(self, "abort")

    def logprobs(self, chunk: TrainChunk, reference: bool = False) -> torch.Tensor:
        if reference and getattr(self, "reference", None) is None and not self.reference_is_base:  # no rank enters
            raise RuntimeError("reference logprobs requested but no reference model is kept (loss.kl_coef == 0)")
        return self.channel.call(self, "logprobs", chunk.to("cpu"), reference)

    def export_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """Full weights under HF names on rank 0 (a collective over the group): on CPU, or with
        `on_device` on rank 0's device (no device-to-host copy; a GPU broadcast sends them as they are)."""
        return self.channel.call(self, "export_weights", bool(on_device))

    def save_pretrained(self, out_dir: str | Path) -> None:
        self.channel.call(self, "save_pretrained", str(out_dir))

    def state_dict(self) -> dict[str, Any]:
        return self.channel.call(self, "state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # the optimizer state stays on rank 0 and reaches the workers through the process group
        # inside the command (large), not through the command store (small messages only)
        self._pending_optimizer_state = state.get("optimizer")
        self.channel.call(self, "load_state_dict", {k: v for k, v in state.items() if k != "optimizer"})

    def close(self) -> None:
        """Release the worker ranks (they return from `serve`)."""
        if not self._closed:
            self._closed = True
            self.channel.shutdown()

    # ------------------------------------------------------------------ SPMD bodies (every rank)

    def _reset_step(self) -> None:
        self._step = StepSums()

    def _spmd_begin(self, loss: PolicyLoss) -> None:
        self._loss = loss
        self._reset_step()
        self._zero_grad()
        set_lr(self.optimizer, scheduled_lr(self.cfg, self.version, self.lr_total_steps))

    def _rank_plans(self, chunk: TrainChunk) -> list[list[range | list[int] | None]]:
        """Every data-parallel rank's microbatches as rows of the chunk (None = dummy), the same count
        on every rank. No token budget: a contiguous block of samples per rank, in runs of
        `microbatch_size`; with one: the samples shared out by tokens (`split_rows`), each rank's
        share cut by `microbatch_rows` (docs/performance.md, "Sequence packing")."""
        n, mbs = chunk.num_samples, self.microbatch_size
        if self.max_tokens <= 0:
            per_rank = math.ceil(n / self.dp_size)
            plans = []
            for rank in range(self.dp_size):
                lo = min(rank * per_rank, n)
                hi = min(lo + per_rank, n)
                plans.append([range(lo + j * mbs, min(lo + (j + 1) * mbs, hi)) if lo + j * mbs < hi else None
                              for j in range(math.ceil(per_rank / mbs))])
            return plans
        lengths = chunk.attention_mask.sum(dim=1).tolist()
        plans = [[[share[j] for j in rows] for rows in microbatch_rows([lengths[i] for i in share], mbs,
                                                                       self.max_tokens, self.packed)]
                 for share in split_rows(lengths, self.dp_size)]
        count = max(len(plan) for plan in plans)
        return [plan + [None] * (count - len(plan)) for plan in plans]

    def _microbatch(self, chunk: TrainChunk, rows: range | list[int] | None) -> tuple[TrainChunk, PackedRows | None]:
        """The rows' microbatch (None: the dummy) on this rank's device, with its packed layout when packing."""
        mb = self._dummy(chunk) if rows is None else select_rows(chunk, rows)
        packed = PackedRows.of(mb.attention_mask).to(self.device) if self.packed else None
        return mb.to(self.device), packed

    @staticmethod
    def _dummy(chunk: TrainChunk) -> TrainChunk:
        """Two tokens of the first sample: enough for a forward and backward through every layer."""
        d = chunk.slice(0, 1)
        width = min(2, d.input_ids.shape[1])
        for k in d.__dataclass_fields__:
            t = getattr(d, k)
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                setattr(d, k, t[:, :width])
        return d

    def _spmd_train_microbatches(self, chunk: TrainChunk) -> None:
        t0 = time.perf_counter()
        for rows in self._rank_plans(chunk)[self.dp_rank]:
            dummy = rows is None
            mb, packed = self._microbatch(chunk, rows)
            ref_pass = self._loss.needs_reference_logprobs and mb.ref_logprobs is None
            if ref_pass:
                with torch.no_grad():
                    mb.ref_logprobs = self._model_logprobs(mb, reference=True, packed=packed)
            lp = self._model_logprobs(mb, reference=False, packed=packed)
            if dummy or mb.num_valid_tokens() == 0:
                (lp.sum() * 0.0).backward()
                if not dummy:  # as the single-process trainer: the loss may count its sequences
                    self._step.normalizer += self._loss.skipped_normalizer(mb)
                continue
            self._step.backward(self._loss(lp, mb), mb)
            self._flops_counter().add_train(mb)
            if ref_pass:  # the KL term's reference pass above, counted as TorchTrainer counts it
                self._flops_counter().add_forward(mb)
        self._step.compute_s += time.perf_counter() - t0

    def _reduce_step_sums(self) -> tuple[StepSums, float, float]:
        """The step's sums over the data-parallel ranks, and their (train, forward-only) FLOPs."""
        counter = self._flops_counter()
        flops_train, flops_forward = counter.train, counter.forward
        counter.reset()
        if self.dp_size == 1:
            return self._step, flops_train, flops_forward
        mine = {"normalizer": self._step.normalizer, "loss_sum": self._step.loss_sum,
                "num_samples": self._step.num_samples, "num_tokens": self._step.num_tokens,
                "metrics": self._step.metrics, "flops": [flops_train, flops_forward]}
        every: list[dict | None] = [None] * self.dp_size
        dist.all_gather_object(every, mine, group=self.dp_group)
        total, flops_train, flops_forward = StepSums(), 0.0, 0.0
        for d in every:
            flops = d.pop("flops")
            total.add(StepSums(**d))
            flops_train, flops_forward = flops_train + flops[0], flops_forward + flops[1]
        return total, flops_train, flops_forward

    def _spmd_finish(self, advance_version: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        sums, flops_train, flops_forward = self._reduce_step_sums()
        try:
            metrics = apply_update(sums.normalizer, sums.loss_sum, self.max_grad_norm, scale=self._scale_grads,
                                   clip=self._clip_grads, step=self._optimizer_step,
                                   what=f"gradient norm at RL step {self.version}")
            self.optimizer_steps += 1 - int(metrics["skipped_update"])
        finally:
            self._zero_grad()
            self._loss = None
        metrics.update(sums.report())
        metrics["lr"] = self._lr()
        metrics["compute_s"] = self._step.compute_s + (time.perf_counter() - t0)
        # FLOPs/MFU over the RL step (PPO mini-steps and forward-only logprob passes included), as
        # TorchTrainer reports them; every data-parallel rank's passes count, MFU is over all devices
        self._rl_flops[0] += flops_train
        self._rl_flops[1] += flops_forward
        self._rl_compute_s += metrics["compute_s"]
        if advance_version:
            self.version += 1
            peak = peak_flops_per_s(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
            metrics.update(flops_metrics(self._rl_flops[0], self._rl_flops[1], self._rl_compute_s, peak,
                                         dist.get_world_size() if dist.is_initialized() else 1))
            self._rl_flops = [0.0, 0.0]
            self._rl_compute_s = 0.0
        return metrics

    def _spmd_abort(self) -> None:
        self._zero_grad()
        self._loss = None
        self._reset_step()

    @torch.no_grad()
    def _spmd_logprobs(self, chunk: TrainChunk, reference: bool) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self._spmd_logprobs_timed(chunk, reference)
        finally:  # forward-only passes count in the step's FLOPs, so their time counts in its MFU too
            self._rl_compute_s += time.perf_counter() - t0

    def _spmd_logprobs_timed(self, chunk: TrainChunk, reference: bool) -> torch.Tensor:
        width = chunk.input_ids.shape[1]
        plans = self._rank_plans(chunk)
        rows_of = [[i for rows in plan if rows is not None for i in rows] for plan in plans]  # each rank's, in order
        per_rank = max(len(r) for r in rows_of)
        pieces = []
        for rows in plans[self.dp_rank]:
            mb, packed = self._microbatch(chunk, rows)
            lp = self._model_logprobs(mb, reference=reference, packed=packed).float()
            if rows is None:  # the dummy: its collectives only
                continue
            self._flops_counter().add_forward(mb)
            pieces.append(torch.nn.functional.pad(lp, (0, width - lp.shape[1])))
        mine = torch.cat(pieces) if pieces else torch.zeros((0, width), device=self.device)
        mine = torch.nn.functional.pad(mine, (0, 0, 0, per_rank - mine.shape[0]))
        every = [mine]
        if self.dp_size > 1:
            every = [torch.empty_like(mine) for _ in range(self.dp_size)]
            dist.all_gather(every, mine.contiguous(), group=self.dp_group)
        out = torch.zeros((chunk.num_samples, width), dtype=mine.dtype, device=mine.device)
        for rank_rows, got in zip(rows_of, every):
            out[torch.tensor(rank_rows, dtype=torch.long, device=out.device)] = got[:len(rank_rows)]
        return out.cpu()

    def _spmd_state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "optimizer_steps": self.optimizer_steps, "optimizer": self._optimizer_state()}

    def _spmd_load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self._load_optimizer_state(self.__dict__.pop("_pending_optimizer_state", None))  # None on workers

    # ------------------------------------------------------------------ hooks

    device: torch.device
    packed: bool  # trainer.packing resolved for the backend's model (rl_core.train.varlen.resolve_packing)

    @abc.abstractmethod
    def _model_logprobs(self, mb: TrainChunk, reference: bool, packed: PackedRows | None = None) -> torch.Tensor:
        """[b, t] logprobs of the microbatch's tokens (position 0 gets 0), under the policy or the reference;
        `packed`: the rows' packed layout (`trainer.packing`), the model run over one packed row."""

    @abc.abstractmethod
    def _zero_grad(self) -> None:
        """Drop accumulated gradients."""

    @abc.abstractmethod
    def _scale_grads(self, total_normalizer: float) -> None:
        """Make the synchronised gradients equal d(sum of all ranks' loss sums)/dw divided by `total_normalizer`."""

    @abc.abstractmethod
    def _clip_grads(self, max_norm: float) -> float:
        """Clip to the global norm `max_norm`; returns the global norm before clipping (the same on every rank)."""

    @abc.abstractmethod
    def _optimizer_step(self) -> None:
        """One optimizer step on the (scaled, clipped) gradients."""

    @abc.abstractmethod
    def _lr(self) -> float:
        """The current learning rate."""

    @abc.abstractmethod
    def _optimizer_state(self) -> dict[str, Any] | None:
        """Optimizer state for a checkpoint, complete on rank 0 (a collective)."""

    @abc.abstractmethod
    def _load_optimizer_state(self, state: dict[str, Any] | None) -> None:
        """Restore what `_optimizer_state` returned: `state` on rank 0, None on the other ranks
        (a collective: rank 0 sends each rank what it needs; None on rank 0 = nothing to load)."""

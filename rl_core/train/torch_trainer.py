"""The torch training backend: one process, a transformers causal LM, AdamW.

Owns: the split step API (`begin` / `train_microbatches` / `finish` / `abort`), which
per-token logprob path it uses (`rl_core.train.logprobs`: log_softmax(logits / T) of each
token given its prefix, as the generation engine reports it; chunked per
`trainer.logprob_chunk_tokens`), `trainer.compile`, microbatching (token budgets, packed rows:
`trainer.max_tokens_per_microbatch`, `trainer.packing`), gradient accumulation in sum form
with one normalisation at `finish`, clipping, the optimizer and its state, the optional
frozen reference model, weight export, router replay for MoE policies (`router_replay`),
and LoRA adapters (`trainer.lora`, rl_core.train.lora: only the adapters train; the KL
reference is the base, the adapters off).
Does not own: what to train on (the train pump), the loss formula (algorithms.losses), or
distributed training (other backends sit behind the same protocol). Read more:
docs/performance.md, docs/moe.md.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from rl_core.algorithms.flops import FlopsCounter, FlopsSpec, peak_flops_per_s
from rl_core.config.schema import TrainerConfig
from rl_core.packing import PackedRows, select_rows
from rl_core.protocols import PolicyLoss
from rl_core.train.causal_lm import DTYPES, decoder_layers
from rl_core.train.logprobs import chunked_unsupported_reason, resolve_chunk_tokens, token_logprobs
from rl_core.train.lora import load_policy
from rl_core.train.router_replay import RouterReplay, check_routes
from rl_core.train.update import (LocalStep, StepSums, chunk_rows, local_microbatches, rows_in_order, scheduled_lr,
                                  set_lr)
from rl_core.train.varlen import resolve_packing, use_packed_attention
from rl_core.types import TrainChunk

__all__ = ["TorchTrainer", "token_logprobs"]  # token_logprobs: re-exported from rl_core.train.logprobs




class TorchTrainer(LocalStep):
    """`trainer.backend: torch`."""

    reference_dir: str | None = None  # the KL reference's directory; `make_trainer` sets it

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, logprob_temperature: float = 1.0,
                 device: str = "cpu", dtype: str = "float32", keep_reference: bool = False, version: int = 0,
                 reference_dir: str | Path | None = None, lr_total_steps: int = 0):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.cfg = cfg
        self.lr_total_steps = lr_total_steps  # the RL steps `trainer.lr_schedule` spans (grpo.max_num_steps)
        self.device = torch.device(device)
        self.temperature = logprob_temperature
        # trainer.logprob_chunk_tokens and trainer.packing: checked on the config before the weights load
        hf_config = AutoConfig.from_pretrained(str(model_dir))
        self.chunk_tokens = resolve_chunk_tokens(cfg.logprob_chunk_tokens, hf_config)
        self.packed = resolve_packing(cfg.packing, hf_config)
        self.model, self.lora = load_policy(  # LoRA (trainer.lora): the base with PEFT's layers injected
            model_dir, cfg.lora, lambda d: AutoModelForCausalLM.from_pretrained(str(d), dtype=DTYPES[dtype]))
        self.model = self.model.to(self.device)
        self.model.train()
        if self.chunk_tokens and chunked_unsupported_reason(self.model):
            resolve_chunk_tokens(self.chunk_tokens, self.model)  # raises (e.g. a head that is not a Linear)
        if cfg.compile:
            for layer in decoder_layers(self.model):
                layer.compile(dynamic=True)  # in place: parameter names and state dict keys stay the HF ones
        self.reference = None
        # LoRA: the reference (the run's initial policy) is the base model, i.e. this one with its adapters off
        self.reference_is_base = keep_reference and self.lora is not None and (
            reference_dir is None or Path(reference_dir).resolve() == self.lora.base_dir)
        if keep_reference and not self.reference_is_base:  # the initial policy: `reference_dir` when resuming, else these weights
            self.reference = (AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=DTYPES[dtype])
                              .to(self.device).eval() if reference_dir is not None
                              else copy.deepcopy(self.model).eval())
            for p in self.reference.parameters():
                p.requires_grad_(False)
        for model in (self.model, self.reference) if self.packed else ():
            if model is not None:
                use_packed_attention(model)
        self.replay = self.reference_replay = None
        if cfg.router_replay.enabled:
            self.replay = _router_replay(self.model, model_dir)
            self.reference_replay = None if self.reference is None else RouterReplay(self.reference)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay, fused=self.device.type == "cuda",  # one kernel per step on GPU
        )
        self.version = version
        self.optimizer_steps = 0
        self._loss: PolicyLoss | None = None
        # FLOPs and compute time summed over every optimizer step of one RL step (PPO mini-steps too)
        self.flops = FlopsCounter(FlopsSpec.from_model(self.model))
        self._rl_compute_s = 0.0
        self._in_train = False  # inside train_microbatches (its reference passes are timed there)
        self._reset_step()

    # ------------------------------------------------------------------ split step API

    def _reset_step(self) -> None:
        self._step = StepSums()
        self._route_tokens = 0  # router replay: tokens whose routes matter, and those backfilled
        self._route_backfilled = 0

    def _replaying(self, replay: RouterReplay | None, mb: TrainChunk, rows: PackedRows | None, count: bool = False):
        """Context of one forward: replays `mb.routed_experts` when router replay is on (packed like
        the tokens when the forward is packed: `rows`)."""
        if replay is None:
            return nullcontext()
        check = check_routes(mb.routed_experts, mb.attention_mask, replay, what="microbatch")
        if count:
            self._route_tokens += check.num_tokens
            self._route_backfilled += check.num_backfilled
        return replay.replaying(mb.routed_experts if rows is None else rows.pack(mb.routed_experts)[None])

    def _forward(self, model: torch.nn.Module, mb: TrainChunk, rows: PackedRows | None, replay: RouterReplay | None,
                 count: bool = False) -> torch.Tensor:
        """[b, t] logprobs of one microbatch (packed when `rows`), routes replayed."""
        with self._replaying(replay, mb, rows, count):
            return token_logprobs(model, mb.input_ids, mb.attention_mask, self.temperature, self.chunk_tokens,
                                  fused=self.cfg.compile, packed=rows)

    def begin(self, loss: PolicyLoss) -> None:
        self._open_step(loss)
        set_lr(self.optimizer, scheduled_lr(self.cfg, self.version, self.lr_total_steps))

    def train_microbatches(self, chunk: TrainChunk) -> None:
        self._require_open("train_microbatches")
        t0 = time.perf_counter()
        self._in_train = True
        try:
            self._train_microbatches(chunk)
        finally:
            self._in_train = False
            self._step.compute_s += time.perf_counter() - t0

    def _train_microbatches(self, chunk: TrainChunk) -> None:
        for mb, rows in local_microbatches(chunk, self.cfg.microbatch_size, self.device, on_skip=self._skipped,
                                           max_tokens=self.cfg.max_tokens_per_microbatch, packed=self.packed):
            if self._loss.needs_reference_logprobs and mb.ref_logprobs is None:
                mb.ref_logprobs = self.logprobs(mb, reference=True)
            lp = self._forward(self.model, mb, rows, self.replay, count=True)
            self._step.backward(self._loss(lp, mb), mb)
            self.flops.add_train(mb)

    def _skipped(self, mb: TrainChunk) -> None:
        self._step.normalizer += self._loss.skipped_normalizer(mb)

    def finish(self, advance_version: bool = True) -> dict[str, float]:
        """One optimizer step. `advance_version=False` for the inner mini-steps of an RL step
        (PPO epochs/minibatches): the weight version counts RL steps, not optimizer steps."""
        self._require_open("finish")
        t0 = time.perf_counter()
        metrics = self._update(self.cfg.max_grad_norm, f"gradient norm at RL step {self.version}")
        metrics.update(self._step.report())
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        if self.replay is not None:
            metrics["router_replay_backfill_frac"] = self._route_backfilled / max(self._route_tokens, 1)
        metrics["compute_s"] = self._step.compute_s + (time.perf_counter() - t0)
        self._rl_compute_s += metrics["compute_s"]
        if advance_version:
            self.version += 1
            peak = peak_flops_per_s(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
            metrics.update(self.flops.metrics(self._rl_compute_s, peak))
            self.flops.reset()
            self._rl_compute_s = 0.0
        self._loss = None
        return metrics

    # ------------------------------------------------------------------ inference / export / state

    def logprobs(self, chunk: TrainChunk, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs of `chunk` under the policy (or the frozen reference), no gradient.
        A pass outside a training microbatch (previous-policy / reward-KL reference logprobs)
        adds its time to the RL step's compute time: its FLOPs count in the step's MFU."""
        t0 = time.perf_counter()
        try:
            return self._logprobs(chunk, reference)
        finally:
            if not self._in_train:  # inside train_microbatches the time is in the step's `compute_s` already
                self._rl_compute_s += time.perf_counter() - t0

    @torch.no_grad()
    def _logprobs(self, chunk: TrainChunk, reference: bool = False) -> torch.Tensor:
        model = self.model if reference and self.reference_is_base else self.reference if reference else self.model
        if model is None:
            raise RuntimeError("reference logprobs requested but no reference model is kept (loss.kl_coef == 0)")
        with self.lora.passes(reference) if self.lora is not None else nullcontext():  # LoRA: no dropout; base reference
            return self._logprob_rows(model, chunk, reference)

    def _logprob_rows(self, model: torch.nn.Module, chunk: TrainChunk, reference: bool) -> torch.Tensor:
        out = []
        for rows in chunk_rows(chunk, self.cfg.microbatch_size, self.cfg.max_tokens_per_microbatch, self.packed):
            mb = select_rows(chunk, rows)
            packed = PackedRows.of(mb.attention_mask).to(self.device) if self.packed else None
            mb = mb.to(self.device)
            out.append((rows, self._forward(model, mb, packed, self.reference_replay if reference else self.replay)))
            self.flops.add_forward(mb)
        return rows_in_order(out, chunk.input_ids.shape[1]) if out else torch.zeros_like(chunk.gen_logprobs)

    exports_live_tensors = True  # export_weights: the parameters themselves (a keeping transport copies them)

    def export_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The model's own tensors, on its device either way (no copy). LoRA: the adapters in the
        refit format (`trainer.lora.refit: adapters`), or the base with the adapters merged in."""
        if self.lora is None:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        if self.cfg.lora.refit == "adapters":
            return self.lora.refit_adapters(self.model.named_parameters())
        return self.lora.merged(self.model.state_dict())

    def save_pretrained(self, out_dir: str | Path) -> None:
        """The policy as an HF directory; LoRA: the adapters as a PEFT directory (rl_core.train.lora)."""
        if self.lora is not None:
            self.lora.save(out_dir, self.model.named_parameters())
        else:
            self.model.save_pretrained(str(out_dir), safe_serialization=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # the recipe's hyperparameters win over the saved ones: equal when resuming, changed on
        # purpose when a run branches from a checkpoint with another trainer.lr (README: Workflow)
        for group in self.optimizer.param_groups:
            group.update(lr=self.cfg.lr, betas=(self.cfg.adam_beta1, self.cfg.adam_beta2), eps=self.cfg.adam_eps,
                         weight_decay=self.cfg.weight_decay)


def _router_replay(model: torch.nn.Module, model_dir: str | Path) -> RouterReplay:
    """Hooks for `trainer.router_replay.enabled`; a RecipeError when the policy has no router to replay."""
    try:
        return RouterReplay(model)
    except ValueError as exc:
        from rl_core.errors import RecipeError

        raise RecipeError.single("trainer.router_replay.enabled", True,
                                 f"false for the policy in {model_dir} ({exc})",
                                 "use a Mixtral (mixture-of-experts) policy, or set trainer.router_replay.enabled: "
                                 "false.") from None

"""The PPO critic: a value model with its own optimizer, behind the same split step API as the trainer.

Owns: the value model (a causal-LM backbone from an HF directory, its LM head dropped, plus a
scalar head; always a *separate* model, `critic.model_path`, default the initial policy's
directory), per-token values aligned like logprobs (`values(chunk)[:, t]` = V(s_t) from the
hidden state at t - 1, position 0 gets 0; `with_final=True` also the value after each sample's
last token, the bootstrap of a truncated completion), microbatched forward/backward with the
sum-form loss (`algorithms.value_loss`), one normalisation and AdamW step per `finish()`,
clipping, and saving/loading (the backbone as an HF directory, `value_head.safetensors`,
`critic_state.pt`, `critic.json` last). Per RL step the train pump calls `values(chunk)` before
`estimate_advantages`, then `begin`, `train_microbatches` per chunk, `finish` (or `abort`).

Does not own: computing returns (GAE) or deciding when the critic trains (warm-up steps). Read
more: docs/algorithms.md, "PPO: the critic and mini-steps".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rl_core.algorithms.metrics import finalize_metrics
from rl_core.algorithms.value_loss import ClippedValueLoss
from rl_core.config.schema import CriticConfig
from rl_core.fsutil import atomic_dir
from rl_core.train.causal_lm import DTYPES
from rl_core.train.update import LocalStep, local_microbatches
from rl_core.types import TrainChunk

HEAD_FILE = "value_head.safetensors"
STATE_FILE = "critic_state.pt"
MARKER = "critic.json"


class ValueModel(torch.nn.Module):
    """Backbone (a transformers base model returning hidden states) + a zero-initialised scalar head."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                with_final: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, T] float32 values: position t from the hidden state at t - 1, position 0 = 0.
        `with_final`: also [B] the value after each row's last real token (right padding)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        v = self.head(hidden[:, :-1]).squeeze(-1).float()
        values = torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
        if not with_final:
            return values
        last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
        final = self.head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).squeeze(-1).float()
        return values, final


def load_value_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A value model from an HF causal-LM directory (fresh head) or from a saved critic (its head)."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"critic model directory {d} has no config.json (set critic.model_path to an HF "
                                "model directory, or leave it null to start from the initial policy)")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the dropped LM head is expected, not worth a load report
    try:
        backbone = AutoModel.from_pretrained(str(d), dtype=dtype, local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    model = ValueModel(backbone, backbone.config.hidden_size).to(dtype)
    if (d / HEAD_FILE).is_file():
        model.head.load_state_dict(load_file(str(d / HEAD_FILE)))
    return model


class Critic(LocalStep):
    """`critic.enabled: true`: the value model, its AdamW and the split step API."""

    _name = "critic"

    def __init__(self, model_dir: str | Path, cfg: CriticConfig, *, device: str = "cpu", dtype: str = "float32",
                 version: int = 0):
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = load_value_model(model_dir, DTYPES[dtype]).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version = version
        self.optimizer_steps = 0
        self._loss = None
        self._reset_step()

    # ------------------------------------------------------------------ split step API

    def begin(self, loss=None) -> None:
        """Open one critic step; `loss` defaults to the clipped value loss of `critic.value_clip_eps`."""
        self._open_step(loss if loss is not None else ClippedValueLoss(self.cfg.value_clip_eps))

    def train_microbatches(self, chunk: TrainChunk) -> None:
        self._require_open("train_microbatches")
        t0 = time.perf_counter()
        for mb in local_microbatches(chunk, self.cfg.microbatch_size, self.device):
            self._step.backward(self._loss(self.model(mb.input_ids, mb.attention_mask), mb), mb)
        self._step.compute_s += time.perf_counter() - t0

    def finish(self, advance_version: bool = True) -> dict[str, float]:
        """Normalise by the step's total normaliser, clip, one AdamW step; returns metrics.
        `advance_version=False` for the inner mini-steps of an RL step (as `TorchTrainer.finish`):
        `version` counts RL steps the critic trained in, `optimizer_steps` every update."""
        self._require_open("finish")
        t0 = time.perf_counter()
        metrics = self._update(self.cfg.max_grad_norm, f"critic gradient norm at critic step {self.version}")
        metrics.update(finalize_metrics(self._step.metrics))
        metrics["compute_s"] = self._step.compute_s + (time.perf_counter() - t0)
        if advance_version:
            self.version += 1
        self._loss = None
        return metrics

    # ------------------------------------------------------------------ inference / state / files

    @torch.no_grad()
    def values(self, chunk: TrainChunk, with_final: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, T] float32 values of the chunk (on the CPU), padded to the chunk's width; with
        `with_final` also [B] the value after each sample's last token."""
        was_training = self.model.training
        self.model.eval()
        out, finals = [], []
        try:
            for start in range(0, chunk.num_samples, self.cfg.microbatch_size):
                mb = chunk.slice(start, min(start + self.cfg.microbatch_size, chunk.num_samples)).to(self.device)
                v = self.model(mb.input_ids, mb.attention_mask, with_final=with_final)
                if with_final:
                    v, f = v
                    finals.append(f.cpu())
                v = v.cpu()
                out.append(torch.nn.functional.pad(v, (0, chunk.input_ids.shape[1] - v.shape[1])))
        finally:
            self.model.train(was_training)
        values = torch.cat(out, dim=0) if out else torch.zeros(chunk.input_ids.shape, dtype=torch.float32)
        if not with_final:
            return values
        return values, (torch.cat(finals) if finals else torch.zeros(chunk.num_samples, dtype=torch.float32))

    def save(self, out_dir: str | Path, with_optimizer: bool = True) -> Path:
        """Write the critic (weights, head, optionally optimizer state) as one directory, atomically."""
        from safetensors.torch import save_file

        with atomic_dir(out_dir) as tmp:
            self.model.backbone.save_pretrained(str(tmp), safe_serialization=True)
            save_file({k: v.detach().cpu().contiguous() for k, v in self.model.head.state_dict().items()},
                      str(tmp / HEAD_FILE))
            if with_optimizer:
                torch.save(self.state_dict(), tmp / STATE_FILE)
            (tmp / MARKER).write_text(json.dumps({"version": self.version, "optimizer_steps": self.optimizer_steps,
                                                  "with_optimizer": with_optimizer}) + "\n")
        return Path(out_dir)

    def load_state(self, saved_dir: str | Path) -> None:
        """Restore optimizer and counters saved by `save` (weights are loaded by the constructor)."""
        path = Path(saved_dir) / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: the critic at {saved_dir} was saved without optimizer state")
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

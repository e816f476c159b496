"""FLOPs and MFU accounting for training a causal LM.

Owns: the model-FLOPs formula, a per-RL-step counter that sums every forward+backward of
every optimizer step (PPO epochs and minibatches included) plus the forward-only passes
(reference / previous-policy logprobs, critic values), MFU, and a small table of peak
FLOP/s. Training one token costs 6 N + 12 L d_attn T (Kaplan et al. 2020, sec. 2.1 and
Table 1; the attention term of PaLM, Chowdhery et al. 2022, appendix B), N the parameters
used in matmuls (the LM head once, not the input embedding); MoE counts the k active expert
sets (Switch Transformers, Fedus et al. 2022, sec. 2); the full T x T attention matrix unless
`causal=True`; padding not counted (model FLOPs, not hardware FLOPs).

Does not own: timing (the caller measures the step's wall time) or logging.

Read more: docs/algorithms.md, "FLOPs and MFU".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rl_core.types import TrainChunk

# Dense (no sparsity) bf16/fp16 tensor-core peaks, from NVIDIA's datasheets. Matched in order
# on torch.cuda.get_device_name() (the PCIe name before its SXM namesake).
PEAK_BF16_FLOPS_PER_S: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


@dataclass(frozen=True)
class FlopsSpec:
    """What the formula needs to know about a model."""

    matmul_params: int  # N: parameters used in matrix multiplies (see module docstring)
    num_layers: int  # L
    attn_dim: int  # d_attn = num_attention_heads * head_dim

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "FlopsSpec":
        """From a transformers causal LM (or a base model / ValueModel backbone)."""
        cfg = model.config if hasattr(model, "config") else model.backbone.config
        params = {id(p): p for p in model.parameters()}
        total = sum(p.numel() for p in params.values())
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        tied = emb is not None and out is not None and out.weight is emb.weight
        lookup = emb.weight.numel() if (emb is not None and not tied) else 0
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        experts, active = getattr(cfg, "num_local_experts", 0) or 0, getattr(cfg, "num_experts_per_tok", 0) or 0
        idle = 0  # parameters of the experts a token is not routed to
        if experts and active:
            expert_params = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
            idle = expert_params * (experts - active) // experts
        return cls(matmul_params=total - lookup - idle, num_layers=cfg.num_hidden_layers,
                   attn_dim=cfg.num_attention_heads * head_dim)

    @classmethod
    def from_hf_config(cls, config) -> "FlopsSpec":
        """From a transformers config alone (a backend whose model is sharded or converted, e.g.
        fsdp2 and megatron): the causal LM is built on the meta device (no memory, no weights) and
        counted as `from_model` counts it."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.from_model(model)


def _lengths(seq_lens: Sequence[int] | torch.Tensor | TrainChunk) -> torch.Tensor:
    if isinstance(seq_lens, TrainChunk):
        return seq_lens.attention_mask.sum(dim=1).to(torch.float64)
    return torch.as_tensor(seq_lens, dtype=torch.float64).reshape(-1)


def train_flops(seq_lens: Sequence[int] | torch.Tensor | TrainChunk, spec: FlopsSpec, *, causal: bool = False) -> float:
    """Forward+backward FLOPs of sequences of these lengths (or of a chunk's real tokens)."""
    t = _lengths(seq_lens)
    attn_pairs = t * (t + 1) / 2 if causal else t * t
    return float((6.0 * spec.matmul_params * t + 12.0 * spec.num_layers * spec.attn_dim * attn_pairs).sum())


def forward_flops(seq_lens: Sequence[int] | torch.Tensor | TrainChunk, spec: FlopsSpec, *, causal: bool = False) -> float:
    """Forward-only FLOPs (a third of `train_flops`)."""
    return train_flops(seq_lens, spec, causal=causal) / 3.0


class FlopsCounter:
    """Sums model FLOPs over one RL step: call `add_train` for every forward+backward of every
    optimizer step (each PPO epoch again), `add_forward` for every forward-only pass, then
    read `total` (and `mfu(...)`) at `finish()` and `reset()` for the next step."""

    def __init__(self, spec: FlopsSpec, causal: bool = False):
        self.spec = spec
        self.causal = causal
        self.reset()

    def reset(self) -> None:
        self.train = 0.0
        self.forward = 0.0

    def add_train(self, seq_lens: Sequence[int] | torch.Tensor | TrainChunk) -> float:
        f = train_flops(seq_lens, self.spec, causal=self.causal)
        self.train += f
        return f

    def add_forward(self, seq_lens: Sequence[int] | torch.Tensor | TrainChunk) -> float:
        f = forward_flops(seq_lens, self.spec, causal=self.causal)
        self.forward += f
        return f

    @property
    def total(self) -> float:
        return self.train + self.forward

    def metrics(self, seconds: float, peak_flops_per_s: float | None, num_devices: int = 1) -> dict[str, float]:
        """`flops/*` for the step (and `perf/mfu` when the peak is known)."""
        return flops_metrics(self.train, self.forward, seconds, peak_flops_per_s, num_devices)


def flops_metrics(train: float, forward: float, seconds: float, peak_flops_per_s: float | None,
                  num_devices: int = 1) -> dict[str, float]:
    """`flops/train`, `flops/forward_only`, `flops/total`, `flops/per_s` (all devices together) and,
    when the peak is known, `perf/mfu` over `num_devices` devices."""
    total = train + forward
    out = {"flops/train": train, "flops/forward_only": forward, "flops/total": total,
           "flops/per_s": total / seconds if seconds > 0 else 0.0}
    if peak_flops_per_s:
        out["perf/mfu"] = mfu(total, seconds, peak_flops_per_s, num_devices)
    return out


def mfu(flops: float, seconds: float, peak_flops_per_s: float, num_devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' combined peak (0 when seconds <= 0)."""
    if peak_flops_per_s <= 0 or num_devices < 1:
        raise ValueError(f"peak_flops_per_s must be > 0 and num_devices >= 1, got {peak_flops_per_s}, {num_devices}")
    if seconds <= 0:
        return 0.0
    return flops / seconds / (peak_flops_per_s * num_devices)


def peak_flops_per_s(device_name: str | None = None) -> float | None:
    """Dense bf16 peak of a known GPU (by name; default: the current CUDA device), else None (CPU, unknown GPU)."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, peak in PEAK_BF16_FLOPS_PER_S:
        if key in device_name:
            return peak
    return None

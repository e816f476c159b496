"""Weights between the HF layout (Qwen2, Llama) and Megatron-core's GPTModel (local layer spec).

Owns: the name map and the tensor surgery in both directions (`hf_to_megatron`, whose
docstring gives both layouts, `megatron_to_hf`), the model shape read from an HF config
(`shape_from_hf`, `check_tensor_parallel`), and the split and merge of the Megatron tensors
over tensor-parallel ranks (`split_tensor_parallel`, `merge_tensor_parallel`). Pure functions
of state dicts: no process group, no model.

Does not own: building the model (`megatron.py`).

Read more: docs/distributed-training.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = ("qwen2", "llama")


@dataclass(frozen=True)
class GPTShape:
    """What the conversion and the Megatron TransformerConfig need from an HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tied: bool
    qkv_bias: bool
    rope_theta: float
    norm_eps: float


def shape_from_hf(hf_config: Any) -> GPTShape:
    """The GPT shape of a Qwen2/Llama HF config; ValueError names what cannot be converted."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(f"model_type {mt!r} has no Megatron conversion (supported: {', '.join(SUPPORTED)})")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r}: the Megatron conversion supports SwiGLU (silu) MLPs only")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ValueError(f"RoPE type {rope_type!r}: the Megatron conversion supports plain RoPE only")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if mt == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias/mlp_bias has no Megatron conversion here")
    if mt == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("Qwen2 with use_sliding_window: true has no Megatron conversion (full attention only)")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return GPTShape(model_type=mt, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                    num_heads=heads, num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                    head_dim=head_dim, ffn_hidden_size=hf_config.intermediate_size, vocab_size=hf_config.vocab_size,
                    max_position_embeddings=hf_config.max_position_embeddings,
                    tied=bool(getattr(hf_config, "tie_word_embeddings", False)), qkv_bias=mt == "qwen2",
                    rope_theta=float(theta), norm_eps=float(hf_config.rms_norm_eps))


def check_tensor_parallel(shape: GPTShape, tp: int) -> None:
    """ValueError when `tp` cannot split this model evenly."""
    for what, n in (("num_key_value_heads", shape.num_kv_heads), ("num_attention_heads", shape.num_heads),
                    ("intermediate_size", shape.ffn_hidden_size), ("vocab_size", shape.vocab_size)):
        if n % tp:
            raise ValueError(f"tensor_model_parallel_size {tp} does not divide the model's {what} ({n})")


# --------------------------------------------------------------------------- HF <-> Megatron (whole tensors)


def hf_to_megatron(sd: dict[str, torch.Tensor], shape: GPTShape) -> dict[str, torch.Tensor]:
    """HF state dict -> Megatron GPTModel state dict (no tensor parallelism).

    Layouts (HF `modeling_qwen2.py` / `modeling_llama.py`; Megatron-core `transformer/attention.py`,
    `SelfAttention.get_query_key_value_tensors`): HF's separate q/k/v projections become `linear_qkv`
    grouped by key/value head (per query group its `heads/groups` query heads, then its key head, then
    its value head; Qwen2's biases likewise); gate/up/down become `linear_fc1` = cat(gate, up) on dim 0
    and `linear_fc2` = down; `input_layernorm`, `post_attention_layernorm`, `model.norm` become
    `input_layernorm`, `pre_mlp_layernorm`, `decoder.final_layernorm`; `output_layer` is absent when
    tied (Megatron reuses the embedding). Both rotate halves for RoPE with the same base, so q/k rows
    need no permutation. Tensor parallelism (`split_tensor_parallel`) splits column-parallel tensors
    on dim 0 (qkv by whole query groups, fc1 as gate and up separately, vocabulary rows) and
    row-parallel ones on dim 1 (attention output, fc2); norms are replicated."""
    g, d, h = shape.num_kv_heads, shape.head_dim, shape.hidden_size
    qpg = shape.num_heads // g
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    if not shape.tied:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(shape.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].reshape(g, qpg * d, h)
        k = sd[p + "self_attn.k_proj.weight"].reshape(g, d, h)
        v = sd[p + "self_attn.v_proj.weight"].reshape(g, d, h)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        if shape.qkv_bias:
            qb = sd[p + "self_attn.q_proj.bias"].reshape(g, qpg * d)
            kb = sd[p + "self_attn.k_proj.bias"].reshape(g, d)
            vb = sd[p + "self_attn.v_proj.bias"].reshape(g, d)
            out[m + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(sd: dict[str, torch.Tensor], shape: GPTShape) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state dict (no tensor parallelism) -> HF state dict (lm_head included when tied)."""
    g, d, h = shape.num_kv_heads, shape.head_dim, shape.hidden_size
    qpg = shape.num_heads // g
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"],
           "lm_head.weight": sd["embedding.word_embeddings.weight"] if shape.tied else sd["output_layer.weight"]}
    for i in range(shape.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = sd[m + "self_attention.linear_qkv.weight"].reshape(g, (qpg + 2) * d, h)
        q, k, v = torch.split(qkv, [qpg * d, d, d], dim=1)
        out[p + "self_attn.q_proj.weight"] = q.reshape(-1, h)
        out[p + "self_attn.k_proj.weight"] = k.reshape(-1, h)
        out[p + "self_attn.v_proj.weight"] = v.reshape(-1, h)
        if shape.qkv_bias:
            qb, kb, vb = torch.split(sd[m + "self_attention.linear_qkv.bias"].reshape(g, (qpg + 2) * d),
                                     [qpg * d, d, d], dim=1)
            out[p + "self_attn.q_proj.bias"] = qb.reshape(-1)
            out[p + "self_attn.k_proj.bias"] = kb.reshape(-1)
            out[p + "self_attn.v_proj.bias"] = vb.reshape(-1)
        out[p + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        out[p + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        gate, up = torch.chunk(sd[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------- tensor parallelism


def tp_split_kind(name: str) -> str:
    """How a Megatron tensor is laid out over TP ranks: `rows`, `cols`, `fc1` (gate|up rows) or `replicated`."""
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "replicated"


def split_tensor_parallel(sd: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The part of each Megatron tensor that TP rank `rank` of `tp` holds."""
    out = {}
    for name, t in sd.items():
        kind = tp_split_kind(name)
        if kind == "rows":
            out[name] = torch.chunk(t, tp, dim=0)[rank]
        elif kind == "cols":
            out[name] = torch.chunk(t, tp, dim=1)[rank]
        elif kind == "fc1":
            gate, up = torch.chunk(t, 2, dim=0)
            out[name] = torch.cat([torch.chunk(gate, tp, dim=0)[rank], torch.chunk(up, tp, dim=0)[rank]])
        else:
            out[name] = t
        out[name] = out[name].contiguous()
    return out


def merge_tensor_parallel(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of `split_tensor_parallel`: whole tensors from every TP rank's parts (in rank order)."""
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        kind = tp_split_kind(name)
        if kind == "rows":
            out[name] = torch.cat(parts, dim=0)
        elif kind == "cols":
            out[name] = torch.cat(parts, dim=1)
        elif kind == "fc1":
            halves = [torch.chunk(p, 2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[name] = parts[0]
    return out

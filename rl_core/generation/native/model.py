"""Our own decoder forward for Llama / Qwen2 / Mixtral causal LMs, running on the slot KV cache.

Owns: `ModelSpec` (the shape read from an HF `config.json` or transformers config),
`CausalLM` (an `nn.Module` whose parameter names are the HF names, so an HF state dict loads
and refits by name), its forward over one `StepLayout`, a cache-free `sequence_logits` for
scoring, `decode_slots` (a static-shape decode step over slots 0..S-1 and keys 0..K-1, the
mask built on the device, which CUDA graphs capture), `kv_amax` (for FP8 scales), and the
safetensors loading helpers (`SafetensorsDir` reads lazily). The maths mirrors transformers' Llama/Qwen2 code (fp32 CPU
logits agree to ~1e-6). Supported: "llama", "qwen2", "mixtral" (moe.py; the eager forward
records routes in `last_routes`; `decode_slots` is dense-only), SiLU MLP, default RoPE, no
sliding window; anything else raises `ValueError` naming the config field.

Does not own: which requests run or when (engine.py), the cache storage and per-step index
tensors (kv_cache.py), or sampling (sampling.py). Read more: docs/generation.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from rl_core.generation.native.kv_cache import AttentionGroup, KVCache, StepLayout, load_range, store_tokens
from rl_core.generation.native.moe import SparseMoE, convert_legacy_moe

MODEL_TYPES = ("llama", "qwen2", "mixtral")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder, read from an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    num_experts: int = 0  # 0 = dense MLP; else experts per MoE layer
    num_experts_per_tok: int = 0  # router top-k (MoE)
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1 (MoE)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_config(cls, config: Any) -> "ModelSpec":
        """From a transformers config object or the dict of a `config.json`."""
        cfg: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.model_type is {model_type!r}; the native engine runs {MODEL_TYPES} "
                             "models. Use another generation backend for this architecture.")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.hidden_act is {cfg['hidden_act']!r}; the native engine implements 'silu' only.")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError("config.use_sliding_window is true; the native engine has no sliding-window attention.")
        if model_type == "mixtral" and cfg.get("sliding_window") is not None:
            raise ValueError(f"config.sliding_window is {cfg['sliding_window']}; the native engine has no "
                             "sliding-window attention (set it to null for full attention).")
        # transformers >= 5 keeps RoPE settings in `rope_parameters`; older configs use
        # `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config rope_type is {rope_type!r}; the native engine implements default RoPE only.")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        is_llama = model_type in ("llama", "mixtral")  # Mixtral attention is Llama's without biases
        moe = model_type == "mixtral"
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=bool(cfg.get("attention_bias", False)) if is_llama else True,
            o_bias=bool(cfg.get("attention_bias", False)) if is_llama else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if is_llama else False,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            num_experts=int(cfg["num_local_experts"]) if moe else 0,
            num_experts_per_tok=int(cfg["num_experts_per_tok"]) if moe else 0,
            norm_topk_prob=True,  # MixtralTopKRouter always renormalises
        )


class Weight(nn.Module):
    """One HF-named `weight` (+ `bias`) that may be a view into a fused tensor: the fused
    tensor is what the forward uses, the views are what HF names load into."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def _fused(sizes: list[int], in_features: int, bias: bool, device,
           dtype) -> tuple[torch.Tensor, torch.Tensor | None, list[Weight]]:
    """One [sum(sizes), in] weight (+ bias) and the `Weight` views of its row blocks, so
    several projections of the same input run as one matmul (as in vLLM's QKV/gate-up)."""
    weight = torch.empty(sum(sizes), in_features, device=device, dtype=dtype)
    fused_bias = torch.empty(sum(sizes), device=device, dtype=dtype) if bias else None
    parts, offset = [], 0
    for n in sizes:
        part_bias = fused_bias[offset:offset + n] if fused_bias is not None else None
        parts.append(Weight(weight[offset:offset + n], part_bias))
        offset += n
    return weight, fused_bias, parts


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) in fp32, cast back, then `weight *` as in HF."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(Weight):
    """Root-mean-square norm (Zhang & Sennrich 2019) in fp32, then `weight * x.to(dtype)` as in HF."""

    def __init__(self, dim: int, eps: float, device, dtype):
        super().__init__(torch.empty(dim, device=device, dtype=dtype))
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) over the slot cache, with one fused
    QKV matmul; `q_proj`/`k_proj`/`v_proj` are views into it."""

    def __init__(self, spec: ModelSpec, device, dtype):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        sizes = [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d]
        self.qkv_weight, self.qkv_bias, (self.q_proj, self.k_proj, self.v_proj) = _fused(
            sizes, h, spec.qkv_bias, device, dtype)
        o_bias = torch.empty(h, device=device, dtype=dtype) if spec.o_bias else None
        self.o_proj = Weight(torch.empty(h, spec.num_heads * d, device=device, dtype=dtype), o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: KVCache, layout: StepLayout) -> torch.Tensor:
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(n, heads + 2 * kv_heads, self.head_dim)
        # RoPE (Su et al. 2021, "RoFormer"): rotate q and k by an angle proportional to the
        # token position, so that q.k depends on the relative position only. HF layout:
        # rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * (-1 | +1), the sign folded into `sin`.
        qk = qkv[:, :heads + kv_heads]
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        cache.write(layer, layout.token_slots, layout.positions, k, v)
        outs = [self._attend(q[g.token_start:g.token_stop], g, layer, cache) for g in layout.groups]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)

    def _attend(self, q: torch.Tensor, group: AttentionGroup, layer: int, cache: KVCache) -> torch.Tensor:
        """Attention of one group's packed queries [n, H, D] -> [n, H*D]."""
        keys, values = cache.gather(layer, group.slots, group.key_len, group.slot_start)
        rows, chunk, heads, dim = group.num_rows, group.chunk, self.num_heads, self.head_dim
        if group.grid_index is None:  # one token per row: the packed queries are the grid
            grid = q.unsqueeze(2)  # [rows, H, 1, D]
        else:
            grid = q.new_zeros(rows * chunk, heads, dim)
            grid[group.grid_index] = q
            grid = grid.view(rows, chunk, heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(grid, keys, values, attn_mask=group.mask, is_causal=group.causal,
                                             enable_gqa=self.num_kv_heads != heads)
        if group.grid_index is None:
            return out.reshape(rows, heads * dim)
        return out.transpose(1, 2).reshape(rows * chunk, heads * dim)[group.grid_index]


def decode_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 hidden: torch.Tensor, weights: tuple[torch.Tensor | None, ...], k_cache: torch.Tensor,
                 v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, *,
                 heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """One dense decoder layer of the static-shape decode step, as a pure function of tensors.

    x [S, hidden] holds one token for each slot 0..S-1 at `positions` [S]; its key and
    value are written into this layer's cache buffers [slots, kv_heads, L, D] (FP8 under
    `k_scale`/`v_scale` [kv_heads] when given), and it attends over the first K =
    hidden.shape[1] positions of its slot, `hidden` [S, K] True where a key is not visible.
    `weights` = (input norm, qkv weight, qkv bias, o weight, o bias, post-attention norm,
    gate_up weight, gate_up bias, down weight, down bias) of `DecoderLayer` (biases may be
    None).

    The same maths as `Attention.forward` + `MLP.forward`; written with explicit matmuls so
    that grouped-query heads never copy K/V, and with no module state, so that one
    `torch.compile` of it serves every layer (decode_graph.py).
    """
    ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b = weights
    n, dim = x.shape[0], cos.shape[-1]
    qkv = attention_input(x, ln1, qkv_w, qkv_b, eps).view(n, heads + 2 * kv_heads, dim)
    qk = qkv[:, :heads + kv_heads]
    qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin  # RoPE, as in Attention.forward
    q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
    store_tokens(k_cache, k_scale, slots, positions, k)
    store_tokens(v_cache, v_scale, slots, positions, v)
    keys = load_range(k_cache, k_scale, n, hidden.shape[1], x.dtype)  # [S, kv_heads, K, D]
    values = load_range(v_cache, v_scale, n, hidden.shape[1], x.dtype)
    # Query head h uses kv head h // (heads / kv_heads), as HF's repeat_kv.
    q = q.reshape(n, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * dim ** -0.5  # [S, kv, G, K]
    probs = scores.masked_fill_(hidden[:, None, None, :], float("-inf")).softmax(dim=-1)
    out = torch.matmul(probs.to(values.dtype), values).reshape(n, heads * dim)
    return attention_output_mlp(x, out, weights, eps)


def attention_input(x: torch.Tensor, ln1: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
    """The fused QKV projection of the normed input [S, hidden] -> [S, (heads + 2 kv_heads) * D]."""
    return F.linear(rms_norm(x, ln1, eps), qkv_w, qkv_b)


def attention_output_mlp(x: torch.Tensor, out: torch.Tensor, weights: tuple[torch.Tensor | None, ...],
                         eps: float) -> torch.Tensor:
    """The rest of a decode layer after attention: x + o_proj(out), then x + mlp(norm(x))."""
    _, _, _, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b = weights
    x, normed = attention_output_norm(x, out, o_w, o_b, ln2, eps)
    gate, up = F.linear(normed, gate_up_w, gate_up_b).chunk(2, dim=-1)
    return mlp_down(x, F.silu(gate) * up, down_w, down_b)


def attention_output_norm(x: torch.Tensor, out: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                          ln2: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + o_proj(out), and that normed for the MLP."""
    x = x + F.linear(out, o_w, o_b)
    return x, rms_norm(x, ln2, eps)


def mlp_down(x: torch.Tensor, gated: torch.Tensor, down_w: torch.Tensor, down_b: torch.Tensor | None) -> torch.Tensor:
    """x + down_proj(silu(gate) * up)."""
    return x + F.linear(gated, down_w, down_b)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, spec: ModelSpec, device, dtype):
        super().__init__()
        h, m = spec.hidden_size, spec.intermediate_size
        self.gate_up_weight, self.gate_up_bias, (self.gate_proj, self.up_proj) = _fused(
            [m, m], h, spec.mlp_bias, device, dtype)
        down_bias = torch.empty(h, device=device, dtype=dtype) if spec.mlp_bias else None
        self.down_proj = Weight(torch.empty(h, m, device=device, dtype=dtype), down_bias)
        self.intermediate_size = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).split(self.intermediate_size, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, device, dtype):
        super().__init__()
        self.self_attn = Attention(spec, device, dtype)
        if spec.is_moe:
            self.mlp = SparseMoE(spec.num_experts, spec.num_experts_per_tok, spec.hidden_size, spec.intermediate_size,
                                 spec.norm_topk_prob, device, dtype)
        else:
            self.mlp = MLP(spec, device, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)


class Backbone(nn.Module):
    """Named `model` inside `CausalLM`, as in HF, so parameter names match."""

    def __init__(self, spec: ModelSpec, device, dtype):
        super().__init__()
        self.embed_tokens = Weight(torch.empty(spec.vocab_size, spec.hidden_size, device=device, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(spec, device, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, device, dtype)


class CausalLM(nn.Module):
    """A Llama/Qwen2/Mixtral causal LM whose `named_parameters()` are the HF names.

    Build with `CausalLM.build(spec, state_dict, device, dtype)`; `forward(layout, cache)`
    returns the logits of the tokens `layout.logit_index` points at. Parameters are
    allocated once on `device` (some are views into fused tensors): never `.to()` the
    module, build another one instead.
    """

    def __init__(self, spec: ModelSpec, max_positions: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec, device, dtype)
        self.lm_head = None
        if not spec.tie_word_embeddings:
            self.lm_head = Weight(torch.empty(spec.vocab_size, spec.hidden_size, device=device, dtype=dtype))
        self.max_positions = max_positions
        self.last_routes: torch.Tensor | None = None  # MoE: [tokens, layers, k] expert ids of the last forward
        self._decode_weights: list[tuple[torch.Tensor | None, ...]] | None = None
        self._rope_tables(device, dtype)

    @classmethod
    def build(cls, spec: ModelSpec, state_dict: Mapping[str, torch.Tensor], device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, max_positions: int | None = None) -> "CausalLM":
        """Allocate on `device` (no random init), then copy `state_dict` in (strict)."""
        model = cls(spec, max_positions or spec.max_position_embeddings, device, dtype).eval()
        model.load_weights(state_dict, strict=True)
        return model

    # ------------------------------------------------------------------ weights

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> int:
        """Copy HF-named tensors into the live parameters (cast to their dtype/device).

        Names and shapes are all checked before anything is copied, so a bad state dict
        leaves the weights untouched. Ignored names: `lm_head.weight` of a tied model and
        rotary `inv_freq` buffers. MoE: HF's on-disk per-expert names are accepted too
        (moe.convert_legacy_moe). `strict` also requires every parameter. Returns the
        number of tensors copied.
        """
        if self.spec.is_moe and any(".block_sparse_moe." in name for name in state_dict):
            state_dict = convert_legacy_moe(state_dict, self.spec.num_experts)
        params = dict(self.named_parameters())
        ignored = {"lm_head.weight"} if self.lm_head is None else set()
        shape_of = getattr(state_dict, "shape_of", None)  # a SafetensorsDir: shapes without reading the tensors
        todo = []
        for name in state_dict.keys():
            if name in ignored or name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in params:
                raise ValueError(f"weight {name!r} is not a parameter of this {self.spec.model_type} model "
                                 f"(expected HF names such as 'model.layers.0.self_attn.q_proj.weight').")
            shape = tuple(shape_of(name) if shape_of is not None else state_dict[name].shape)
            if shape != tuple(params[name].shape):
                raise ValueError(f"weight {name!r} has shape {shape}; "
                                 f"the model expects {tuple(params[name].shape)}.")
            todo.append((params[name], name))
        if strict:
            missing = sorted(set(params) - set(state_dict))
            if missing:
                raise ValueError(f"state dict lacks {len(missing)} weight(s), e.g. {missing[:3]}; "
                                 "pass every parameter (HF names) or load with strict=False.")
        with torch.no_grad():
            for param, name in todo:  # one tensor at a time: a SafetensorsDir reads each only here
                param.copy_(state_dict[name])
        return len(todo)

    def _rope_tables(self, device, dtype) -> None:
        """cos/sin of every position, computed in fp32 like HF's rotary embedding:
        angle(p, i) = p * theta^(-2i/D) (Su et al. 2021), repeated over the two halves;
        `_sin` carries the sign of rotate_half (-sin on the first half)."""
        d = self.spec.head_dim
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self._cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(device=device, dtype=dtype)
        self._sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)

    # ------------------------------------------------------------------ forward

    def forward(self, layout: StepLayout, cache: KVCache) -> torch.Tensor:
        """Feed the packed new tokens of `layout`, writing their keys/values into `cache`;
        returns the logits [len(layout.logit_index), vocab] in the model dtype."""
        x = F.embedding(layout.input_ids, self.model.embed_tokens.weight)
        cos = self._cos[layout.positions].unsqueeze(1)  # [T, 1, D] broadcast over heads
        sin = self._sin[layout.positions].unsqueeze(1)
        for i, block in enumerate(self.model.layers):
            x = x + block.self_attn(block.input_layernorm(x), cos, sin, i, cache, layout)
            x = x + block.mlp(block.post_attention_layernorm(x))
        if self.spec.is_moe:
            self.last_routes = torch.stack([block.mlp.last_routes for block in self.model.layers], dim=1)
        if layout.logit_index is not None:
            x = x[layout.logit_index]
        return F.linear(self.model.norm(x), self.head_weight())

    def decode_slots(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, key_len: int,
                     slot_index: torch.Tensor, key_index: torch.Tensor,
                     layer_fn: Callable[..., torch.Tensor] | None = None,
                     stack: Callable[..., torch.Tensor] | None = None, head: bool = True) -> torch.Tensor:
        """Static-shape decode: token `input_ids[s]` at `positions[s]` of slot s for every s in
        0..S-1 (S = len(input_ids)), attending over positions 0..key_len-1 of its slot
        (`key_len` > every position). `slot_index` / `key_index` are arange tensors of at
        least S / key_len elements (kept by the caller so a captured graph allocates none).
        `layer_fn` runs one layer (default `decode_layer`; the decode runner passes a
        `torch.compile`d `decode_layer`); `stack` instead runs all layers and the final norm
        (fused_stack.FusedStack, under `decode_attention: fused`). Returns the logits [S, vocab]
        of every slot (with `head` False the final norm's output [S, hidden], which `head_weight`
        maps to the logits); rows of idle slots are meaningless."""
        if self.spec.is_moe:
            raise ValueError("decode_slots (static/graph decode) runs dense models only; use decode_path 'eager' "
                             "for a mixture-of-experts model.")
        layer_fn = layer_fn or decode_layer
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        heads, kv_heads, eps = self.spec.num_heads, self.spec.num_kv_heads, self.spec.rms_norm_eps
        if stack is not None:  # keys are read up to each slot's position: no mask, no slot index
            norm = self.model.norm
            normed = stack(x, cos, sin, positions, self.decode_weights(), cache, norm.weight, norm.eps,
                           heads=heads, kv_heads=kv_heads, eps=eps)
        else:
            slots = slot_index[:input_ids.shape[0]]
            hidden = key_index[:key_len][None, :] > positions[:, None]  # [S, K] True = not visible
            for i, weights in enumerate(self.decode_weights()):
                k_scale, v_scale = cache.layer_scales(i)
                x = layer_fn(x, cos, sin, slots, positions, hidden, weights, cache.k[i], cache.v[i], k_scale, v_scale,
                             heads=heads, kv_heads=kv_heads, eps=eps)
            normed = self.model.norm(x)
        return F.linear(normed, self.head_weight()) if head else normed

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, hidden]: the embedding's for a tied model (no bias)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def decode_weights(self) -> list[tuple[torch.Tensor | None, ...]]:
        """Per layer, the tensors `decode_layer` takes (in the order `decode_layer` documents). Parameters
        are updated in place by `load_weights`, so the list is built once."""
        if self._decode_weights is None:
            self._decode_weights = [
                (b.input_layernorm.weight, b.self_attn.qkv_weight, b.self_attn.qkv_bias, b.self_attn.o_proj.weight,
                 b.self_attn.o_proj.bias, b.post_attention_layernorm.weight, b.mlp.gate_up_weight, b.mlp.gate_up_bias,
                 b.mlp.down_proj.weight, b.mlp.down_proj.bias)
                for b in self.model.layers]
        return self._decode_weights

    @torch.no_grad()
    def kv_amax(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute maxima [layers, kv_heads] (float32) of the keys (after RoPE, as cached)
        and values of every token of `sequences`, computed in the model dtype through a
        scratch cache: what FP8 KV scales are calibrated from."""
        weight = self.model.embed_tokens.weight
        longest = max(len(s) for s in sequences)
        if longest > self.max_positions:
            raise ValueError(f"a calibration sequence has {longest} tokens; this model has {self.max_positions} "
                             "positions.")
        cache = KVCache(self.spec.num_layers, len(sequences), longest, self.spec.num_kv_heads, self.spec.head_dim,
                        dtype=weight.dtype, device=weight.device)
        rows = [(cache.allocate(), 0, ids) for ids in sequences]
        layout = StepLayout.build(rows, want_logits=[False] * len(rows), device=weight.device)
        self.forward(layout, cache)  # unfilled positions stay 0 and cannot raise a maximum
        return cache.k.abs().amax(dim=(1, 3, 4)).float(), cache.v.abs().amax(dim=(1, 3, 4)).float()

    @torch.no_grad()
    def sequence_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, V] of equal-length sequences [B, L], through a scratch cache (MoE:
        `last_routes` then holds the routes [B * L, layers, k], row-major over [B, L])."""
        batch, length = input_ids.shape
        if length > self.max_positions:
            raise ValueError(f"sequences of {length} tokens exceed this model's {self.max_positions} positions.")
        weight = self.model.embed_tokens.weight
        cache = KVCache(self.spec.num_layers, batch, length, self.spec.num_kv_heads, self.spec.head_dim,
                        dtype=weight.dtype, device=weight.device)
        rows = [(cache.allocate(), 0, ids) for ids in input_ids.tolist()]
        layout = StepLayout.build(rows, want_logits=[True] * batch, all_logits=True, device=weight.device)
        return self.forward(layout, cache).view(batch, length, -1)


# ---------------------------------------------------------------------- loading


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """`config.json` of an HF directory, with eos ids of `generation_config.json` merged in."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an HF model directory holds config.json and *.safetensors.")
    cfg = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids = []
        for value in (cfg.get("eos_token_id"), gen_eos):
            if value is not None:
                ids.extend(value if isinstance(value, list) else [value])
        cfg["eos_token_id"] = sorted(set(ids)) or None
    return cfg


class SafetensorsDir(Mapping):
    """The tensors of a directory's `*.safetensors` files, read one at a time on access (so
    loading a model holds the model and one tensor, not a second copy of every weight)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    self._where[name] = f
                    self._shapes[name] = tuple(fh.get_slice(name).get_shape())

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as fh:
            return fh.get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_safetensors_dir(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files of a directory (sharded or not), on CPU."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state

"""The fused decode step's layer stack: each layer's closing residual add fused with the next norm.

Owns: `FusedStack`, what `CausalLM.decode_slots` runs for all layers and the final norm under
`decode_attention: fused`; `decode_layer_fused`, one such layer in `model.decode_layer`'s
signature (the tests' layer-level check); and the pure functions whose compiled forms join a
residual add to the norm after it (`down_add_norm`, `mlp_add_norm`). Per layer, from the
input already normed: QKV projection, attention kernel (decode_attention.py), output
projection with its residual add fused into the post-attention norm, the MLP (fused_mlp.py
under `decode_mlp: fused`), down projection with its residual add fused into the *next*
layer's input norm (after the last, the final norm): no residual or norm kernel of its own,
no cuBLAS beta-add copying the residual; the eager layer's roundings.

Does not own: the parts' maths (model.py), the kernels (decode_attention, fused_mlp, split_k),
compilation or when the fused step runs (decode_graph.py). Read more: docs/generation.md.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from rl_core.generation.native.kv_cache import KVCache
from rl_core.generation.native.model import rms_norm, attention_output_norm, mlp_down
from rl_core.generation.native import split_k


def down_add_norm(x: torch.Tensor, gated: torch.Tensor, down_w: torch.Tensor, down_b: torch.Tensor | None,
                  ln: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + down_proj(gated), and that normed by `ln` (the next layer's input norm or the final
    norm; None: the sum alone)."""
    x = mlp_down(x, gated, down_w, down_b)
    return x, None if ln is None else rms_norm(x, ln, eps)


def partials_add_norm(x: torch.Tensor, parts: torch.Tensor, bias: torch.Tensor | None, ln: torch.Tensor | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + a projection given as split-K float32 partials (`split_k.summed`), and that normed by
    `ln` (None: the sum alone)."""
    x = x + split_k.summed(parts, bias, x.dtype)
    return x, None if ln is None else rms_norm(x, ln, eps)


def mlp_add_norm(x: torch.Tensor, normed: torch.Tensor, gate_up_w: torch.Tensor, gate_up_b: torch.Tensor | None,
                 down_w: torch.Tensor, down_b: torch.Tensor | None, ln: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch SwiGLU MLP of `normed` added to x, then `down_add_norm`'s norm."""
    return down_add_norm(x, gate_up_gated(normed, gate_up_w, gate_up_b), down_w, down_b, ln, eps)


def gate_up_gated(normed: torch.Tensor, gate_up_w: torch.Tensor, gate_up_b: torch.Tensor | None) -> torch.Tensor:
    """The torch SwiGLU MLP's first half: silu(gate) * up of `normed`."""
    gate, up = F.linear(normed, gate_up_w, gate_up_b).chunk(2, dim=-1)
    return F.silu(gate) * up


def _plain(fn: Callable, **_) -> Callable:
    return fn


# The output and down projections as split-K partials summed in the add + norm kernel (split_k.py)
# instead of cuBLAS + the compiled add + norm. A module switch for benchmarks (bench/generation_gpu.py
# runs both side by side); read when a stack is built.
SPLIT_K = True
# With SPLIT_K, the QKV projection through split_k.linear (a Triton matmul, so that the attention kernel
# after it launches under PDL) instead of cuBLAS: a switch for benchmarks too.
TRITON_QKV = True


class FusedStack:
    """The layers of a fused-attention decode step. `compile_fn(fn, unfused_residual=...)`
    compiles the element-wise parts (decode_graph._compiled); None runs them eagerly (the CPU
    tests, through Triton's interpreter)."""

    def __init__(self, fused_mlp: bool, compile_fn: Callable | None = None, split_k: bool | None = None):
        c = compile_fn or _plain
        self.fused_mlp = fused_mlp
        self.split_k = SPLIT_K if split_k is None else split_k
        self.triton_qkv = self.split_k and TRITON_QKV
        self.norm = c(rms_norm)
        self.gate_up = c(gate_up_gated)
        self.output_norm = c(attention_output_norm, unfused_residual=True)
        self.closing = c(down_add_norm if fused_mlp else mlp_add_norm, unfused_residual=True)
        if fused_mlp:
            from rl_core.generation.native.fused_mlp import gate_up_silu
            self._gate_up = gate_up_silu

    def layer(self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor, weights: tuple[torch.Tensor | None, ...], k_cache: torch.Tensor,
              v_cache: torch.Tensor, next_norm: torch.Tensor | None, *, heads: int, kv_heads: int, eps: float,
              next_eps: float, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer from x and its normed input: (x after the layer, x normed by `next_norm`).
        `k_scale` / `v_scale`: the layer's FP8 scales when the cache is FP8 (else None)."""
        from rl_core.generation.native.decode_attention import rope_store_attend

        _, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b = weights
        n, dim = x.shape[0], cos.shape[-1]
        qkv = (split_k.linear(normed, qkv_w, qkv_b) if self.triton_qkv else F.linear(normed, qkv_w, qkv_b))
        qkv = qkv.view(n, heads + 2 * kv_heads, dim)
        out = rope_store_attend(qkv, cos, sin, positions, k_cache, v_cache, heads, kv_heads,
                                k_scale=k_scale, v_scale=v_scale)
        if self.split_k:
            x, normed = split_k.add_norm(x, split_k.partials(out, o_w, kind="output"), o_b, ln2, eps)
            gated = (self._gate_up if self.fused_mlp else self.gate_up)(normed, gate_up_w, gate_up_b)
            return split_k.add_norm(x, split_k.partials(gated, down_w, kind="down"), down_b, next_norm, next_eps)
        x, normed = self.output_norm(x, out, o_w, o_b, ln2, eps)
        if self.fused_mlp:
            return self.closing(x, self._gate_up(normed, gate_up_w, gate_up_b), down_w, down_b, next_norm, next_eps)
        return self.closing(x, normed, gate_up_w, gate_up_b, down_w, down_b, next_norm, next_eps)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 layers: Sequence[tuple[torch.Tensor | None, ...]], cache: KVCache, final_norm: torch.Tensor,
                 final_eps: float, *, heads: int, kv_heads: int, eps: float) -> torch.Tensor:
        """Every layer over the embedded tokens x [S, hidden]; returns the final norm's output. An FP8
        cache is read and written under its scales (`KVCache.layer_scales`, read by the kernel
        from the scale tensors at each launch)."""
        normed = self.norm(x, layers[0][0], eps)
        last = len(layers) - 1
        for i, weights in enumerate(layers):
            nxt, nxt_eps = (layers[i + 1][0], eps) if i < last else (final_norm, final_eps)
            k_scale, v_scale = cache.layer_scales(i)
            x, normed = self.layer(x, normed, cos, sin, positions, weights, cache.k[i], cache.v[i], nxt,
                                   heads=heads, kv_heads=kv_heads, eps=eps, next_eps=nxt_eps, k_scale=k_scale,
                                   v_scale=v_scale)
        return normed


def decode_layer_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                       positions: torch.Tensor, hidden: torch.Tensor, weights: tuple[torch.Tensor | None, ...],
                       k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, *, heads: int, kv_heads: int, eps: float,
                       fused_mlp: bool = False, split_k: bool | None = None) -> torch.Tensor:
    """`model.decode_layer` through one eager `FusedStack` layer (`split_k`: its projections'
    switch, None = `SPLIT_K`): same arguments and result up to float rounding, an FP8 cache
    under `k_scale` / `v_scale` included. Row s must be slot s; keys are read up to each row's
    own position, so `hidden` and `slots` are not used."""
    stack = FusedStack(fused_mlp, split_k=split_k)
    x, _ = stack.layer(x, rms_norm(x, weights[0], eps), cos, sin, positions, weights, k_cache, v_cache, None,
                       heads=heads, kv_heads=kv_heads, eps=eps, next_eps=eps, k_scale=k_scale, v_scale=v_scale)
    return x

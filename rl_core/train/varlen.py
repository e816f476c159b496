"""Variable-length attention for packed microbatches (`trainer.packing`), for every trainer.

Owns: `varlen_attention`, causal attention of sequences laid end to end ([tokens, heads, dim],
sequence offsets `cu_seqlens`, rl_core.packing.PackedRows), and its two paths, picked per call
by `attention_path`: `varlen`, torch's FlashAttention-2 variable-length kernels
(`torch.nn.attention.varlen`, CUDA and bf16/fp16 only; Dao 2023, arXiv:2307.08691), no
padding and no mask; `padded`, everywhere else: the sequences scattered into a [sequences,
longest] batch for one causal SDPA call (right padding under a causal mask: no query sees a
padding key) and gathered back, so only the attention pays for padding. Also the transformers
attention function of packed HF models (`use_packed_attention`; calls the trainers did not
pack are laid out by `unpacked_layout`), the model families served, and `resolve_packing`.
Does not own: the packed layout and microbatch plans (rl_core.packing), Megatron's core
attention (megatron.py calls `varlen_attention`). Read more: docs/performance.md, "Sequence packing".
"""

from __future__ import annotations

import inspect

import torch

from rl_core.errors import RecipeError
from rl_core.train.causal_lm import llama_like_reason

ATTENTION_NAME = "rl_core_packed"  # the attention implementation packed HF models are set to


def packing_unsupported_reason(model_or_config) -> str | None:
    """None when packing serves this HF model (or config): a Llama-like type
    (`rl_core.train.causal_lm.LLAMA_LIKE_TYPES`) without a sliding window or attention dropout."""
    reason = llama_like_reason(model_or_config, "whose attention takes packed sequences here")
    if reason:
        return reason
    cfg = getattr(model_or_config, "config", model_or_config)
    window = getattr(cfg, "sliding_window", None)
    if window is not None:  # (Qwen2/3 set it only when use_sliding_window is on)
        return f"the model attends within a sliding window of {window} tokens, which packed attention does not apply"
    dropout = getattr(cfg, "attention_dropout", 0.0) or 0.0
    if dropout:
        return f"the model applies attention dropout ({dropout}), which packed attention does not"
    return None


def _find_flash_varlen():
    """(torch's `varlen_attn`, the names of its parameters) where this torch has them, else None.
    Its signature moved between releases (causality as `is_causal` or as `window_size=(-1, 0)`;
    `enable_gqa`). Looked up once, at import: compiled layers read the result as a constant."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = frozenset(inspect.signature(varlen_attn).parameters)
    if "is_causal" not in params and "window_size" not in params:
        return None
    return varlen_attn, params


_FLASH_VARLEN = _find_flash_varlen()


def attention_path(q: torch.Tensor) -> str:
    """`varlen` (flash kernels: CUDA, bf16/fp16, torch's varlen API present) or `padded`."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and _FLASH_VARLEN is not None:
        return "varlen"
    return "padded"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed row: q [N, Hq, D], k and v [N, Hkv, D]
    (grouped-query attention when Hkv < Hq: query head h reads key/value head h // (Hq / Hkv)),
    `cu_seqlens` [s + 1] int32 offsets, `max_len` the longest sequence; returns [N, Hq, D].
    The `varlen` path is torch's custom operator, which a compiled decoder layer traces (no graph
    break: one compiled region a layer; `max_len` stays a symbol there, no recompile per size)."""
    if attention_path(q) == "varlen":
        return _flash(q, k, v, cu_seqlens, max_len, scale)
    return _padded(q, k, v, cu_seqlens, max_len, scale)


def _flash(q, k, v, cu_seqlens, max_len: int, scale):
    fn, params = _FLASH_VARLEN
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return _padded(q, k, v, cu_seqlens, max_len, scale)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # the same grouping as the flag: each key/value head serves consecutive query heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kwargs)


@torch.compiler.disable  # a compiled layer runs it eagerly: its layout depends on the offsets' values
def _padded(q, k, v, cu_seqlens, max_len: int, scale):
    """The sequences as rows of a [s, max_len] batch, one causal SDPA call, the rows' real
    positions gathered back (no host synchronisation: the slots come from the offsets on the device)."""
    n_tok, s = q.shape[0], cu_seqlens.numel() - 1
    gqa = k.shape[1] != q.shape[1]
    if n_tok == s * max_len:  # every sequence is max_len long (none is longer): the rows are a reshape
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.view(s, max_len, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)), is_causal=True, scale=scale,
            enable_gqa=gqa)
        return out.transpose(1, 2).reshape(q.shape)
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    tok = torch.arange(n_tok, device=q.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    slot = seq * max_len + (tok - cu[seq])

    def rows(x: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [s, H, max_len, D]
        out = x.new_zeros((s * max_len, *x.shape[1:])).index_copy(0, slot, x)
        return out.view(s, max_len, *x.shape[1:]).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, scale=scale,
                                                           enable_gqa=gqa)
    return out.transpose(1, 2).reshape(s * max_len, *q.shape[1:]).index_select(0, slot)


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, **kwargs):
    """transformers' attention-function interface ([b, heads, T, dim] in, [b, T, heads, dim] out).
    A packed row (one row; its offsets from the model call: `PackedRows.model_kwargs`) goes
    straight to `varlen_attention` (traced by a compiled layer); any other call (`unpacked_layout`)
    is laid out the same way first, eagerly, so the model stays usable outside the trainers' packed
    forwards."""
    if dropout or sliding_window is not None:  # resolve_packing turns packing off for such models
        raise RuntimeError(f"packed attention called with dropout {dropout} / sliding window {sliding_window}, "
                           "which it does not apply")
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is not None and max_len is not None and query.shape[0] == 1:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return varlen_attention(q, k, v, cu, max_len, scaling).unsqueeze(0), None
    return _unpacked_attention(query, key, value, attention_mask, scaling, kwargs.get("position_ids")), None


@torch.compiler.disable  # the layout reads the mask's values on the host
def _unpacked_attention(query, key, value, attention_mask, scaling, position_ids) -> torch.Tensor:
    b, heads, t, dim = query.shape
    if key.shape[2] != t:
        raise RuntimeError(f"packed attention over {t} queries and {key.shape[2]} keys: it serves whole-sequence "
                           "forwards (no KV cache); load the model without trainer.packing to generate with it")
    index, cu, max_len = unpacked_layout(attention_mask, position_ids, b, t, query.device)
    if not max_len:  # no real token
        return query.new_zeros((b, t, heads, dim))
    q, k, v = (x.transpose(1, 2).reshape(b * t, *x.shape[1::2]).index_select(0, index) for x in (query, key, value))
    out = varlen_attention(q, k, v, cu, max_len, scaling)
    return out.new_zeros((b * t, heads, dim)).index_copy(0, index, out).view(b, t, heads, dim)


def unpacked_layout(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, b: int, t: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The packed layout of a call the trainers did not pack: (the flat index of each real token,
    sequence offsets, the longest sequence). Real tokens: the 2D `attention_mask` (either padding
    side), all without one. A sequence starts at each row's first real token and, without a
    mask, wherever the position ids restart at 0 (rows packed the transformers way)."""
    real = (attention_mask.bool() if attention_mask is not None
            else torch.ones((b, t), dtype=torch.bool, device=device))
    first = real & (real.long().cumsum(dim=1) == 1)
    if attention_mask is None and position_ids is not None:
        first = first | (position_ids.expand(b, t) == 0)
    index = real.reshape(-1).nonzero().squeeze(1)
    starts = first.reshape(-1).index_select(0, index).nonzero().squeeze(1)
    cu = torch.cat([starts, starts.new_tensor([index.numel()])]).to(torch.int32)
    return index, cu, int((cu[1:] - cu[:-1]).max().item()) if starts.numel() else 0


def use_packed_attention(model: torch.nn.Module) -> None:
    """Make an HF model (causal LM or base model) attend through `packed_attention_forward`, with
    transformers' FlashAttention mask rule (a 2D padding mask or none: no [T, T] mask is built).
    The model's config on disk is unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)
    model.set_attn_implementation(ATTENTION_NAME)


def resolve_packing(setting: str, model_config, model: str = "policy") -> bool:
    """`trainer.packing` for a model with this HF config: `off` False; `auto` whether packed
    attention serves the model; `on` True, or a RecipeError (before any weights load) when it
    does not. `model` names it in the error (the policy, or the critic's model)."""
    if setting == "off":
        return False
    reason = packing_unsupported_reason(model_config)
    if reason and setting == "on":
        raise RecipeError.single("trainer.packing", "on", f"'auto' or 'off' for this {model}: {reason}",
                                 "set trainer.packing: auto (packs only models it serves) or off.")
    return reason is None

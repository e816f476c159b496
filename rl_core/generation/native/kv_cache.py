"""The preallocated slot KV cache (optionally FP8) and the index tensors of one batched forward.

Owns: `KVCache`, a fixed block `[layers, slots, kv_heads, max_seq_len, head_dim]` (one slot per
running sequence, its filled length, a free-slot heap handing out the lowest slot first so
busy slots stay dense), and `StepLayout`, which turns "these rows feed these new tokens at
these positions" into packed token ids and positions, cache write indices, and one
`AttentionGroup` per kind of row (decode, prefill) with its padded query grid and boolean mask
(none where a group sees every key or is plainly causal, so fused SDPA kernels can run): the
projections run packed, attention pads only within a group. FP8 storage (`fp8_e4m3`):
clamp(x / scale, +-448) in e4m3, one float32 scale per (layer, kv head) for keys and values
(Micikevicius et al. 2022, per head), written through a uint8 view, scales updated in place
(`set_scales`: captured graphs stay valid; what is held is re-quantised).

Does not own: the model maths, which rows run, or the scales' choice (kv_calibration.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch


FP8_E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn value
KV_STORAGE = ("auto", "fp8_e4m3")


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, D] / scale [..., kv_heads] -> float8_e4m3fn (saturating at +-448)."""
    return (x.float() / scale[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [rows, kv_heads, L, D] in e4m3 * scale [kv_heads] -> `dtype`."""
    return x.to(dtype) * scale.to(dtype)[None, :, None, None]


def store_tokens(buf: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, positions: torch.Tensor,
                 x: torch.Tensor) -> None:
    """Write x [T, kv_heads, D] into one layer's buffer [slots, kv_heads, L, D] at (slots[t],
    positions[t]); FP8-encoded under `scale` [kv_heads] when given (else stored as is)."""
    if scale is None:
        buf[slots, :, positions] = x
    else:
        # index_put through a uint8 view: the same bytes, and no FP8 kernel needed.
        buf.view(torch.uint8)[slots, :, positions] = quantize_fp8(x, scale).view(torch.uint8)


def load_range(buf: torch.Tensor, scale: torch.Tensor | None, num_slots: int, key_len: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Slots 0..num_slots-1, positions 0..key_len-1 of one layer's buffer, in `dtype` (a view
    unless FP8-encoded, which is decoded under `scale`)."""
    block = buf[:num_slots, :, :key_len]
    return block if scale is None else dequantize_fp8(block, scale, dtype)


class KVCache:
    """Keys and values of every slot, their filled lengths and the free slots.

    `dtype` is the compute dtype (what `gather`/`slot_range` return); `storage` is "auto"
    (store in `dtype`) or "fp8_e4m3" (1-byte storage with per-(layer, kv head) scales).
    """

    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", storage: str = "auto"):
        if storage not in KV_STORAGE:
            raise ValueError(f"KV cache storage is {storage!r}; expected one of {KV_STORAGE}.")
        self.fp8 = storage == "fp8_e4m3"
        self.dtype = dtype
        self.storage_dtype = torch.float8_e4m3fn if self.fp8 else dtype
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=self.storage_dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.storage_dtype, device=device)
        # Per-(layer, kv head) scales, float32, updated in place only (CUDA graphs hold them).
        self.k_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device) if self.fp8 else None
        self.v_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device) if self.fp8 else None
        self.num_layers, self.num_slots, self.max_seq_len = num_layers, num_slots, max_seq_len
        self.lengths = [0] * num_slots  # positions 0 .. lengths[s]-1 of slot s hold valid keys/values
        self._free = list(range(num_slots))  # a heap: allocate() returns the lowest free slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache has no free slot")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"slot {slot} is not in use"
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def write(self, layer: int, token_slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values [T, kv_heads, head_dim] of T tokens at (slot, position)."""
        store_tokens(self.k[layer], self.k_scale[layer] if self.fp8 else None, token_slots, positions, k)
        store_tokens(self.v[layer], self.v_scale[layer] if self.fp8 else None, token_slots, positions, v)

    def gather(self, layer: int, slots: torch.Tensor, key_len: int,
               slot_start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, kv_heads, key_len, head_dim] of the given slots: a view
        when the slots are one ascending run starting at `slot_start` (and storage is not
        FP8), else a copy."""
        if slot_start is not None:
            stop = slot_start + slots.shape[0]
            k, v = self.k[layer, slot_start:stop, :, :key_len], self.v[layer, slot_start:stop, :, :key_len]
        elif self.fp8:
            k = self.k[layer, :, :, :key_len].view(torch.uint8).index_select(0, slots).view(self.storage_dtype)
            v = self.v[layer, :, :, :key_len].view(torch.uint8).index_select(0, slots).view(self.storage_dtype)
        else:
            return (self.k[layer, :, :, :key_len].index_select(0, slots),
                    self.v[layer, :, :, :key_len].index_select(0, slots))
        return self._read(layer, k, v)

    def slot_range(self, layer: int, num_slots: int, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [num_slots, kv_heads, key_len, head_dim] of slots 0..num_slots-1
        (a view of the cache unless storage is FP8): the static-shape decode path reads these."""
        k_scale, v_scale = self.layer_scales(layer)
        return (load_range(self.k[layer], k_scale, num_slots, key_len, self.dtype),
                load_range(self.v[layer], v_scale, num_slots, key_len, self.dtype))

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) [kv_heads] of one layer (views, updated in place), or (None, None)."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.fp8 else (None, None)

    def _read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fp8:
            return k, v
        return dequantize_fp8(k, self.k_scale[layer], self.dtype), dequantize_fp8(v, self.v_scale[layer], self.dtype)

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor, requantize: bool = True) -> None:
        """Replace the FP8 scales [layers, kv_heads] (in place). With `requantize`, what the
        cache holds is re-encoded under the new scales (layer by layer), so sequences in
        flight keep their keys and values, up to one more FP8 rounding."""
        if not self.fp8:
            raise ValueError("set_scales needs an FP8 KV cache (storage='fp8_e4m3').")
        shape = tuple(self.k_scale.shape)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(scale.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(scale.shape)}; expected {shape} (layers, kv heads).")
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                raise ValueError(f"{name} must be finite and > 0.")
        k_scale = k_scale.to(self.k_scale.device, torch.float32)
        v_scale = v_scale.to(self.v_scale.device, torch.float32)
        if requantize:
            used = max((s + 1 for s in range(self.num_slots) if self.lengths[s]), default=0)
            width = max(self.lengths, default=0)
            if used and width:
                for layer in range(self.num_layers):
                    for store, old, new in ((self.k, self.k_scale, k_scale), (self.v, self.v_scale, v_scale)):
                        block = store[layer, :used, :, :width]
                        ratio = (old[layer] / new[layer])[None, :, None, None]
                        block.copy_((block.float() * ratio).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
                                    .to(self.storage_dtype))
        self.k_scale.copy_(k_scale)
        self.v_scale.copy_(v_scale)


@dataclass
class AttentionGroup:
    """Rows of a step that attend together: their packed tokens are
    `token_start:token_stop`, padded into a [rows, chunk] query grid."""

    token_start: int
    token_stop: int
    num_rows: int
    chunk: int  # longest new-token count of the group's rows
    key_len: int  # longest filled length after this step (keys attended over)
    slots: torch.Tensor  # [rows] long
    slot_start: int | None  # first slot when slots are consecutive (lets the cache return a view)
    mask: torch.Tensor | None  # [rows, 1, chunk, key_len] bool, True = attend; None = all / causal
    causal: bool  # with mask None: apply a plain causal mask (key_len == chunk)
    grid_index: torch.Tensor | None  # [tokens] index of each packed token in the grid; None when chunk == 1


@dataclass
class StepLayout:
    """The index tensors of one forward over new tokens of several slots."""

    input_ids: torch.Tensor  # [T] long, packed new tokens (group by group)
    positions: torch.Tensor  # [T] long, absolute position of each token
    token_slots: torch.Tensor  # [T] long, cache slot of each token
    groups: list[AttentionGroup]
    logit_index: torch.Tensor | None  # packed tokens whose logits are returned; None = all
    logit_rows: list[int]  # for each returned logit row: index into the `rows` given to build()

    @classmethod
    def build(cls, rows: Sequence[tuple[int, int, Sequence[int]]], want_logits: Sequence[bool],
              device: str | torch.device, all_logits: bool = False) -> "StepLayout":
        """`rows[i] = (slot, start, tokens)` feeds `tokens` at positions start.. of `slot`.

        Logits come back for the last token of each row with `want_logits[i]` (in the
        order of `logit_rows`), or for every packed token with `all_logits`.
        """
        single = [i for i, r in enumerate(rows) if len(r[2]) == 1]
        multi = [i for i, r in enumerate(rows) if len(r[2]) > 1]
        ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        logit_tokens: list[int] = []
        logit_rows: list[int] = []
        groups = []
        for members in (single, multi):
            if not members:
                continue
            token_start = len(ids)
            for i in members:
                slot, start, tokens = rows[i]
                ids.extend(tokens)
                positions.extend(range(start, start + len(tokens)))
                token_slots.extend([slot] * len(tokens))
                if want_logits[i]:
                    logit_tokens.append(len(ids) - 1)
                    logit_rows.append(i)
            groups.append(_group([rows[i] for i in members], token_start, len(ids), device))
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            input_ids=as_long(ids),
            positions=as_long(positions),
            token_slots=as_long(token_slots),
            groups=groups,
            logit_index=None if all_logits else as_long(logit_tokens),
            logit_rows=list(range(len(rows))) if all_logits else logit_rows,
        )


def _group(rows: Sequence[tuple[int, int, Sequence[int]]], token_start: int, token_stop: int,
           device: str | torch.device) -> AttentionGroup:
    slots = [r[0] for r in rows]
    starts = [r[1] for r in rows]
    counts = [len(r[2]) for r in rows]
    ends = [s + c for s, c in zip(starts, counts)]
    chunk, key_len = max(counts), max(ends)
    consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
    same_end = min(ends) == key_len
    if chunk == 1:
        grid_index, causal = None, False
        needs_mask = not same_end  # decode rows of one length see all their keys
    else:
        grid_index = torch.tensor([r * chunk + i for r, c in enumerate(counts) for i in range(c)],
                                  dtype=torch.long, device=device)
        causal = max(starts) == 0 and same_end and min(counts) == chunk
        needs_mask = not causal
    mask = None
    if needs_mask:
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        end_t = torch.tensor(ends, dtype=torch.long, device=device)
        key = torch.arange(key_len, device=device)
        query_pos = start_t[:, None] + torch.arange(chunk, device=device)[None, :]  # [rows, chunk]
        # Key j is visible to the query at position p iff j <= p (causal) and j is filled.
        # Padded query cells (i >= count) still see their row's keys, so no row is all-masked.
        mask = (key[None, None, :] <= query_pos[:, :, None]) & (key[None, None, :] < end_t[:, None, None])
        mask = mask.unsqueeze(1)
    return AttentionGroup(
        token_start=token_start, token_stop=token_stop, num_rows=len(rows), chunk=chunk, key_len=key_len,
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        slot_start=slots[0] if consecutive else None,
        mask=mask, causal=causal, grid_index=grid_index,
    )

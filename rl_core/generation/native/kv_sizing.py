"""Sizing the native engine's KV cache for `rl-core serve`.

Owns: the bytes one KV-cache slot takes (the cache is dense: layers x slots x kv heads x
max_seq_len x head_dim, keys and values), the memory available on a device, and the number
of slots (`max_batch_size`) when the user gave none: `DEFAULT_SLOTS` sequences of the full
context, so the cache is what the model needs at its context length and that batch, not a
share of the machine (`--kv-cache-memory-fraction` asks for the share instead, at most
`cap` slots). A slot count that cannot fit in the available memory is an error naming the
flags.

Does not own: allocating the cache (kv_cache.py) or the engine's token budget
(`max_num_kv_tokens`, engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this module stays torch-free (rl-core's parser reads DEFAULT_SLOTS)
    from rl_core.generation.native.model import ModelSpec

GIB = 1024 ** 3
DEFAULT_SLOTS = 4  # sequences decoded together when neither --max-batch-size nor a memory share is given
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVSizingError(ValueError):
    """The KV cache cannot fit; the message names the flags to change."""


def kv_bytes_per_slot(spec: ModelSpec, max_seq_len: int, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Keys + values of one slot over the full `max_seq_len` (what KVCache allocates)."""
    element = 1 if kv_cache_dtype == "fp8_e4m3" else _ELEMENT_BYTES[dtype]
    return 2 * spec.num_layers * spec.num_kv_heads * max_seq_len * spec.head_dim * element


def available_memory(device: str) -> int:
    """Bytes free now: the GPU's free memory on CUDA, the host's available memory on CPU."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    import psutil

    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class KVPlan:
    slots: int
    bytes_per_slot: int
    available: int
    fraction: float | None
    how: str  # "default", "requested" or "memory"

    @property
    def total(self) -> int:
        return self.slots * self.bytes_per_slot

    def describe(self, max_seq_len: int) -> str:
        how = (f"sized for the model: the default batch of {DEFAULT_SLOTS} full-context sequences "
               "(--max-batch-size for more)" if self.how == "default" else "--max-batch-size"
               if self.how == "requested" else f"sized from memory: {self.fraction:g} of the available")
        return (f"KV cache: {self.slots} slots x {max_seq_len} tokens = {self.total / GIB:.2f} GiB "
                f"({self.bytes_per_slot / 2**20:.1f} MiB per slot; {how}; {self.available / GIB:.1f} GiB available)")


def plan_kv_slots(spec: ModelSpec, max_seq_len: int, dtype: str, kv_cache_dtype: str, available: int,
                  requested: int | None, fraction: float | None, cap: int = 256) -> KVPlan:
    """Slots for the cache: `requested` if given, else as many as fit in `fraction * available`
    (at most `cap`) if a fraction is given, else `DEFAULT_SLOTS`; a count that does not fit in
    `available` is a KVSizingError naming the flags."""
    per_slot = kv_bytes_per_slot(spec, max_seq_len, dtype, kv_cache_dtype)
    if requested is None and fraction is not None:
        slots = min(cap, int(fraction * available) // per_slot)
        if slots < 1:
            raise KVSizingError(
                f"one KV-cache slot of --max-seq-len {max_seq_len} tokens takes {per_slot / GIB:.2f} GiB; expected it "
                f"to fit in --kv-cache-memory-fraction {fraction:g} of the {available / GIB:.1f} GiB available. Fix: "
                f"lower --max-seq-len, raise --kv-cache-memory-fraction, or use --kv-cache-dtype fp8_e4m3.")
        return KVPlan(slots, per_slot, available, fraction, "memory")
    slots, flag = (requested, f"--max-batch-size {requested}") if requested is not None else \
        (DEFAULT_SLOTS, f"the default --max-batch-size {DEFAULT_SLOTS}")
    if slots * per_slot > available:
        fits = available // per_slot
        raise KVSizingError(
            f"{flag} with --max-seq-len {max_seq_len} needs a KV cache of {slots * per_slot / GIB:.1f} GiB "
            f"({per_slot / 2**20:.1f} MiB per slot); expected at most the {available / GIB:.1f} GiB available "
            f"({fits} slots). Fix: lower --max-batch-size, lower --max-seq-len, or use --kv-cache-dtype fp8_e4m3.")
    return KVPlan(slots, per_slot, available, fraction, "requested" if requested is not None else "default")

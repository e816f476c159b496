"""Sizing the native engine's KV cache from the memory there is.

Owns: the bytes one KV-cache slot takes (the cache is dense: layers x slots x kv heads x
max_seq_len x head_dim, keys and values), the memory available on a device, and the choice
of the number of slots (`max_batch_size`) for `rl-core serve` when the user did not give one:
as many as fit in a fraction of the available memory, at most `cap`. An explicit slot count
that cannot fit in the available memory is an error naming the flags.

Does not own: allocating the cache (kv_cache.py) or the engine's token budget
(`max_num_kv_tokens`, engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_core.generation.native.model import ModelSpec

GIB = 1024 ** 3
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
    fraction: float
    sized_from_memory: bool

    @property
    def total(self) -> int:
        return self.slots * self.bytes_per_slot

    def describe(self, max_seq_len: int) -> str:
        how = (f"sized from memory: {self.fraction:g} of {self.available / GIB:.1f} GiB available"
               if self.sized_from_memory else f"--max-batch-size; {self.available / GIB:.1f} GiB available")
        return (f"KV cache: {self.slots} slots x {max_seq_len} tokens = {self.total / GIB:.2f} GiB "
                f"({self.bytes_per_slot / 2**20:.1f} MiB per slot; {how})")


def plan_kv_slots(spec: ModelSpec, max_seq_len: int, dtype: str, kv_cache_dtype: str, available: int,
                  requested: int | None, fraction: float, cap: int = 256) -> KVPlan:
    """Slots for the cache: `requested` if given (and it fits in `available`), else as many as fit
    in `fraction * available`, at most `cap`."""
    per_slot = kv_bytes_per_slot(spec, max_seq_len, dtype, kv_cache_dtype)
    if requested is not None:
        if requested * per_slot > available:
            fits = available // per_slot
            raise KVSizingError(
                f"--max-batch-size {requested} with --max-seq-len {max_seq_len} needs a KV cache of "
                f"{requested * per_slot / GIB:.1f} GiB ({per_slot / 2**20:.1f} MiB per slot); expected at most the "
                f"{available / GIB:.1f} GiB available ({fits} slots). Fix: lower --max-batch-size (or leave it out to "
                f"size it from memory), lower --max-seq-len, or use --kv-cache-dtype fp8_e4m3.")
        return KVPlan(requested, per_slot, available, fraction, False)
    slots = min(cap, int(fraction * available) // per_slot)
    if slots < 1:
        raise KVSizingError(
            f"one KV-cache slot of --max-seq-len {max_seq_len} tokens takes {per_slot / GIB:.2f} GiB; expected it to "
            f"fit in --kv-cache-memory-fraction {fraction:g} of the {available / GIB:.1f} GiB available. Fix: lower "
            f"--max-seq-len, raise --kv-cache-memory-fraction, or use --kv-cache-dtype fp8_e4m3.")
    return KVPlan(slots, per_slot, available, fraction, True)

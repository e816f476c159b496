"""Static-shape decode steps, captured as CUDA graphs per (slot bucket, key bucket).

Owns: `DecodeRunner`, the fast path of a step in which every row feeds exactly one token
(plain decoding, the bulk of generation). Instead of building a `StepLayout`, it runs
`CausalLM.decode_slots` over the slot range 0..S-1 of the cache with keys 0..K-1, where S
and K are *buckets*: the smallest listed sizes holding the highest busy slot and the longest
position of the step. The slot cache hands out the lowest free slot first, so busy slots
are dense and S is close to the batch; rows of idle slots in the range compute garbage
that nobody reads (they write at their slot's first unfilled position, which the slot's
own next write overwrites before anything attends to it).

Because shapes depend only on (S, K), each bucket pair can be captured once as a CUDA graph
(`torch.cuda.CUDAGraph`) and replayed: one launch instead of ~15 kernels per layer, which
is what removes the launch overhead of eager decoding (NVIDIA, "CUDA Graphs", CUDA C++
Programming Guide; PyTorch `torch.cuda.graph`). Graphs are captured lazily, on the first
step that needs a bucket pair, after a warm-up on a side stream as PyTorch requires; all
share one memory pool. Sharing is safe because graphs never run concurrently and each
graph's output logits are consumed (rows selected, copied) right after its replay, before
any other graph can reuse that memory for its intermediates. Everything a graph reads
lives at a fixed address and is updated in place: the static `input_ids`/`positions`
buffers (filled from the host each step), parameters (`load_weights` copies into them),
FP8 scales (`KVCache.set_scales` copies), the cache itself. So weight refits and KV-scale
syncs need no re-capture.

Modes: `use_graphs=False` runs the same static-shape function eagerly; that is how the
CPU exercises this path (tests compare it with the packed eager path), and what a CUDA
run uses if graphs are turned off.

Does not own: the maths (model.py), the cache (kv_cache.py), scheduling or sampling
(engine.py).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from rl_core.generation.kv_cache import KVCache
from rl_core.generation.model import CausalLM

DEFAULT_KEY_BUCKET_MIN = 64


def slot_buckets(max_slots: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to 128, every 32 up to 512, every 64 beyond,
    always ending at `max_slots` (the bucket sizes vLLM-style graph runners use, coarser)."""
    sizes, n = [], 1
    while n < 16:
        sizes.append(n)
        n *= 2
    step = 16
    while n < max_slots:
        sizes.append(n)
        step = 16 if n < 128 else 32 if n < 512 else 64
        n += step
    return sorted({s for s in sizes if s < max_slots} | {max_slots})


def key_buckets(max_seq_len: int, minimum: int = DEFAULT_KEY_BUCKET_MIN) -> list[int]:
    """Powers of two from `minimum`, ending at `max_seq_len`."""
    sizes, n = [], minimum
    while n < max_seq_len:
        sizes.append(n)
        n *= 2
    return sizes + [max_seq_len]


def pick_bucket(buckets: Sequence[int], need: int) -> int:
    """The smallest bucket >= need (buckets sorted ascending; the last one is the cap)."""
    i = bisect.bisect_left(buckets, need)
    if i == len(buckets):
        raise ValueError(f"{need} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class DecodeRunner:
    """Runs single-token steps over a slot range with static shapes (graphs on CUDA)."""

    def __init__(self, model: CausalLM, cache: KVCache, use_graphs: bool,
                 slot_sizes: Sequence[int] | None = None, key_sizes: Sequence[int] | None = None):
        device = cache.k.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}. "
                             "Use the eager or static decode path on this device.")
        self.model, self.cache, self.use_graphs, self.device = model, cache, use_graphs, device
        self.slot_sizes = sorted(slot_sizes) if slot_sizes else slot_buckets(cache.num_slots)
        self.key_sizes = sorted(key_sizes) if key_sizes else key_buckets(cache.max_seq_len)
        if self.slot_sizes[-1] < cache.num_slots or self.key_sizes[-1] < cache.max_seq_len:
            raise ValueError("the largest buckets must cover every slot and every position")
        n = cache.num_slots
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_index = torch.arange(n, device=device)
        self.key_index = torch.arange(self.key_sizes[-1], device=device)
        # Host staging of [input_ids; positions]: pinned on CUDA so the copy is asynchronous.
        # Reusing it each step is safe because every step ends in a host sync (sampling).
        self._host = torch.zeros(2, n, dtype=torch.long, pin_memory=device.type == "cuda")
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.replays = 0
        self.eager_runs = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def buckets_for(self, slots: Sequence[int]) -> tuple[int, int]:
        """(S, K) for a step whose rows sit in `slots` (each feeding at its slot's length)."""
        lengths = self.cache.lengths
        s = pick_bucket(self.slot_sizes, max(slots) + 1)
        k = pick_bucket(self.key_sizes, max(lengths[i] for i in slots) + 1)
        return s, k

    @torch.no_grad()
    def run(self, slots: Sequence[int], tokens: Sequence[int], logit_slots: Sequence[int]) -> torch.Tensor:
        """Feed `tokens[i]` at the next position of slot `slots[i]`; returns the logits
        [len(logit_slots), vocab] of the listed slots, in that order."""
        s, k = self.buckets_for(slots)
        lengths = self.cache.lengths
        host = self._host
        host[0, :s] = 0
        # Rows not in the step feed token 0 at their first unfilled position (see module doc).
        host[1, :s] = torch.tensor([min(x, self.cache.max_seq_len - 1) for x in lengths[:s]], dtype=torch.long)
        index = torch.tensor(slots, dtype=torch.long)
        host[0].index_copy_(0, index, torch.tensor(tokens, dtype=torch.long))
        self.input_ids[:s].copy_(host[0, :s], non_blocking=True)
        self.positions[:s].copy_(host[1, :s], non_blocking=True)
        if self.use_graphs:
            graph, logits = self._graphs.get((s, k)) or self._capture(s, k)
            graph.replay()
            self.replays += 1
        else:
            logits = self._forward(s, k)
            self.eager_runs += 1
        rows = torch.tensor(logit_slots, dtype=torch.long).to(self.device, non_blocking=True)
        return logits.index_select(0, rows)

    def _forward(self, s: int, k: int) -> torch.Tensor:
        return self.model.decode_slots(self.input_ids[:s], self.positions[:s], self.cache, k, self.slot_index,
                                       self.key_index)

    def _capture(self, s: int, k: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The static buffers already hold this step's inputs, so the warm-up writes exactly
        # the keys/values the replay will write again: capturing changes no result.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(s, k)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread must avoid unsafe CUDA calls while capturing; the
        # trainer may keep using the same device from its own thread (colocated placement).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(s, k)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(s, k)] = (graph, logits)
        return graph, logits

    def capture_all(self, slot_sizes: Sequence[int] | None = None, key_sizes: Sequence[int] | None = None) -> int:
        """Capture graphs ahead of time (largest first, so smaller ones reuse the pool)
        for the given buckets (default: all). Only while the engine is idle: the warm-up
        writes into slot positions given by the current (zero) lengths. Returns the count."""
        if not self.use_graphs:
            return 0
        assert not any(self.cache.lengths), "capture_all needs an idle engine"
        self.input_ids.zero_()
        self.positions.zero_()
        for s in sorted(slot_sizes or self.slot_sizes, reverse=True):
            for k in sorted(key_sizes or self.key_sizes, reverse=True):
                if (s, k) not in self._graphs:
                    self._capture(s, k)
        torch.cuda.synchronize(self.device)
        return len(self._graphs)

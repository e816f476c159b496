"""Static-shape decode steps, captured as CUDA graphs per (slot bucket, key bucket).

Owns: `DecodeRunner`, the fast path of a step in which every row feeds exactly one token
(plain decoding, the bulk of generation): `CausalLM.decode_slots` over the slot range
0..S-1 of the cache with keys 0..K-1, S and K rounded up to buckets, run eagerly
(`use_graphs=False`, how the CPU exercises this path) or captured once per bucket pair as
a CUDA graph and replayed; optionally with the layers compiled (`compile=True`) and with
plain sampling inside the step (`sampling.sample_plain`). `DecodeRunner`'s docstring has
the invariants that make the graphs safe (buckets, the shared memory pool, fixed addresses).

Does not own: the maths (model.py), the cache (kv_cache.py), scheduling or sampling
(engine.py).

See docs/generation.md, "Decode paths and CUDA graphs", for what each path runs and when.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from rl_core.generation.native import fused_sampling
from rl_core.generation.native.fused_sampling import lm_head_usable, sample_lm_head, sample_packed
from rl_core.generation.native.kv_cache import KVCache
from rl_core.generation.native.fused_stack import FusedStack
from rl_core.generation.native.model import CausalLM, decode_layer
from rl_core.generation.native.sampling import sample_plain

DEFAULT_KEY_BUCKET_MIN = 64
# Rows of the decode runner's input tensor (DecodeRunner._inputs) and of its host staging.
_POSITIONS, _SAMPLES, _IDS, _LOGIT_ROWS = 0, 1, 4, 5
_INPUT_ROWS = 6


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


def _compiled(fn, fullgraph: bool = True, unfused_residual: bool = False):
    """`fn` through torch.compile with dynamic shapes (one compilation for every bucket),
    keeping the eager code's low-precision roundings (`emulate_precision_casts`).

    Dynamo keeps its compilations per code object, shared by every engine of the process:
    each dtype, KV storage (FP8 scales or none) and size-0/1 specialisation adds one, so a
    process that builds several engines (tests, evaluation jobs) passes the default limit
    of 8 and, under fullgraph, fails. The limit is raised to 64 here.

    `unfused_residual`: no pattern rewriting (Inductor's `pattern_matcher` off), so that a
    residual add after a matmul is not turned into a cuBLAS beta-add (`addmm`, which first
    copies the residual into the output: one device copy per add) but fused into the
    element-wise kernel that follows (the RMSNorm), as the eager code rounds it."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    options = {"emulate_precision_casts": True}
    if unfused_residual:
        options["pattern_matcher"] = False
    return torch.compile(fn, fullgraph=fullgraph, dynamic=True, options=options)


def _layer_function(compile: bool, fused_attention: bool, fused_mlp: bool = False):
    """What `decode_slots` runs: None (eager `decode_layer` per layer), the compiled
    `decode_layer`, or for fused attention a `FusedStack` of all layers, its element-wise parts
    compiled with `compile` (and, with `fused_mlp`, the gate/up kernel of fused_mlp.py)."""
    if fused_attention:
        return FusedStack(fused_mlp, _compiled if compile else None)
    return _compiled(decode_layer) if compile else None


class DecodeRunner:
    """Runs single-token steps over a slot range with static shapes (graphs on CUDA).

    Buckets: S and K are the smallest listed sizes holding the highest busy slot and the
    longest position of the step. The slot cache hands out the lowest free slot first, so
    busy slots are dense and S is close to the batch; rows of idle slots in the range
    compute garbage that nobody reads (they write at their slot's first unfilled position,
    which the slot's own next write overwrites before anything attends to it).

    Graphs: because shapes depend only on (S, K), each bucket pair is captured once
    (`torch.cuda.CUDAGraph`) and replayed: one launch instead of ~15 kernels per layer
    (NVIDIA, "CUDA Graphs", CUDA C++ Programming Guide; PyTorch `torch.cuda.graph`).
    Graphs are captured lazily, on the first step that needs a bucket pair, after a
    warm-up on a side stream as PyTorch requires; all share one memory pool. Sharing is
    safe because graphs never run concurrently and each graph's output logits are consumed
    (rows selected, copied) right after its replay, before any other graph can reuse that
    memory for its intermediates. Everything a graph reads lives at a fixed address and is
    updated in place: the static `input_ids`/`positions` buffers (filled from the host each
    step, or the ids by the step before), parameters (`load_weights` copies into them), FP8
    scales (`KVCache.set_scales` copies), the cache itself. So weight refits and KV-scale syncs need no re-capture.

    Sampling in the step: when every sampling row is plain (`sampling.is_plain`), the
    caller passes each row's (temperature, greedy, uniform) and the step also runs
    `sampling.sample_plain` over the S rows (captured with the forward as one graph per bucket
    pair, apart from the forward-only graph that steps returning logits replay): the step then
    returns [2, S] float64, token and logprob of slot s in column s, and leaves the tokens in
    `input_ids`, so that a step fed from that result (`overlap_steps`) copies nothing. Idle
    slots sample greedily (nobody reads them). Other steps return logits.

    Inputs: positions, sampling inputs, host-fed ids and logit rows are the rows of one device
    tensor, filled from one pinned host tensor by one copy per step (`_inputs`).

    Compilation (`compile=True`): each layer runs `model.decode_layer` through
    `torch.compile` with dynamic shapes, so one compilation serves every layer and every
    bucket (sizes 0/1 get their own); it happens in the warm-up of the first capture.
    `emulate_precision_casts` keeps the bf16 roundings where the eager code has them, so
    compiled and eager steps agree to float rounding of the kernels. The in-step sampling
    runs fused too: on CUDA as the two Triton kernels of fused_sampling.py (the logits read
    about once), elsewhere as `sample_plain` through torch.compile.

    Fused attention (`fused_attention=True`): the layers run as a `fused_stack.FusedStack`,
    whose RoPE, cache write and attention are one Triton kernel (decode_attention.py) reading
    each slot's keys up to its own position, and whose residual adds join the next norm; with
    `compile`, its element-wise parts are compiled, and a step of up to `fused_sampling.LM_HEAD_ROWS`
    rows that samples runs the LM head with the sampling's first pass in its epilogue
    (`fused_sampling.sample_lm_head`, where the tensors suit its TMA loads: the logits are then
    read back only in each row's chosen block)."""

    def __init__(self, model: CausalLM, cache: KVCache, use_graphs: bool,
                 slot_sizes: Sequence[int] | None = None, key_sizes: Sequence[int] | None = None,
                 compile: bool = False, fused_attention: bool = False, fused_mlp: bool = False):
        device = cache.k.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {device}. "
                             "Use the eager or static decode path on this device.")
        self.model, self.cache, self.use_graphs, self.device = model, cache, use_graphs, device
        if fused_mlp and not fused_attention:
            raise ValueError("fused_mlp runs inside the fused-attention layer; pass fused_attention=True too")
        self.compiled, self.fused_attention, self.fused_mlp = compile, fused_attention, fused_mlp
        layers = _layer_function(compile, fused_attention, fused_mlp)
        self._stack = layers if isinstance(layers, FusedStack) else None  # decode_slots' `stack`, or its `layer_fn`
        self._layer_fn = None if self._stack else layers
        # Triton kernels on CUDA (fused_sampling.py) with `compile`; compiled torch ops elsewhere.
        self._packed = compile and fused_sampling.available(device)
        # With the fused stack, the LM head runs with the sampling's first pass in its epilogue
        # (fused_sampling.sample_lm_head) where its kernel can read the tensors.
        self._lm_head = self._packed and self._stack is not None and fused_sampling.LM_HEAD
        self._sample_plain = _compiled(sample_plain, fullgraph=False) if compile and not self._packed else sample_plain
        self.slot_sizes = sorted(slot_sizes) if slot_sizes else slot_buckets(cache.num_slots)
        self.key_sizes = sorted(key_sizes) if key_sizes else key_buckets(cache.max_seq_len)
        if self.slot_sizes[-1] < cache.num_slots or self.key_sizes[-1] < cache.max_seq_len:
            raise ValueError("the largest buckets must cover every slot and every position")
        n = cache.num_slots
        # A step's inputs, one [6, n] int64 tensor so that one copy from the host fills what the step
        # needs: row 0 positions, rows 1-3 the sampling inputs (temperature, greedy, uniform per slot,
        # float64 bits), row 4 input ids, row 5 the logit rows; `run` copies rows 0 .. what the step needs.
        self._inputs = torch.zeros(_INPUT_ROWS, n, dtype=torch.long, device=device)
        self.positions = self._inputs[_POSITIONS]
        self.sample_in = self._inputs[_SAMPLES:_SAMPLES + 3].view(torch.float64)
        self.input_ids = self._inputs[_IDS]
        self.logit_rows = self._inputs[_LOGIT_ROWS]
        self.slot_index = torch.arange(n, device=device)
        self.key_index = torch.arange(self.key_sizes[-1], device=device)
        # Per (S, K) bucket: the step returning logits, and the step with its sampling (plain rows).
        self._step_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Host staging of the inputs (the same [6, n] rows) and of the packed tokens on their way
        # back: pinned on CUDA so the copies are asynchronous (a copy from pageable memory would
        # wait for the device to finish). Two of each, used in turn: at most two steps are in
        # flight (one launched ahead, see the engine's overlap_steps), and a step's buffers are
        # reused only after the step two launches earlier was read.
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(_INPUT_ROWS, n, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_outs = [torch.zeros(2, n, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        # The result of the last step that sampled in the step: its tokens are already in
        # `input_ids` (the sampling wrote them there), so a step fed from it copies nothing.
        self._fed: torch.Tensor | None = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.replays = 0
        self.eager_runs = 0
        self.sampled_steps = 0  # steps that sampled in the step (plain rows)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs) + len(self._step_graphs)

    def graph_of(self, s: int, k: int, sampled: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The captured graph of bucket (s, k) and its output (logits, or with `sampled` the [2, s]
        tokens and logprobs of a step that samples in the step); None if not captured (benchmarks)."""
        return (self._step_graphs if sampled else self._graphs).get((s, k))

    def buckets_for(self, slots: Sequence[int]) -> tuple[int, int]:
        """(S, K) for a step whose rows sit in `slots` (each feeding at its slot's length)."""
        lengths = self.cache.lengths
        s = pick_bucket(self.slot_sizes, max(slots) + 1)
        k = pick_bucket(self.key_sizes, max(lengths[i] for i in slots) + 1)
        return s, k

    @torch.no_grad()
    def run(self, slots: Sequence[int], tokens: Sequence[int] | None, logit_slots: Sequence[int],
            plain: tuple[Sequence[float], Sequence[bool], Sequence[float]] | None = None,
            tokens_from: torch.Tensor | None = None) -> torch.Tensor:
        """Feed `tokens[i]` at the next position of slot `slots[i]`; returns the logits
        [len(logit_slots), vocab] of the listed slots, in that order. With `plain` =
        (temperature, greedy, uniform) of each logit slot, samples them in the step instead
        and returns [2, S] float64: (token, logprob) of slot s in column s. With
        `tokens_from` (such a [2, S'] result of the previous step, still on the device) and
        `tokens` None, slot s feeds the token in column s, copied on the device (other
        slots of the range feed whatever is there: nobody reads their rows)."""
        s, k = self.buckets_for(slots)
        lengths = self.cache.lengths
        self._turn ^= 1
        host = self._hosts[self._turn]
        fed, self._fed = self._fed, None
        # Rows not in the step feed at their first unfilled position (see module doc).
        host[_POSITIONS, :s] = torch.tensor(lengths[:s], dtype=torch.long).clamp_(max=self.cache.max_seq_len - 1)
        last = _POSITIONS  # the last row of `host` this step needs on the device
        if tokens is None:
            if tokens_from is not fed:  # not the last sampled result, whose tokens are in input_ids already
                width = min(s, tokens_from.shape[1])
                self.input_ids[:width].copy_(tokens_from[0, :width])  # float64 token ids, exact
        else:
            host[_IDS, :s] = 0
            host[_IDS].index_copy_(0, torch.tensor(slots, dtype=torch.long), torch.tensor(tokens, dtype=torch.long))
            last = _IDS
        rows = len(logit_slots)
        dense = list(logit_slots) == list(range(s))  # every slot of the range, in order: no selection
        if plain is not None:
            staged = host[_SAMPLES:_SAMPLES + 3].view(torch.float64)
            values = torch.tensor(plain, dtype=torch.float64)  # [3, rows]: temperature, greedy, uniform
            if dense:
                staged[:, :s] = values
            else:  # idle slots: greedy at temperature 1
                staged[:2, :s] = 1.0
                staged[2, :s] = 0.0
                staged[:, :s].index_copy_(1, torch.tensor(logit_slots, dtype=torch.long), values)
            last = max(last, _SAMPLES + 2)
        elif not dense:
            host[_LOGIT_ROWS, :rows] = torch.tensor(logit_slots, dtype=torch.long)
            if tokens is None:  # the ids row is on the device already: the logit rows go on their own
                self.logit_rows[:rows].copy_(host[_LOGIT_ROWS, :rows], non_blocking=True)
            else:
                last = _LOGIT_ROWS
        # Rows 0..last in one copy (whole rows: one contiguous block; columns past s are not read).
        self._inputs[:last + 1].copy_(host[:last + 1], non_blocking=True)
        if plain is not None:  # the step and its sampling: one graph replay
            self.sampled_steps += 1
            self._fed = out = self._replay_or_run(s, k, sampled=True)
            return out
        logits = self._replay_or_run(s, k, sampled=False)
        return logits if dense else logits.index_select(0, self.logit_rows[:rows])

    def _replay_or_run(self, s: int, k: int, sampled: bool) -> torch.Tensor:
        """The output of bucket (s, k), from the static buffers: its graph replayed (captured on first
        use) when graphs are on, else run eagerly; `sampled`: the step with its sampling
        (`_step_sampled`), else the logits (`_forward`)."""
        if self.use_graphs:
            graph, out = self.graph_of(s, k, sampled) or (self._capture_step if sampled else self._capture)(s, k)
            graph.replay()
            self.replays += 1
        else:
            out = self._step_sampled(s, k) if sampled else self._forward(s, k)
            self.eager_runs += 1
        return out

    def host_out(self) -> torch.Tensor:
        """The pinned host buffer for the packed result of the step just run (two in turn)."""
        return self._host_outs[self._turn]

    def _step_sampled(self, s: int, k: int) -> torch.Tensor:
        """The step of bucket (s, k) and its sampling (`_sample`): [2, s] float64. With the fused LM
        head (`_lm_head`, up to `fused_sampling.LM_HEAD_ROWS` rows: where it is faster than
        cuBLAS and the two passes), the head's matmul and the sampling's first pass are one kernel."""
        if self._lm_head and s <= fused_sampling.LM_HEAD_ROWS:
            hidden = self._forward(s, k, head=False)
            weight = self.model.head_weight()
            if lm_head_usable(hidden, weight):
                return sample_lm_head(hidden, weight, self.sample_in[:, :s], self.input_ids[:s])
            return self._sample(torch.nn.functional.linear(hidden, weight), s)
        return self._sample(self._forward(s, k), s)

    def _sample(self, logits: torch.Tensor, s: int) -> torch.Tensor:
        """[2, s] float64 (token, logprob) per slot; the tokens also go to `input_ids` (a step fed from
        this result then copies nothing: see `run`)."""
        params = self.sample_in[:, :s]
        if self._packed:  # the two Triton kernels and nothing else
            return sample_packed(logits, params, self.input_ids[:s])
        tokens, logprobs = self._sample_plain(logits, params[0].float(), params[1] > 0.5, params[2])
        self.input_ids[:s].copy_(tokens)
        return torch.stack((tokens.double(), logprobs.double()))

    def _capture_step(self, s: int, k: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the step of bucket (s, k) with its sampling (`_sample` of its logits) as one graph.
        Its sampling overwrites the input ids it started from, so each warm-up run and the replay after
        the capture start from this step's ids again (else they would feed the sampled tokens)."""
        ids = self.input_ids[:s].clone()
        self._step_graphs[(s, k)] = self._capture_fn(
            torch.cuda.CUDAGraph(), lambda: self._step_sampled(s, k), reset=lambda: self.input_ids[:s].copy_(ids))
        return self._step_graphs[(s, k)]

    def _forward(self, s: int, k: int, head: bool = True) -> torch.Tensor:
        return self.model.decode_slots(self.input_ids[:s], self.positions[:s], self.cache, k, self.slot_index,
                                       self.key_index, layer_fn=self._layer_fn, stack=self._stack, head=head)

    def _capture(self, s: int, k: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The static buffers already hold this step's inputs, so the warm-up writes exactly
        # the keys/values the replay will write again: capturing changes no result.
        self._graphs[(s, k)] = self._capture_fn(torch.cuda.CUDAGraph(), lambda: self._forward(s, k))
        return self._graphs[(s, k)]

    def _capture_fn(self, graph: torch.cuda.CUDAGraph, fn, reset=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm `fn` up on a side stream (as PyTorch requires), then capture it into `graph`
        in the shared pool; returns (graph, its output tensor). Capturing runs `fn` once.
        `reset` (outside the graph) restores what `fn` overwrites of its own inputs: before each
        warm-up run and before the capture, so that the first replay starts from them too."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                if reset is not None:
                    reset()
                fn()
            if reset is not None:
                reset()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # thread_local: only this thread must avoid unsafe CUDA calls while capturing; the
        # trainer may keep using the same device from its own thread (colocated placement).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    def capture_all(self, slot_sizes: Sequence[int] | None = None, key_sizes: Sequence[int] | None = None) -> int:
        """Capture graphs ahead of time (largest first, so smaller ones reuse the pool)
        for the given buckets (default: all). Only while the engine is idle: the warm-up
        writes into slot positions given by the current (zero) lengths. Returns the count."""
        if not self.use_graphs:
            return 0
        assert not any(self.cache.lengths), "capture_all needs an idle engine"
        self._fed = None
        self.input_ids.zero_()
        self.positions.zero_()
        for s in sorted(slot_sizes or self.slot_sizes, reverse=True):
            for k in sorted(key_sizes or self.key_sizes, reverse=True):
                if (s, k) not in self._graphs:
                    self._capture(s, k)
        torch.cuda.synchronize(self.device)
        return len(self._graphs)

"""Packing samples into the padded tensors of a `TrainChunk`, and the reused memory it packs into.

Owns: `make_train_chunk` (a list of `Sample`s, or of their token arrays: one row each),
`make_group_chunk` (whole prompt groups, read column-wise when a group is a `GroupSamples`
whose `Sample`s were never built), the padded layout (types.py's module docstring: token
alignment and routed experts), and `ARENA`, the pool of [B, T] buffers packed chunks reuse.
Does not own: the records themselves (types.py) or what is trained (samplers, algorithms).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import numpy as np
import torch

from rl_core.types import Sample, TrainChunk, columns_of


def make_train_chunk(samples: list[Sample], advantages: list[float] | torch.Tensor | None, pad_id: int = 0,
                     token_advantages: list[list[float]] | None = None, require_routes: bool = False) -> TrainChunk:
    """Pack samples into right-padded tensors. `advantages` has one value per sample
    (broadcast over its completion tokens) unless `token_advantages` gives per-token values;
    None: zeros, for the caller to fill in (the advantage stage). Routed experts are packed
    when any sample has them; `require_routes` (router replay) raises ValueError for a sample
    without any. Token ids and logprobs may be Python lists or 1-D NumPy arrays
    (`token_array`, `logprob_array`): arrays are concatenated in the padded layout (memory
    copies), lists converted once per field."""
    masks = [s.completion_mask for s in samples]
    return _pack([s.prompt_ids for s in samples], [s.completion_ids for s in samples],
                 [s.gen_logprobs for s in samples], None if all(m is None for m in masks) else masks,
                 [s.env_mask for s in samples], [s.start_version for s in samples], advantages, pad_id,
                 token_advantages, lambda: samples, require_routes)


def make_group_chunk(groups: Sequence[Sequence[Sample]], pad_id: int = 0, require_routes: bool = False) -> TrainChunk:
    """`make_train_chunk([s for g in groups for s in g], None, ...)`, the same tensors, reading
    the columns of groups held as `GroupSamples` instead of building their `Sample`s (other
    groups: their samples' fields). The advantages are a read-only placeholder of zeros (one
    zero expanded to [B, T], no memory): the advantage stage replaces the tensor."""
    prompts: list = []
    completions: list = []
    logprobs: list = []
    masks: list = []
    env_mask: list = []
    versions: list = []
    routes = require_routes
    for g in groups:
        cols = columns_of(g)
        if cols is not None:
            k = len(cols.rewards)
            prompts += [cols.prompt_ids] * k
            completions += cols.completion_ids
            logprobs += cols.gen_logprobs
            masks += [None] * k
            env_mask += cols.env_mask
            versions += cols.start_versions
            routes = routes or cols.routed_experts is not None
        else:
            prompts += [s.prompt_ids for s in g]
            completions += [s.completion_ids for s in g]
            logprobs += [s.gen_logprobs for s in g]
            masks += [s.completion_mask for s in g]
            env_mask += [s.env_mask for s in g]
            versions += [s.start_version for s in g]
            routes = routes or any(s.routed_experts for s in g)
    # the Samples only when some carry routes (or router replay must say which lacks them)
    return _pack(prompts, completions, logprobs, None if masks.count(None) == len(masks) else masks, env_mask,
                 versions, None, pad_id, None, (lambda: [s for g in groups for s in g]) if routes else None,
                 require_routes, placeholder=True)


def _pack(prompts: list, completions: list, logprobs: list, masks: list | None, env_mask: list, versions: list,
          advantages, pad_id: int, token_advantages, samples, require_routes: bool,
          placeholder: bool = False) -> TrainChunk:
    """make_train_chunk over columns (one entry per sample); `samples()` gives the `Sample`s
    (only asked for when a sample may carry routed experts or `require_routes` is set).
    `placeholder` (with `advantages` None): zero advantages as one expanded zero."""
    # Python lists: every field is gathered into one flat list, converted once and scattered
    # into the padded [B, T] layout with a boolean mask (row-major order of the mask =
    # concatenation order); per-sample tensor construction cost ~10x more. NumPy arrays: each
    # row is [prompt, completion, padding] and the rows are one `np.concatenate` of these
    # pieces, written into [B, T] (no mask, no row-by-row copies). The [B, T] arrays come from
    # `ARENA`: memory of earlier chunks that nothing refers to any more (no page faults).
    B = len(completions)
    plens = list(map(len, prompts))
    clens = list(map(len, completions))
    lplens = list(map(len, logprobs))
    if lplens != clens:
        i = next(i for i, (a, c) in enumerate(zip(lplens, clens)) if a != c)
        raise ValueError(f"sample {i}: {lplens[i]} generation logprobs for {clens[i]} completion tokens")
    plen = np.array(plens, dtype=np.int64)
    lengths = plen + np.array(clens, dtype=np.int64)
    T = int(lengths.max()) if B else 0
    pos = np.arange(T)
    real = np.less(pos[None, :], lengths[:, None], out=ARENA.empty((B, T), np.bool_))  # [B, T] prompt + completion
    comp = np.greater_equal(pos[None, :], plen[:, None], out=ARENA.empty((B, T), np.bool_))
    comp &= real  # [B, T] completion
    if B and {type(c) for c in completions} | {type(lp) for lp in logprobs} == {np.ndarray}:
        input_ids, gen_lp = _rows_by_concatenation(prompts, completions, logprobs, plens, clens, T, pad_id)
    else:
        input_ids = ARENA.full((B, T), pad_id, np.int64)
        gen_lp = ARENA.full((B, T), 0.0, np.float32)
        input_ids[real & ~comp] = _concat(prompts, np.int64)
        input_ids[comp] = _concat(completions, np.int64)
        gen_lp[comp] = _concat(logprobs, np.float32)
    if masks is None:
        loss_mask = ARENA.empty((B, T), np.float32)
        np.copyto(loss_mask, comp)
    else:
        mask_pieces: list = []
        for m, c in zip(masks, clens):
            if m is None:
                mask_pieces.append(np.ones(c, dtype=np.float32))
            elif len(m) != c:
                raise ValueError(f"a completion_mask of {len(m)} entries for {c} completion tokens")
            else:
                mask_pieces.append(m)
        loss_mask = ARENA.full((B, T), 0.0, np.float32)
        loss_mask[comp] = _concat(mask_pieces, np.float32)
    if token_advantages is not None:
        for i, c in enumerate(clens):
            if len(token_advantages[i]) != c:
                raise ValueError(f"sample {i}: {len(token_advantages[i])} token advantages for {c} completion tokens")
        adv = ARENA.full((B, T), 0.0, np.float32)
        adv[comp] = _concat(list(token_advantages), np.float32)
    elif advantages is None:
        adv = None if placeholder else np.zeros((B, T), dtype=np.float32)
    else:
        per = advantages.detach().cpu().to(torch.float32).reshape(-1).numpy() \
            if isinstance(advantages, torch.Tensor) else np.array([float(a) for a in advantages], dtype=np.float32)
        if per.size != B:
            raise ValueError(f"{per.size} advantages for {B} samples")
        adv = np.where(comp, per[:, None], np.float32(0.0))
    sample_mask = torch.tensor([0.0 if m else 1.0 for m in env_mask], dtype=torch.float32)
    start_versions = torch.tensor(versions, dtype=torch.long)
    attention = ARENA.empty((B, T), np.int64)
    np.copyto(attention, real)
    chunk = TrainChunk(torch.from_numpy(input_ids), torch.from_numpy(attention), torch.from_numpy(loss_mask),
                       torch.from_numpy(gen_lp),
                       torch.zeros((), dtype=torch.float32).expand(B, T) if adv is None else torch.from_numpy(adv),
                       sample_mask, start_versions)
    chunk.routed_experts = _pack_routes(samples(), T, require_routes) if samples is not None else None
    return chunk


def _rows_by_concatenation(prompts: list, completions: list, logprobs: list, plens: list[int], clens: list[int],
                           T: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and gen_logprobs [B, T] of samples whose completions and logprobs are arrays,
    each written by one concatenation of two pieces per row. Row i is [prompt_i, completion_i,
    padding_i]; the pieces are prompt_0, then per row completion_i and [padding_i,
    prompt_(i+1)] (one slice of a [pad_id x T, prompt_(i+1)] array, made once per distinct
    prompt list); logprobs likewise: zeros, then per row logprobs_i and zeros."""
    B = len(completions)
    pad = np.full(T, pad_id, dtype=np.int64)
    zero = np.zeros(2 * T, dtype=np.float32)
    joined: dict[int, dict] = {}  # id() of a prompt -> {padding: [pad x padding, prompt]} (`prompts` keeps it alive)
    zeros: dict[int, np.ndarray] = {}  # length -> zeros (views of `zero`, made once per length)
    last, cuts = None, None
    ids_pieces: list = [np.asarray(prompts[0], dtype=np.int64)]
    lp_pieces: list = [zero[:plens[0]]]
    for ids, lps, p, c, prompt, p_next in zip(completions, logprobs, plens, clens, prompts[1:], plens[1:]):
        if prompt is not last:
            cuts = joined.get(id(prompt))
            if cuts is None:
                cuts = joined[id(prompt)] = {"": np.concatenate([pad, np.asarray(prompt, dtype=np.int64)])}
            last = prompt
        tail = T - p - c
        piece = cuts.get(tail)
        if piece is None:
            piece = cuts[tail] = cuts[""][T - tail:]
        z = zeros.get(tail + p_next)
        if z is None:
            z = zeros[tail + p_next] = zero[:tail + p_next]
        ids_pieces += (ids, piece)
        lp_pieces += (lps, z)
    tail = T - plens[-1] - clens[-1]
    ids_pieces += (completions[-1], pad[:tail])
    lp_pieces += (logprobs[-1], zero[:tail])
    input_ids = ARENA.empty((B, T), np.int64)
    gen_lp = ARENA.empty((B, T), np.float32)
    np.concatenate(ids_pieces, out=input_ids.reshape(-1), casting="unsafe")
    np.concatenate(lp_pieces, out=gen_lp.reshape(-1), casting="unsafe")
    return input_ids, gen_lp


class Arena:
    """Reused memory for the [B, T] arrays of packed chunks. A chunk of 16,000 x 259 tokens
    writes ~115 MB of arrays; fresh memory for them costs a page fault per 4 KiB page on first
    touch (the kernel zeroes each page), which at 1,000 groups x 16 samples per RL step cost
    more than the copies themselves (on the development VM, up to ~4 ms per MB). A buffer is
    reused only when nothing refers to it any more: every array handed out is a view of a
    pooled buffer, and a tensor made from it (`torch.from_numpy`) keeps that view, hence the
    buffer, referenced until the last tensor or slice sharing its memory is gone. Buffers are
    sized 1/8 above the request (the step's width varies; untouched pages cost nothing). At
    most `keep` buffers and `max_bytes` are held (idle ones beyond that are dropped, least
    recently used first); buffers still in use are never dropped from under their arrays,
    only forgotten by the pool once released."""

    def __init__(self, keep: int = 16, min_bytes: int = 1 << 20, max_bytes: int = 2 << 30):
        self.keep = keep
        self.min_bytes = min_bytes  # smaller arrays come from the allocator's own free lists
        self.max_bytes = max_bytes
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.fresh_bytes = 0  # allocated so far (the bytes that were not reused)

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n < self.min_bytes:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            bufs = self._bufs
            best = None
            for i in range(len(bufs)):
                if bufs[i].nbytes >= n and self._idle(i) and (best is None or bufs[i].nbytes < bufs[best].nbytes):
                    best = i
            if best is not None:
                buf = bufs.pop(best)
            else:
                buf = np.empty(n + n // 8, dtype=np.uint8)
                self.fresh_bytes += buf.nbytes
            bufs.append(buf)  # most recently used last
            i = 0
            while i < len(bufs) - 1 and (len(bufs) > self.keep or sum(b.nbytes for b in bufs) > self.max_bytes):
                if self._idle(i):
                    del bufs[i]  # the least recently used idle buffer
                else:
                    i += 1
            return buf[:n].view(dtype).reshape(shape)

    def _idle(self, i: int) -> bool:
        """Nothing but the pool refers to buffer i (the list and getrefcount's argument): no
        array or tensor made from it is alive."""
        return sys.getrefcount(self._bufs[i]) == 2

    def full(self, shape: tuple[int, ...], value, dtype) -> np.ndarray:
        out = self.empty(shape, dtype)
        out.fill(value)
        return out

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


ARENA = Arena()


def _concat(pieces: list, dtype) -> np.ndarray:
    """The pieces (Python lists or 1-D arrays) end to end, as one flat array of `dtype`. Lists
    only: gathered into one list and converted once; arrays only: concatenated; mixed: each
    list converted once (a list shared by several samples, e.g. their prompt, only once)."""
    kinds = {type(p) for p in pieces}
    if np.ndarray not in kinds:
        flat: list = []
        for p in pieces:
            flat += p
        return np.array(flat, dtype=dtype) if flat else np.zeros(0, dtype=dtype)
    if len(kinds) == 1:
        return np.concatenate(pieces).astype(dtype, copy=False)
    converted: dict[int, np.ndarray] = {}  # id() of a list -> its array (the pieces keep every list alive)
    arrays = []
    for p in pieces:
        if isinstance(p, np.ndarray):
            arrays.append(p)
        else:
            a = converted.get(id(p))
            if a is None:
                a = converted[id(p)] = np.array(p, dtype=dtype)
            arrays.append(a)
    return np.concatenate(arrays).astype(dtype, copy=False)


def _pack_routes(samples: list[Sample], width: int, required: bool) -> torch.Tensor | None:
    """[B, T, layers * k] expert ids (-1 where not recorded), or None when no sample has routes."""
    if required:
        for i, s in enumerate(samples):
            if not s.routed_experts or not any(s.routed_experts):
                raise ValueError(
                    f"router replay is on (trainer.router_replay.enabled) but sample {i} of this batch "
                    f"(prompt {s.prompt_ids[:8]}{'...' if len(s.prompt_ids) > 8 else ''}, {len(s.completion_ids)} "
                    f"completion tokens, weight versions {s.start_version}..{s.end_version}) carries no routed "
                    "experts: "
                    "its generation backend did not record them (only generation.backend 'native' records routes, "
                    "for mixture-of-experts models). Generate with the native engine, or set "
                    "trainer.router_replay.enabled: false.")
    per_token = next((r for s in samples for r in (s.routed_experts or ()) if r), None)
    if per_token is None:
        return None
    n = len(per_token)
    out = torch.full((len(samples), width, n), -1, dtype=torch.long)
    missing = [-1] * n
    for i, s in enumerate(samples):
        rows = [r if r else missing for r in (s.routed_experts or [])[:width]]
        bad = next((t for t, r in enumerate(rows) if len(r) != n), None)
        if bad is not None:
            raise ValueError(f"sample {i}, token {bad}: {len(rows[bad])} routed expert ids; other tokens have {n} "
                             "(layers x k). Routes of one batch must come from one model.")
        if rows:
            out[i, :len(rows)] = torch.tensor(rows, dtype=torch.long)
    return out

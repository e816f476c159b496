"""Packing samples into the padded tensors of a `TrainChunk`, and the reused memory it packs into.

Owns: `make_train_chunk` (a list of `Sample`s, or of their token arrays: one row each),
`make_group_chunk` (whole prompt groups, read through their columns: `columns.group_columns`),
the padded layout (types.py's module docstring: token
alignment and routed experts), and `ARENA`, the pool of [B, T] buffers packed chunks reuse.
Does not own: the records themselves (types.py) or what is trained (samplers, algorithms).
"""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from rl_core.types import Sample, TrainChunk
from rl_core.columns import SampleColumns, group_columns


def make_train_chunk(samples: list[Sample], advantages: list[float] | torch.Tensor | None, pad_id: int = 0,
                     token_advantages: list[list[float]] | None = None, require_routes: bool = False) -> TrainChunk:
    """Pack samples into right-padded tensors. `advantages` has one value per sample
    (broadcast over its completion tokens) unless `token_advantages` gives per-token values;
    None: zeros, for the caller to fill in (the advantage stage). Routed experts are packed
    when any sample has them; `require_routes` (router replay) raises ValueError for a sample
    without any. Token ids and logprobs may be Python lists or 1-D NumPy arrays
    (`token_array`, `logprob_array`): arrays are concatenated in the padded layout (memory
    copies), lists converted once per field."""
    return _pack(SampleColumns(samples), advantages, pad_id, token_advantages, require_routes)


def make_group_chunk(groups: Sequence, pad_id: int = 0, require_routes: bool = False) -> TrainChunk:
    """`make_train_chunk([s for g in groups for s in g], None, ...)`, the same tensors, read
    through each group's columns (`columns.group_columns`: a `GroupSamples` is read without
    building its `Sample`s; a group may also be given as its columns). The advantages are a
    read-only placeholder of zeros (one zero expanded to [B, T], no memory): the advantage
    stage replaces the tensor."""
    return _pack(_Joined(list(map(group_columns, groups))), None, pad_id, None, require_routes, placeholder=True)


class _Joined:
    """The columns `_pack` reads of several groups, end to end, and the runs of rows that share
    one prompt list (a whole single-turn group is one run)."""

    def __init__(self, cols: list):
        self.prompts: list = []
        self.completion_ids: list = []
        self.completion_lens: list = []
        self.gen_logprobs: list = []
        self.env_mask: list = []
        self.start_versions: list = []
        self.runs: list = []  # (prompt list, rows)
        prompts, completions, clens = self.prompts, self.completion_ids, self.completion_lens
        logprobs = self.gen_logprobs
        env_mask, versions, runs = self.env_mask, self.start_versions, self.runs
        for c in cols:
            shared = c.shared_prompt
            if shared is not None:
                k = len(c.completion_ids)
                prompts += [shared] * k
                runs.append((shared, k))
            else:
                ps = c.prompts
                prompts += ps
                runs += [(p, 1) for p in ps]
            completions += c.completion_ids
            clens += c.completion_lens
            logprobs += c.gen_logprobs
            env_mask += c.env_mask
            versions += c.start_versions
        self.completion_masks = self._joined(cols, "completion_masks")
        self.routed_experts = self._joined(cols, "routed_experts")
        self._cols = cols

    @staticmethod
    def _joined(cols: list, name: str) -> list | None:
        """Column `name` (None or one entry per sample, per group) end to end; None when every group's is None."""
        parts = [getattr(c, name) for c in cols]
        if parts.count(None) == len(parts):
            return None
        out: list = []
        for c, part in zip(cols, parts):
            out += [None] * len(c.completion_ids) if part is None else part
        return out

    @property
    def end_versions(self) -> list[int]:
        return [v for c in self._cols for v in c.end_versions]


def _pack(cols, advantages, pad_id: int, token_advantages, require_routes: bool,
          placeholder: bool = False) -> TrainChunk:
    """Pack the rows of `cols` (`columns.GroupColumns` members: prompts, completion ids, their
    lengths and logprobs, completion masks, environment masks, versions, routed experts; `runs`, when
    given, the runs of rows sharing one prompt list). `placeholder` (with `advantages` None):
    zero advantages as one expanded zero."""
    # Python lists: every field is gathered into one flat list, converted once and scattered
    # into the padded [B, T] layout with a boolean mask (row-major order of the mask =
    # concatenation order), much cheaper than a tensor per sample. NumPy arrays: each
    # row is [prompt, completion, padding] and the rows are one concatenation of these pieces
    # (`_joined`: `bytes.join` for the usual int64 ids and float32 logprobs), written into
    # [B, T] (no mask, no row-by-row copies). The [B, T] arrays come from `ARENA`: memory of
    # earlier chunks that nothing refers to any more (no page faults).
    prompts, completions, logprobs = cols.prompts, cols.completion_ids, cols.gen_logprobs
    masks, env_mask, versions = cols.completion_masks, cols.env_mask, cols.start_versions
    B = len(completions)
    plens = list(map(len, prompts))
    clens = cols.completion_lens  # len() of each completion, held by the columns (GroupColumns)
    lplens = list(map(len, logprobs))
    if lplens != clens:
        i = next(i for i, (a, c) in enumerate(zip(lplens, clens)) if a != c)
        raise ValueError(f"sample {i}: {lplens[i]} generation logprobs for {clens[i]} completion tokens")
    plen = np.array(plens, dtype=np.int64)
    lengths = plen + np.array(clens, dtype=np.int64)
    T = int(lengths.max()) if B else 0
    # the masks as rows of one template: row L of `first` is `pos < L` (a window of [1 x T, 0 x T]),
    # gathered per sample (a row copy: cheaper than a broadcast comparison over [B, T])
    ones = np.zeros(2 * T, dtype=np.bool_)
    ones[:T] = True
    first = sliding_window_view(ones, T)[::-1]  # first[L] = pos < L, for 0 <= L <= T
    real = np.take(first, lengths, axis=0, out=ARENA.empty((B, T), np.bool_))  # [B, T] prompt + completion
    comp = np.take(first, plen, axis=0, out=ARENA.empty((B, T), np.bool_))  # [B, T] prompt
    np.not_equal(comp, real, out=comp)  # [B, T] completion (the prompt lies inside `real`)
    exact = _all_of_dtype(completions, _INT64) and _all_of_dtype(logprobs, _FLOAT32)  # the usual arrays
    if B and (exact or set(map(type, completions)) | set(map(type, logprobs)) == {np.ndarray}):
        runs = getattr(cols, "runs", None) or _runs(prompts)
        input_ids, gen_lp = _rows_by_concatenation(runs, completions, logprobs, plens, (T - lengths).tolist(), T,
                                                   pad_id, exact)
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
    sample_mask = torch.tensor([0.0 if m else 1.0 for m in env_mask], dtype=torch.float32) if any(env_mask) \
        else torch.ones(B, dtype=torch.float32)
    start_versions = torch.from_numpy(np.array(versions, dtype=np.int64))
    attention = ARENA.empty((B, T), np.int64)
    np.copyto(attention, real)
    chunk = TrainChunk(torch.from_numpy(input_ids), torch.from_numpy(attention), torch.from_numpy(loss_mask),
                       torch.from_numpy(gen_lp),
                       torch.zeros((), dtype=torch.float32).expand(B, T) if adv is None else torch.from_numpy(adv),
                       sample_mask, start_versions)
    routes = cols.routed_experts
    chunk.routed_experts = _pack_routes(cols, T, require_routes) if routes is not None or require_routes else None
    return chunk


def _runs(prompts: list) -> list[tuple[list, int]]:
    """(prompt list, rows) for each run of consecutive rows that share one prompt list."""
    runs: list = []
    for p in prompts:
        if runs and runs[-1][0] is p:
            runs[-1] = (p, runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


class _Cuts(dict):
    """length n -> `base[:n]` (`size` 0), or the bytes of n items of `base` (a bytes object of
    items of `size` bytes), the slice made on first use (a dict lookup per row after that)."""

    __slots__ = ("base", "size")

    def __init__(self, base, size: int = 0):
        super().__init__()
        self.base, self.size = base, size

    def __missing__(self, n):
        v = self[n] = self.base[:n * self.size] if self.size else self.base[:n]
        return v


def _rows_by_concatenation(runs: list, completions: list, logprobs: list, plens: list[int], tails: list[int],
                           T: int, pad_id: int, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and gen_logprobs [B, T] of samples whose completions and logprobs are arrays,
    each written by one concatenation (`_joined`). Row i is [prompt_i,
    completion_i, padding_i] (`tails[i]` = len(padding_i)). gen_logprobs: zeros, then per row
    logprobs_i and the zeros of padding_i and prompt_(i+1) as one piece, a slice of one zero
    array taken once per distinct length (`_Cuts`: a dict lookup per row, in C). input_ids:
    with few runs of rows sharing a prompt list (whole single-turn groups) the same two
    pieces per row, padding_i and the next row's prompt span written as padding, then each
    run's prompt written into its rows' first columns by one broadcast assignment; with many
    runs (a distinct prompt per row, as multi-turn samples have) three pieces per row
    instead: the run's prompt (one array per run), completion_i and padding_i. No Python
    loop over rows either way: the pieces are lists mapped over the lengths and interleaved
    by slice assignments. `exact`: every completion is an int64 array and every logprob row a
    float32 array (native byte order): the padding pieces are then bytes and each
    concatenation goes through `bytes.join` (`_joined`)."""
    B = len(completions)
    if exact:  # padding as bytes objects (the cheapest buffers to join)
        zeros = _Cuts(bytes(8 * T), 4)
        pads = _Cuts(np.full(2 * T, pad_id, dtype=np.int64).tobytes(), 8)
    else:
        zeros = _Cuts(np.zeros(2 * T, dtype=np.float32))
        pads = _Cuts(np.full(2 * T, pad_id, dtype=np.int64))
    gaps = list(map(operator.add, tails, plens[1:]))  # padding_i + prompt_(i+1)
    gaps.append(tails[-1])
    lp_pieces: list = [None] * (2 * B + 1)
    lp_pieces[0] = zeros[plens[0]]
    lp_pieces[1::2] = logprobs
    lp_pieces[2::2] = map(zeros.__getitem__, gaps)
    gen_lp = _joined(lp_pieces, (B, T), _FLOAT32, exact)
    if 4 * len(runs) <= B:  # few runs: [completion_i, padding over padding_i and prompt_(i+1)], then the prompts
        ids_pieces: list = [None] * (2 * B + 1)
        ids_pieces[0] = pads[plens[0]]
        ids_pieces[1::2] = completions
        ids_pieces[2::2] = map(pads.__getitem__, gaps)
        input_ids = _joined(ids_pieces, (B, T), _INT64, exact)
        start = 0
        for prompt, k in runs:
            if len(prompt):
                input_ids[start:start + k, :len(prompt)] = prompt
            start += k
    else:  # [prompt_i, completion_i, padding_i]
        row_prompts: list = []
        for prompt, k in runs:
            row_prompts += [np.asarray(prompt, dtype=np.int64)] * k
        ids_pieces = [None] * (3 * B)
        ids_pieces[0::3] = row_prompts
        ids_pieces[1::3] = completions
        ids_pieces[2::3] = map(pads.__getitem__, tails)
        input_ids = _joined(ids_pieces, (B, T), _INT64, exact)
    return input_ids, gen_lp


_INT64, _FLOAT32 = np.dtype(np.int64), np.dtype(np.float32)
_DTYPE = operator.attrgetter("dtype")


def _all_of_dtype(pieces: list, dtype: np.dtype) -> bool:
    """Whether every piece is an array of exactly `dtype` (byte order included; lists have no dtype)."""
    try:
        return list(map(_DTYPE, pieces)).count(dtype) == len(pieces)
    except AttributeError:
        return False


def _joined(pieces: list, shape: tuple[int, int], dtype: np.dtype, exact: bool) -> np.ndarray:
    """The pieces end to end as a [B, T] array of `dtype` in `ARENA`'s memory: `np.concatenate`,
    or with `exact` (every piece an array of `dtype` or bytes of its items) `bytes.join` of
    ~512 KiB at a time, each part copied into place while it is still in the cache. numpy's
    concatenation sets up a view and a copy per piece; the join reads each piece's buffer in C
    for a fraction of that (docs/benchmarks.md). One join of the whole chunk would instead
    depend on whether the allocator reuses a freed block or hands out fresh memory (page
    faults), which packing does not control; the parts are reused either way. A piece that
    exports no contiguous buffer, or a total that does not fill the shape, falls back to the
    concatenation (which raises where the pieces do not fit)."""
    out = ARENA.empty(shape, dtype)
    flat = out.reshape(-1)
    if exact:
        dest = memoryview(flat).cast("B")
        n, total = len(pieces), len(dest)
        parts = max(1, total >> 19)
        at, done = 0, False
        try:
            for i in range(parts):
                part = b"".join(pieces[i * n // parts:(i + 1) * n // parts])
                end = at + len(part)
                if end > total:
                    break
                dest[at:end] = part
                at = end
            else:
                done = at == total
        except (BufferError, TypeError, ValueError):  # numpy: ValueError for a non-contiguous array
            pass
        finally:
            dest.release()
        if done:
            return out
        pieces = [np.frombuffer(p, dtype=dtype) if type(p) is bytes else p for p in pieces]
    np.concatenate(pieces, out=flat, casting="unsafe")
    return out


class Arena:
    """Reused memory for the [B, T] arrays of packed chunks. A chunk of 16,000 x 259 tokens
    writes ~115 MB of arrays; fresh memory for them costs a page fault per 4 KiB page on first
    touch (the kernel zeroes each page), which at 1,000 groups x 16 samples per RL step cost
    more than the copies themselves. A buffer is reused only when nothing refers to it any
    more: every array handed out is a view of a
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


def _pack_routes(cols, width: int, required: bool) -> torch.Tensor | None:
    """[B, T, layers * k] expert ids (-1 where not recorded), or None when no sample has routes."""
    routes = cols.routed_experts or [None] * len(cols.completion_ids)
    if required:
        for i, r in enumerate(routes):
            if not r or not any(r):
                prompt, ends = cols.prompts[i], cols.end_versions
                raise ValueError(
                    f"router replay is on (trainer.router_replay.enabled) but sample {i} of this batch "
                    f"(prompt {prompt[:8]}{'...' if len(prompt) > 8 else ''}, {len(cols.completion_ids[i])} "
                    f"completion tokens, weight versions {cols.start_versions[i]}..{ends[i]}) carries no routed "
                    "experts: "
                    "its generation backend did not record them (only generation.backend 'native' records routes, "
                    "for mixture-of-experts models). Generate with the native engine, or set "
                    "trainer.router_replay.enabled: false.")
    per_token = next((t for r in routes for t in (r or ()) if t), None)
    if per_token is None:
        return None
    n = len(per_token)
    out = torch.full((len(routes), width, n), -1, dtype=torch.long)
    missing = [-1] * n
    for i, r in enumerate(routes):
        rows = [t if t else missing for t in (r or [])[:width]]
        bad = next((t for t, row in enumerate(rows) if len(row) != n), None)
        if bad is not None:
            raise ValueError(f"sample {i}, token {bad}: {len(rows[bad])} routed expert ids; other tokens have {n} "
                             "(layers x k). Routes of one batch must come from one model.")
        if rows:
            out[i, :len(rows)] = torch.tensor(rows, dtype=torch.long)
    return out

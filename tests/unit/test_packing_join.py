"""`packing._joined`: the `bytes.join` path writes what `np.concatenate` writes, and falls back where it must."""

import numpy as np
import pytest
import torch

from rl_core.columns import token_array
from rl_core.packing import _all_of_dtype, _joined, make_train_chunk
from rl_core.types import Sample


def _concatenated(pieces, dtype):
    out = np.full(sum(map(len, pieces)), 77, dtype=dtype)
    np.concatenate(pieces, out=out, casting="unsafe")
    return out


@pytest.mark.parametrize("dtype", [np.int64, np.float32])
def test_join_writes_what_concatenate_writes(dtype):
    rng = np.random.default_rng(3)
    base = np.arange(40, dtype=dtype)
    pieces = [rng.standard_normal(k).astype(dtype) if dtype == np.float32 else rng.integers(-2**40, 2**40, k)
              for k in (0, 1, 5, 0, 17, 3)] + [base[:0], base[:7], base[5:9]]  # slices of one array, empty ones
    ref = _concatenated(pieces, dtype)
    big_ref = _concatenated(pieces * 20_000, dtype)
    assert _all_of_dtype(pieces, np.dtype(dtype))
    pieces[1] = pieces[1].tobytes()  # padding pieces are bytes objects
    out = _joined(pieces, (1, len(ref)), np.dtype(dtype), True)
    assert out.dtype == dtype and out.tobytes() == ref.tobytes()
    big = _joined(pieces * 20_000, (20_000, len(ref)), np.dtype(dtype), True)  # joined in parts of ~512 KiB
    assert big.tobytes() == big_ref.tobytes()


def test_join_falls_back_where_bytes_would_be_wrong():
    strided = np.arange(20, dtype=np.int64)[::2]  # not contiguous: no simple buffer
    plain = np.arange(4, dtype=np.int64)
    for pieces in ([plain, strided, plain.tobytes()], [plain, np.arange(8, dtype=np.int64).reshape(4, 2)[:, 0]]):
        ref = np.concatenate([np.frombuffer(p, np.int64) if type(p) is bytes else p for p in pieces])
        out = _joined(pieces, (1, len(ref)), np.dtype(np.int64), True)
        assert np.array_equal(out[0], ref)
    for shape in ((1, 9), (1, 7), (0, 0)):  # pieces that do not fill the shape: the concatenation's error
        with pytest.raises(ValueError):
            _joined([plain, plain.tobytes()], shape, np.dtype(np.int64), True)
    assert _joined([plain[:0], b""], (0, 5), np.dtype(np.int64), True).shape == (0, 5)
    many = [plain] * 200_000 + [strided]  # the last part fails after others were written
    out = _joined(many, (1, 800_010), np.dtype(np.int64), True)
    assert np.array_equal(out[0], np.concatenate(many))
    assert not _all_of_dtype([plain, plain.astype(">i8")], np.dtype(np.int64))  # byte order counts
    assert not _all_of_dtype([plain, plain.astype(np.int32)], np.dtype(np.int64))
    assert not _all_of_dtype([plain, [1, 2]], np.dtype(np.int64))
    assert not _all_of_dtype([plain, torch.arange(3)], np.dtype(np.int64))


@pytest.mark.parametrize("shared", [True, False])
def test_chunks_of_exact_and_other_arrays_are_equal(shared):
    """The same rows as exact arrays (int64 ids, float32 logprobs), as other dtypes, byte orders
    and strides (the concatenation path) and as lists: equal chunks."""
    rng = np.random.default_rng(5)
    prompt = [3, 1, 4]
    rows = [(rng.integers(1, 999, k), rng.standard_normal(k)) for k in (0, 4, 9, 1, 9, 6, 2, 0, 5, 7, 3, 8)]

    def chunk(ids_of, lps_of):
        samples = [Sample(prompt if shared else list(prompt), ids_of(i), lps_of(lp), 1.0, "stop", 0, 1)
                   for i, lp in rows]
        return make_train_chunk(samples, None, pad_id=2)

    ref = chunk(list, lambda lp: lp.astype(np.float32).tolist())
    variants = [
        (token_array, lambda lp: lp.astype(np.float32)),
        (lambda i: i.astype(np.int32), lambda lp: lp.astype(np.float32)),
        (token_array, lambda lp: lp.astype(np.float32).astype(">f4")),
        (lambda i: np.repeat(token_array(i), 2)[::2], lambda lp: np.repeat(lp.astype(np.float32), 2)[::2]),
    ]
    for ids_of, lps_of in variants:
        got = chunk(ids_of, lps_of)
        for k in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs"):
            a, b = getattr(got, k), getattr(ref, k)
            assert a.dtype == b.dtype and torch.equal(a, b), k

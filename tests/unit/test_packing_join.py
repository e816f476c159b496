"""Packing's array path through `bytes.join` (the twelfth round of issue 18 item 3): chunks of
int64 ids and float32 logprobs equal the chunks of the same rows as lists, as other dtypes, byte
orders and strides (the concatenation), small and large (joined in parts); a piece that exports
no contiguous buffer after others were joined falls back to the concatenation."""

import numpy as np
import pytest
import torch

from rl_core.columns import token_array
from rl_core.packing import make_group_chunk, make_train_chunk
from rl_core.types import Sample

FIELDS = ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "sample_mask", "start_versions")


def _rows(seed, lengths):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 2**31 - 1, k), rng.standard_normal(k)) for k in lengths]


def _chunk(rows, prompt, shared, ids_of, lps_of, pad_id=2):
    samples = [Sample(prompt if shared else list(prompt), ids_of(i), lps_of(lp), 1.0, "stop", 0, 1) for i, lp in rows]
    return make_train_chunk(samples, None, pad_id=pad_id)


def _assert_equal(got, ref):
    for k in FIELDS:
        a, b = getattr(got, k), getattr(ref, k)
        assert a.dtype == b.dtype and torch.equal(a, b), k


VARIANTS = {
    "exact": (token_array, lambda lp: lp.astype(np.float32)),
    "int32 ids": (lambda i: i.astype(np.int32), lambda lp: lp.astype(np.float32)),
    "float64 logprobs": (token_array, lambda lp: lp),
    "big-endian logprobs": (token_array, lambda lp: lp.astype(np.float32).astype(">f4")),
    "strided": (lambda i: np.repeat(token_array(i), 2)[::2], lambda lp: np.repeat(lp.astype(np.float32), 2)[::2]),
}


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_array_chunks_equal_the_chunks_of_lists(shared, variant):
    rows = _rows(5, (0, 4, 9, 1, 9, 6, 2, 0, 5, 7, 3, 8))
    ref = _chunk(rows, [3, 1, 4], shared, list, lambda lp: lp.astype(np.float32).tolist())
    _assert_equal(_chunk(rows, [3, 1, 4], shared, *VARIANTS[variant]), ref)
    _assert_equal(_chunk(rows, [], shared, *VARIANTS[variant]), _chunk(rows, [], shared, list,
                                                                        lambda lp: lp.astype(np.float32).tolist()))


def test_large_chunks_are_joined_in_parts_and_fall_back_after_a_bad_piece():
    """~6 MB of ids (several parts of the join); then the same rows with the last completion
    strided (an int64 array without a contiguous buffer: its part fails after the others were
    written): the concatenation's chunk, equal to the list path's."""
    rows = _rows(7, [97 + i % 13 for i in range(6000)])
    ref = _chunk(rows, [9, 8], True, list, lambda lp: lp.astype(np.float32).tolist(), pad_id=0)
    _assert_equal(_chunk(rows, [9, 8], True, *VARIANTS["exact"], pad_id=0), ref)
    last = len(rows) - 1

    def ids_of(i, n=[0]):
        n[0] += 1
        return np.repeat(token_array(i), 2)[::2] if n[0] - 1 == last else token_array(i)

    _assert_equal(_chunk(rows, [9, 8], True, ids_of, lambda lp: lp.astype(np.float32), pad_id=0), ref)
    groups = [[Sample([9, 8], token_array(i), lp.astype(np.float32), 1.0, "stop", 0, 1) for i, lp in rows[j:j + 16]]
              for j in range(0, len(rows), 16)]
    _assert_equal(make_group_chunk(groups, pad_id=0), ref)

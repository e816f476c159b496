"""`columns.token_rows` / `logprob_rows`: a group's rows as views of one array, the values and
dtypes each row's `token_array` / `logprob_array` gives; `row_views` refuses lengths that do
not fill the array."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest

from rl_core.columns import logprob_array, logprob_rows, row_views, token_array, token_rows


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_rows_of_one_array_hold_each_rows_own_conversion():
    rng = random.Random(3)
    # floats float32 rounds, overflows to infinity or flushes below its subnormals, signed zeros, nan
    edge = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1 / 3, 3.4028235e38, 3.4028236e38, 1e39,
            2.0 ** -149, 2.0 ** -150, 2.0 ** -150 * 1.0000001, 1e-46]
    lps = [edge, []] + [[rng.uniform(-30.0, 0.0) for _ in range(rng.randint(0, 300))] for _ in range(40)]
    lps.append(np.asarray(lps[5]))  # an array row (float64) among the lists
    ids = [[rng.randrange(-2 ** 63, 2 ** 63) for _ in range(rng.randint(0, 300))] for _ in range(40)] + [[]]
    ids.append(np.asarray([7, 8, 9], dtype=np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float32 overflow, either way
        pairs = [(logprob_rows(lps), list(map(logprob_array, lps))), (token_rows(ids), list(map(token_array, ids)))]
    for rows, each in pairs:
        assert len(rows) == len(each) and all(map(_same, rows, each))
        base = rows[0].base
        assert all(r.base is base for r in rows) and base.size == sum(map(len, each))
    assert token_rows([]) == [] and logprob_rows([]) == []


def test_row_views_refuse_lengths_that_do_not_fill_the_array():
    flat = np.arange(6, dtype=np.int64)
    assert [r.tolist() for r in row_views(flat, [2, 0, 4])] == [[0, 1], [], [2, 3, 4, 5]]
    for lens in ([2, 3], [4, 4], []):
        with pytest.raises(ValueError, match="row lengths summing to"):
            row_views(flat, lens)

"""The groups that ask for their texts in one turn of the event loop go to the decode pool as
one job (`rollout.decode._GroupDecodes`, issue 18 item 3): each group must still get exactly
`tokenizer.decode(ids, skip_special_tokens=True)` of its own completions, its own error (the
others unharmed), nothing once cancelled, and groups of later turns go out as later jobs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rl_core.data.dataset import load_jsonl
from rl_core.model.tokenizer import build_tokenizer
from rl_core.rollout import decode as decode_mod
from rl_core.rollout.decode import decode_group
from tests.unit.test_group_decode import ragged_completions


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


def _groups(tok, k: int) -> list[list]:
    """k groups of 4 completions each, drawn from the hard cases, as lists and as int64 arrays."""
    base = ragged_completions(tok)
    out = []
    for g in range(k):
        ids = [base[(g * 5 + i) % len(base)] for i in range(4)]
        out.append([np.array(t, dtype=np.int64) for t in ids] if g % 2 else ids)
    return out


def test_one_turns_groups_go_as_one_job_with_each_groups_texts(tok):
    groups = _groups(tok, 40)
    want = [[tok.decode(t, skip_special_tokens=True) for t in ids] for ids in groups]

    async def main():
        before = decode_mod._DECODES.jobs
        got = await asyncio.gather(*(decode_group(tok, ids) for ids in groups))
        return got, decode_mod._DECODES.jobs - before

    got, jobs = asyncio.run(main())
    assert got == want
    assert jobs == 1


def test_groups_of_later_turns_go_as_later_jobs(tok):
    groups = _groups(tok, 6)
    want = [[tok.decode(t, skip_special_tokens=True) for t in ids] for ids in groups]

    async def main():
        before = decode_mod._DECODES.jobs
        got = []
        for ids in groups:  # one at a time: each waits for its texts before the next asks
            got.append(await decode_group(tok, ids))
        return got, decode_mod._DECODES.jobs - before

    got, jobs = asyncio.run(main())
    assert got == want and jobs == len(groups)


@pytest.mark.parametrize("bad", [[5, -1, 6], [5, 2**40]])
def test_a_groups_decode_error_is_its_own(tok, bad):
    with pytest.raises(OverflowError) as want:
        tok.decode(bad, skip_special_tokens=True)
    groups = _groups(tok, 5)
    groups[2] = groups[2][:2] + [bad]
    good = [[tok.decode(t, skip_special_tokens=True) for t in ids] for i, ids in enumerate(groups) if i != 2]

    async def main():
        return await asyncio.gather(*(decode_group(tok, ids) for ids in groups), return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[2], OverflowError) and str(got[2]) == str(want.value)
    assert [g for i, g in enumerate(got) if i != 2] == good


def test_a_cancelled_group_gets_nothing_and_the_others_their_texts(tok):
    groups = _groups(tok, 4)
    want = [[tok.decode(t, skip_special_tokens=True) for t in ids] for ids in groups]

    async def main():
        tasks = [asyncio.ensure_future(decode_group(tok, ids)) for ids in groups]
        await asyncio.sleep(0)  # every task has asked for its texts
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return done

    got = asyncio.run(main())
    assert isinstance(got[1], asyncio.CancelledError)
    assert [got[0], got[2], got[3]] == [want[0], want[2], want[3]]

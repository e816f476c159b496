"""load_jsonl errors and the PromptSource's epochs, drop_last, determinism and resume."""

from __future__ import annotations

import json

import pytest

from rl_core.data.dataset import PromptSource, load_jsonl
from rl_core.errors import DataError, RecipeError


def _examples(n):
    return [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]


def _ids(batch):
    return [d.index for d in batch]


# --------------------------------------------------------------------------- load_jsonl


def test_load_jsonl_reads_objects_and_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2", "x": 3}\n')
    assert load_jsonl(path) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2", "x": 3}]


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', r"d\.jsonl, line 2: malformed JSON"),
    ('{"prompt": "a", "answer": "1"}\n[1, 2]\n', r"d\.jsonl, line 2: expected a JSON object"),
    ('{"prompt": "a"}\n', r"d\.jsonl, line 1: missing key\(s\) 'answer'"),
    ("", r"d\.jsonl holds no examples"),
    ("\n  \n", r"d\.jsonl holds no examples"),
])
def test_load_jsonl_errors_name_file_and_line(tmp_path, text, match):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=match):
        load_jsonl(path)


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_load_jsonl_custom_required_keys(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q"}) + "\n")
    assert load_jsonl(path, required_keys=("question",)) == [{"question": "q"}]


# --------------------------------------------------------------------------- PromptSource


def test_epochs_are_bounded_and_drop_last():
    src = PromptSource(_examples(10), batch_size=3, shuffle=True, seed=0, max_num_epochs=2)
    assert src.batches_per_epoch == 3
    seen = {0: [], 1: []}
    batches = list(src)
    assert len(batches) == 6
    for batch in batches:
        assert len(batch) == 3
        epochs = {d.epoch for d in batch}
        assert len(epochs) == 1
        seen[epochs.pop()].extend(_ids(batch))
    for epoch_ids in seen.values():
        assert len(epoch_ids) == 9 == len(set(epoch_ids))  # one example dropped per epoch, no repeats
    assert src.next_batch() is None and src.next_batch() is None
    assert src.exhausted and src.epoch == 2


def test_epoch_and_position_bookkeeping():
    src = PromptSource(_examples(6), batch_size=2, shuffle=False, max_num_epochs=None)
    assert (src.epoch, src.position) == (0, 0)
    assert _ids(src.next_batch()) == [0, 1]
    assert (src.epoch, src.position) == (0, 1)
    src.next_batch()
    src.next_batch()
    assert (src.epoch, src.position, src.num_batches_drawn) == (1, 0, 3)
    assert _ids(src.next_batch()) == [0, 1]  # unshuffled: file order every epoch
    assert src.next_batch()[0].epoch == 1


def test_permutation_depends_only_on_seed_and_epoch():
    a = PromptSource(_examples(50), batch_size=5, seed=3)
    b = PromptSource(_examples(50), batch_size=7, seed=3)  # another batch size, same permutations
    c = PromptSource(_examples(50), batch_size=5, seed=4)
    assert a.epoch_order(0) == b.epoch_order(0) and a.epoch_order(5) == b.epoch_order(5)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != c.epoch_order(0)
    assert sorted(a.epoch_order(2)) == list(range(50))
    first = [_ids(a.next_batch()) for _ in range(10)]
    assert [i for batch in first for i in batch] == a.epoch_order(0)


def test_mid_epoch_restore_continues_identically():
    ref = PromptSource(_examples(23), batch_size=4, seed=11, max_num_epochs=3)
    for _ in range(7):  # epoch 1, position 2
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))  # plain JSON round trip
    assert all(isinstance(v, int) for v in state.values())
    assert (state["epoch"], state["position"]) == (1, 2)
    expected = [[(d.index, d.epoch) for d in batch] for batch in ref]

    restored = PromptSource(_examples(23), batch_size=4, seed=11, max_num_epochs=3)
    restored.load_state_dict(state)
    got = [[(d.index, d.epoch) for d in batch] for batch in restored]
    assert got == expected and len(got) == 3 * 5 - 7


def test_restore_refuses_another_setup():
    src = PromptSource(_examples(20), batch_size=4, seed=1)
    src.next_batch()
    state = src.state_dict()
    with pytest.raises(DataError, match="grpo.seed"):
        PromptSource(_examples(20), batch_size=4, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="grpo.num_prompts_per_step"):
        PromptSource(_examples(20), batch_size=5, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="data.train_file"):
        PromptSource(_examples(21), batch_size=4, seed=1).load_state_dict(state)


def test_total_steps():
    src = PromptSource(_examples(10), batch_size=3, max_num_epochs=2)
    assert src.total_steps(100) == 6 and src.total_steps(4) == 4
    assert PromptSource(_examples(10), batch_size=3).total_steps(100) == 100


def test_batch_larger_than_dataset_names_the_field():
    with pytest.raises(RecipeError, match="grpo.num_prompts_per_step"):
        PromptSource(_examples(3), batch_size=4)

"""A shaping bonus that RL learns at the expense of right answers: the headline reports the fall
(issue 39). With reward functions, accuracy once meant reward > 0, so a bonus for a wrong
format printed `held-out accuracy: 0.775 -> 1.000` while right answers fell 0.185 -> 0.03.

The situation is built to happen within a few RL steps on a CPU: every example's answer is
`123` (the warm-up teaches it in a few dozen steps, so RL starts from a policy that is often
right), the function `correct` pays 1 for it, and the shaping function `two_digits` pays 2
(weight) for any two-digit answer, a wrong format that RL then prefers. The run goes through
`rl-core train` as a user's would, and the test reads its headline: the numbers before and
after must be the share of right answers (the held-out mean of the 0/1 component `correct`),
not of rewarded samples (right answers plus two-digit ones), and the second must be lower."""

from __future__ import annotations

import json
import re

import pytest

from rl_core.metrics.logger import read_jsonl
from tests.helpers.paths import ROOT
from tests.helpers.user_code import user_module

REWARDS = '''
def correct(prompt, completion, example):
    return completion == example["answer"]

def two_digits(prompt, completion, example):
    return len(completion) == 2 and completion.isdigit()
'''
STEPS = 16
HEADLINE = re.compile(r"held-out accuracy: (\d\.\d{3}) before RL -> (\d\.\d{3}) after (\d+) RL steps "
                      r"\(([+-]\d+\.\d) points\)")


def _data(path, first: int, n: int) -> str:
    rows = [{"prompt": f"{a % 100:02d}+{(7 * a) % 100:02d}=", "answer": "123"} for a in range(first, first + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_bonus_that_wins_over_right_answers_shows_as_a_fall(tmp_path, monkeypatch, capsys):
    from rl_core.launch.cli import main

    monkeypatch.chdir(ROOT)
    env = ("env={type: reward_functions, functions: [{target: 'headline_rewards_mod:correct'}, "
           "{target: 'headline_rewards_mod:two_digits', weight: 2.0}], success: {component: correct}}")
    overrides = [f"output_dir={tmp_path}", "run_name=bonus", env,
                 f"data.train_file={_data(tmp_path / 'train.jsonl', 0, 64)}",
                 f"data.val_file={_data(tmp_path / 'val.jsonl', 64, 32)}", "data.max_train_examples=null",
                 "model.warmup={target_accuracy: 1.0, batch_size: 32, eval_every_steps: 25, num_eval_prompts: 16}",
                 f"grpo.max_num_steps={STEPS}", "grpo.max_num_epochs=4", "trainer.lr=1.0e-3",
                 "checkpoint.save_every_steps=0", "validation.max_val_samples=32"]
    with user_module(tmp_path, monkeypatch, "headline_rewards_mod", REWARDS):
        assert main(["train", str(ROOT / "recipes" / "tiny-addition-short.yaml"), *overrides]) == 0
    out = capsys.readouterr().out
    found = HEADLINE.findall(out)
    assert len(found) == 1, out
    before, after, steps, points = float(found[0][0]), float(found[0][1]), int(found[0][2]), float(found[0][3])
    assert steps == STEPS

    # the held-out records at the start and the end: accuracy is the mean of `correct` (0 or 1
    # per sample), and the rewarded share is larger by the two-digit answers
    vals = read_jsonl(tmp_path / "bonus" / "metrics.jsonl", kind="val")
    start, end = vals[0], vals[-1]
    assert (start["step"], end["step"]) == (0, STEPS)
    for rec, shown in ((start, before), (end, after)):
        assert rec["val/accuracy"] == pytest.approx(rec["val/reward/correct"], abs=1e-9)
        assert shown == pytest.approx(rec["val/accuracy"], abs=5e-4)
    rewarded_after = end["val/reward/correct"] + end["val/reward/two_digits"]  # never both: 3 digits vs 2
    assert end["val/reward/two_digits"] >= 0.25 and rewarded_after > after + 0.2, end
    # the fall, in the headline: from a policy that is often right to one that mostly is not
    assert before >= 0.5 and after <= before - 0.3, out
    assert points == pytest.approx((after - before) * 100, abs=0.06)

    # the training curves: train/accuracy is the share of right answers too; each component has its own
    train = read_jsonl(tmp_path / "bonus" / "metrics.jsonl", kind="train")
    assert len(train) == STEPS
    for m in train:
        assert m["train/accuracy"] == pytest.approx(m["reward/correct"], abs=1e-9)
        assert m["train/reward_mean"] == pytest.approx(m["reward/correct"] + 2.0 * m["reward/two_digits"], abs=1e-6)

"""A user's new task learns through the workflow with the settings docs/environments.md recommends.

The task is what a user writes on day one (docs/environments.md, "Write an environment"): a
custom environment class in their own module, 2-digit subtraction `a-b=` (a >= b) answered
in reversed digit order like the toy addition, reward 1 for the exact answer. The recipe
takes the embedded default and changes only what the docs' "A new task" section says to
change for a new task on the tiny model; the run goes through `snakemake` as a user's would.
The assertion is the learning: held-out accuracy (the environment's own `correct`) rises by
at least 30 points over the recipe's RL steps.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from rl_core.envs.base import BaseEnv, Completion
from rl_core.types import EnvResult
from tests.helpers.workflow import ROOT, make_workdir, snakemake


class SubtractionEnv(BaseEnv):
    """`a-b=` -> the difference's digits reversed, then the end token. Reward 1 when exact,
    plus `kwargs.partial_credit` x the share of answer digits right (position by position,
    for an ended completion): the denser signal docs/environments.md recommends."""

    name = "subtraction"
    reward_names = ("correct", "digits")

    def __init__(self, config, tokenizer):
        super().__init__(config, tokenizer)
        self.partial_credit = float(config.kwargs.get("partial_credit", 0.0))

    def score_completion(self, example: dict, completion: Completion) -> EnvResult:
        answer, text = example["answer"], completion.text
        correct = completion.ended and text == answer
        digits = sum(a == b for a, b in zip(text, answer)) / len(answer) if completion.ended else 0.0
        return EnvResult(reward=float(correct) + self.partial_credit * digits,
                         rewards={"correct": float(correct), "digits": digits}, info={"correct": correct})


def make_subtraction_data(out: Path, num_val: int = 500, seed: int = 0) -> None:
    """Every pair 10 <= b <= a <= 99, shuffled; `num_val` held out."""
    rows = [{"prompt": f"{a}-{b}=", "answer": str(a - b)[::-1], "a": a, "b": b}
            for a in range(10, 100) for b in range(10, a + 1)]
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("val", rows[:num_val]), ("train", rows[num_val:])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


# What docs/environments.md, "A new task", recommends for a new task on the tiny model.
# docs/environments.md, "A new task": a lower warm-up target, partial credit, 16 prompts x 8 at
# lr 2e-4 decaying linearly over 1,100 steps (3,595 training prompts: 5 epochs)
RECIPE = """\
extends: {root}/recipes/tiny-addition.yaml
run_name: subtraction
model: {{warmup: {{target_accuracy: 0.2}}}}
data: {{train_file: data/subtraction/train.jsonl, val_file: data/subtraction/val.jsonl}}
env: {{type: custom, target: "tests.workflow.test_new_task:SubtractionEnv", kwargs: {{partial_credit: 0.5}}}}
grpo: {{num_prompts_per_step: 16, max_num_steps: 1100, max_num_epochs: 5}}
trainer: {{lr: 2.0e-4}}
"""


@pytest.mark.slow
def test_a_new_task_learns_through_the_workflow_with_the_recommended_settings(tmp_path):
    wd = make_workdir(tmp_path / "wd")
    (wd / "data").unlink()  # the user's own data, not the repository's
    make_subtraction_data(wd / "data" / "subtraction")
    (wd / "subtraction.yaml").write_text(RECIPE.format(root=ROOT))
    # the user's module is found as docs/environments.md says: on PYTHONPATH
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = snakemake(wd, "--cores", "2", "--config", "recipe=subtraction.yaml", extra_env={"PYTHONPATH": path})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run = wd / "results" / "subtraction"
    before = json.loads((run / "init_validation.json").read_text())["accuracy"]
    epochs = sorted(run.glob("epoch_*/validation.json"))
    after = json.loads(epochs[-1].read_text())["accuracy"]
    steps = json.loads(sorted(run.glob("epoch_*/summary.json"))[-1].read_text())["rl_steps"]
    print(f"subtraction: held-out accuracy {before:.3f} -> {after:.3f} after {steps} RL steps")
    assert after - before >= 0.30, (before, after, steps)

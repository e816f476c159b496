"""`data.generate`: a reasoning_gym task's files generated from the recipe (config rules, the
generator's idempotence and refusal to overwrite foreign files, the epoch plan, errors naming
the recipe's fields) and the workflow's data inputs (a stage reruns when a file it reads is
edited in place)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_core.data.reasoning_gym import SPEC_FILE, generate_recipe_data
from rl_core.errors import DataError, RecipeError
from rl_core.launch.preflight import load_recipe, preflight
from rl_core.launch.stages import plan_epochs
from rl_core.launch.workflow import STAGE_SECTIONS, WorkflowPlan, load_workflow
from tests.helpers.paths import ROOT
from tests.helpers.recipes import recipe

TASK = {"type": "reasoning_gym", "task": "basic_arithmetic",
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}}


def _cfg(tmp_path: Path, **generate):
    return recipe(env=TASK, output_dir=str(tmp_path / "out"), run_name="rg",
                  data={"generate": {"num_train": 40, "num_val": 8, **generate}},
                  grpo={"num_prompts_per_step": 4, "max_num_epochs": 1})


def test_the_files_are_the_run_dirs_and_cannot_be_given(tmp_path):
    cfg = _cfg(tmp_path)
    d = f"{tmp_path}/out/rg/data"
    assert (cfg.data.train_file, cfg.data.val_file, cfg.generated_data_dir) == (f"{d}/train.jsonl", f"{d}/val.jsonl", d)
    again = recipe(**json.loads(cfg.model_dump_json()))  # the resolved config reads back as it was
    assert again.data.train_file == cfg.data.train_file
    with pytest.raises(RecipeError, match=r"field `data.train_file` got 'mine.jsonl'; expected unset when "
                                          r"data.generate is set"):
        recipe(env=TASK, data={"generate": {}, "train_file": "mine.jsonl"})
    with pytest.raises(RecipeError, match=r"field `data.generate` .* expected null with env.type addition"):
        recipe(data={"generate": {}})
    with pytest.raises(RecipeError, match=r"data.generate.num_val"):
        recipe(env=TASK, data={"generate": {"num_val": 0}})


def test_generation_is_idempotent_seeded_and_marked(tmp_path):
    cfg = _cfg(tmp_path)
    lines: list[str] = []
    assert generate_recipe_data(cfg, log=lines.append) is True and "generating 40 training and 8 held-out" in lines[0]
    train, val = Path(cfg.data.train_file), Path(cfg.data.val_file)
    first = (train.read_bytes(), val.read_bytes())
    assert len(first[0].splitlines()) == 40 and len(first[1].splitlines()) == 8
    spec = json.loads((train.parent / SPEC_FILE).read_text())
    assert spec == {"task": "basic_arithmetic", "config": TASK["config"], "num_train": 40, "num_val": 8, "seed": 0}
    mtime = train.stat().st_mtime_ns
    assert generate_recipe_data(cfg, log=lines.append) is False and train.stat().st_mtime_ns == mtime  # untouched
    other = _cfg(tmp_path, seed=5)  # another seed: rl_core's own files (marker present) are rewritten
    assert generate_recipe_data(other, log=lines.append) is True and train.read_bytes() != first[0]
    assert generate_recipe_data(cfg, log=lines.append) is True and (train.read_bytes(), val.read_bytes()) == first


def test_foreign_files_are_never_overwritten(tmp_path):
    cfg = _cfg(tmp_path)
    train = Path(cfg.data.train_file)
    train.parent.mkdir(parents=True)
    train.write_text('{"prompt": "mine", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"exists with other content and without rl_core's marker"):
        generate_recipe_data(cfg)
    assert train.read_text() == '{"prompt": "mine", "answer": "1"}\n' and not Path(cfg.data.val_file).exists()


def test_plan_and_preflight_before_the_files_exist(tmp_path):
    cfg = _cfg(tmp_path)
    preflight(cfg)  # the files do not exist yet: the task is generated (dry) instead of read
    assert not Path(cfg.data.train_file).exists()
    assert [e["end_step"] for e in plan_epochs(cfg)] == [10]  # 40 examples / 4 per step
    few = {"type": "reasoning_gym", "task": "leg_counting",  # 37 distinct questions
           "config": {"min_animals": 1, "max_animals": 1, "max_instances": 1}}
    many = recipe(env=few, output_dir=str(tmp_path / "out"), data={"generate": {"num_train": 8, "num_val": 40}},
                  grpo={"num_prompts_per_step": 4})
    with pytest.raises(RecipeError, match=r"field `data.generate.num_val` got 40; expected at most the \d+ "
                                          r"held-out questions .* Fix: lower data.generate.num_val or "
                                          r"data.generate.num_train"):
        preflight(many)
    bad = recipe(env={**TASK, "config": {"min_terms": 2, "max_terms": 2, "nope": 1}}, output_dir=str(tmp_path / "o"),
                 data={"generate": {}})
    with pytest.raises(RecipeError, match=r"field `env.config`"):
        preflight(bad)


def test_the_shipped_recipe_and_its_workflow_plan(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    cfg = load_recipe("recipes/tiny-reasoning-gym.yaml")
    assert cfg.data.train_file == "results/tiny-reasoning-gym/data/train.jsonl"
    wf = load_workflow({"recipe": "recipes/tiny-reasoning-gym.yaml"}, ROOT / "workflow/schemas/config.schema.yaml")
    assert wf.generated_data == [cfg.data.train_file, cfg.data.val_file, f"results/tiny-reasoning-gym/data/{SPEC_FILE}"]
    assert wf.data_inputs("validate") == [cfg.data.val_file]
    seeded = load_workflow({"recipe": "recipes/tiny-reasoning-gym.yaml", "overrides": ["data.generate.seed=3"]},
                           ROOT / "workflow/schemas/config.schema.yaml")
    changed = {s for s in STAGE_SECTIONS if seeded.digest(s) != wf.digest(s)}
    assert changed == {"data", "init", "train"}  # the files' paths stay; their content reruns the rest (inputs)


def test_data_inputs_list_a_dataset_directory_file_by_file(monkeypatch, tmp_path):
    import datasets

    monkeypatch.chdir(ROOT)
    d = tmp_path / "val_ds"
    datasets.Dataset.from_list([{"prompt": "1+1", "answer": "2"}] * 4).save_to_disk(str(d))
    wf = load_workflow({"recipe": "recipes/tiny-addition-short.yaml", "run": "t",
                        "overrides": [f"data.val_file={d}"]}, ROOT / "workflow/schemas/config.schema.yaml")
    files = wf.data_inputs("validate")
    assert files == sorted(files) and all(Path(f).is_file() and Path(f).parent == d for f in files)
    assert {Path(f).name for f in files} >= {"state.json", "dataset_info.json"}
    assert wf.data_inputs("train") == ["data/addition/train.jsonl", *files]
    assert isinstance(wf, WorkflowPlan)

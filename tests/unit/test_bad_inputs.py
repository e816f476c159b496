"""Bad inputs to `rl-core validate` (and `train`): recipes, command-line overrides, data files.

The README promises that a bad value stops the command before anything is built, with one
paragraph naming the field or file, exit status 2. Every row of the table below runs the
real CLI entry point in this process and checks exactly that: status 2, the field or file
named on stderr, one paragraph, no traceback, and nothing written under the run's
output directory. A few positive rows check that the strictness did not break valid YAML.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from rl_core.launch.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"
GOOD_ROW = '{"prompt": "07+45=", "answer": "250"}\n'


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _data(tmp: Path, name: str, body: bytes | str) -> Path:
    p = tmp / name
    p.write_bytes(body if isinstance(body, bytes) else body.encode())
    return p


SAMPLER_MODULE = '''
from rl_core.samplers.base import BaseSampler

class NotASampler:
    def __init__(self, num_prompts_per_step):
        pass

class OnlyP(BaseSampler):
    """A sampler whose constructor takes no extra keyword arguments."""
    name = "only_p"
    def __init__(self, num_prompts_per_step):
        super().__init__(num_prompts_per_step, None)
    def select(self, buffer, trainer_version, max_groups):
        return []

class Exploding(OnlyP):
    def __init__(self, num_prompts_per_step):
        raise RuntimeError("boom")

def not_a_class(num_prompts_per_step):
    return None
'''


# Each case: (recipe body appended to `extends: <default>` with output_dir set, or a callable
# tmp -> (recipe text or None, extra argv); the text the error must contain (field or file)).
def _recipe(body: str):
    return lambda tmp: (body, [])


def _override(*items: str):
    return lambda tmp: ("", list(items))


def _raw(text: bytes | str | None, with_base: bool = False):
    """A recipe file whose whole content is `text` (no extends / output_dir added)."""
    def make(tmp):
        return ("__RAW__", text, with_base)
    return make


def _data_case(name: str, body: bytes | str, field: str = "train_file"):
    def make(tmp):
        p = _data(tmp, name, body)
        return (f"data:\n  {field}: {p}\n", [])
    return make


def _extends_loop(tmp):
    (tmp / "a.yaml").write_text("extends: b.yaml\n")
    (tmp / "b.yaml").write_text("extends: a.yaml\n")
    return ("__FILE__", tmp / "a.yaml")


def _extends_chain(tmp):
    for i in range(20):
        (tmp / f"r{i}.yaml").write_text(f"extends: r{i + 1}.yaml\n" if i < 19 else "grpo: {seed: 1}\n")
    return ("__FILE__", tmp / "r0.yaml")


def _output_file(tmp):
    (tmp / "a_file").write_text("keep me\n")
    return ("", [f"output_dir={tmp / 'a_file'}"])


def _output_under_file(tmp):
    (tmp / "a_file").write_text("keep me\n")
    return ("", [f"output_dir={tmp / 'a_file' / 'sub'}"])


def _output_readonly(tmp):
    ro = tmp / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    return ("", [f"output_dir={ro / 'results'}"])


def _out_flag_file(tmp):
    (tmp / "a_file").write_text("keep me\n")
    return ("", ["--out", str(tmp / "a_file")])


def _eval_set(tmp):
    p = _data(tmp, "eval.jsonl", GOOD_ROW + '{"prompt": ["07", "+45="], "answer": "250"}\n')
    return (f"evaluation:\n  sets: {{hard: {p}}}\n", [])


def _sampler(target: str, kwargs: str = "{}"):
    def make(tmp):
        (tmp / "my_samplers.py").write_text(SAMPLER_MODULE)
        return (f"async_rl:\n  sampler: {{type: custom, target: '{target}', kwargs: {kwargs}}}\n"
                "loss:\n  importance_sampling: {enabled: true}\n", [])
    return make


ENV_MODULE = '''
from rl_core.envs.base import BaseEnv
from rl_core.types import EnvResult

class Abstract(BaseEnv):
    name = "abstract"

class NotAnEnv:
    def __init__(self, config, tokenizer):
        pass

class OneArg(BaseEnv):
    def __init__(self, config):
        pass
    def score_completion(self, example, completion):
        return EnvResult(reward=0.0)

def reward(prompt, completion, example):
    return 1.0

def two_args(prompt, completion):
    return 1.0

not_callable = 3
'''


def _env(env_yaml: str, data_yaml: str = ""):
    def make(tmp):
        (tmp / "my_env_plugins.py").write_text(ENV_MODULE)
        return (f"env: {env_yaml}\n" + data_yaml, [])
    return make


def _rows_file(name: str, rows: list, fmt: str, data_yaml: str = ""):
    """A Parquet file or a save_to_disk directory of `rows`, as data.train_file."""
    def make(tmp):
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            p = tmp / name
            pq.write_table(pa.Table.from_pylist(rows), p)
        elif fmt == "dataset_dict":
            import datasets

            p = tmp / name
            datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(p))
        else:
            import datasets

            p = tmp / name
            datasets.Dataset.from_list(rows).save_to_disk(str(p))
        return (f"data:\n  train_file: {p}\n" + data_yaml, [])
    return make


GOOD_ROWS = [{"prompt": "07+45=", "answer": "250"}] * 20
CHAT_ENV = "env: {type: reasoning_gym, task: basic_arithmetic, use_chat_template: true}\n"


CASES = {
    # ---- recipe files: YAML
    "yaml_duplicate_section": (_recipe("grpo: {seed: 1}\ngrpo: {seed: 2}\n"), ["grpo", "line 3", "line 4"]),
    "yaml_duplicate_nested_key": (_recipe("grpo:\n  seed: 1\n  max_num_steps: 3\n  seed: 2\n"), ["`grpo.seed`", "line 4", "line 6"]),
    "yaml_duplicate_in_flow": (_recipe("loss: {kl_coef: 0.1, kl_coef: 0.2}\n"), ["`loss.kl_coef`"]),
    "yaml_duplicate_in_list_item": (_recipe("evaluation:\n  checkpoints: [final]\ngeneration:\n  stop:\n    - {a: 1, a: 2}\n"),
                                    ["`generation.stop[0].a`"]),
    "yaml_alias_bomb": (_recipe(_alias_bomb()), ["(YAML aliases)", "100,000"]),
    "yaml_recursive_alias": (_recipe("evaluation: &x {sets: *x}\n"), ["(YAML aliases)"]),
    "yaml_syntax": (_recipe("grpo: {seed: 1\n"), ["(YAML syntax)", "line"]),
    "yaml_binary_tag": (_recipe("run_name: !!binary aGVsbG8=\n"), ["run_name", "!!binary"]),
    "yaml_set_tag": (_recipe("generation:\n  stop: !!set {a, b}\n"), ["generation.stop"]),
    "yaml_bool_key": (_recipe("grpo:\n  true: 3\n"), ["grpo.True", "quote the key"]),
    "yaml_yes_key_is_a_string_and_unknown": (_recipe("grpo:\n  yes: 3\n"), ["grpo.yes"]),
    "yaml_two_documents": (_recipe("---\ngrpo: {seed: 1}\n---\ngrpo: {seed: 2}\n"), ["(YAML syntax)"]),
    "recipe_not_utf8": (_raw(b"run_name: caf\xe9\n"), ["byte offset 13", "line 1", "UTF-8"]),
    "recipe_utf16": (_raw("run_name: x\n".encode("utf-16")), ["byte offset 0", "UTF-8"]),
    "recipe_empty": (_raw(""), ["(recipe file)", "empty"]),
    "recipe_only_comments": (_raw("# nothing here\n\n"), ["(recipe file)", "empty"]),
    "recipe_top_level_list": (_raw("- grpo\n- loss\n"), ["(top level)", "mapping"]),
    "recipe_top_level_scalar": (_raw("42\n"), ["(top level)"]),
    "recipe_too_large": (_raw("# " + "x" * (1 << 20) + "\n"), ["(recipe file)", "1,048,576 bytes"]),
    "recipe_missing": (lambda tmp: ("__FILE__", tmp / "nope.yaml"), ["(recipe file)", "nope.yaml"]),
    "recipe_is_directory": (lambda tmp: ("__FILE__", tmp), ["(recipe file)"]),
    "extends_int": (_raw("extends: 5\n"), ["`extends`", "5"]),
    "extends_list": (_raw("extends: [a.yaml]\n"), ["`extends`"]),
    "extends_missing": (_raw("extends: no-such-recipe.yaml\n"), ["`extends`", "no-such-recipe.yaml"]),
    "extends_loop": (_extends_loop, ["`extends`", "cycl"]),
    "extends_self": (_raw("extends: recipe.yaml\n"), ["`extends`", "cycl"]),
    "extends_too_deep": (_extends_chain, ["`extends`", "at most 16"]),
    # ---- recipe values
    "unknown_key_did_you_mean": (_recipe("grpo:\n  num_prompt_per_step: 4\n"), ["grpo.num_prompt_per_step", "did you mean"]),
    "wrong_type": (_recipe("trainer:\n  lr: fast\n"), ["trainer.lr"]),
    "unknown_sampler_type": (_recipe("async_rl:\n  sampler: {type: fifo}\n"), ["async_rl.sampler.type"]),
    "bool_as_int": (_recipe("grpo:\n  max_num_steps: true\n"), ["grpo.max_num_steps", "not numbers"]),
    "bool_as_float": (_recipe("loss:\n  kl_coef: false\n"), ["loss.kl_coef"]),
    "bool_as_string": (_recipe("run_name: true\n"), ["run_name"]),
    "int_as_bool": (_recipe("data:\n  shuffle: 1\n"), ["data.shuffle", "true or false"]),
    "float_infinite": (_recipe("trainer:\n  lr: .inf\n"), ["trainer.lr", "finite"]),
    "float_nan": (_override("loss.kl_coef=.nan"), ["loss.kl_coef", "finite"]),
    # the PPO critic is not sharded: refused beside the distributed trainers, naming the backend and the fix
    "critic_beside_fsdp2": (_override("trainer.backend=fsdp2", "critic.enabled=true", "advantage.estimator=gae"),
                            ["`critic.enabled`", "trainer.backend 'fsdp2'", "not shard the critic", "Fix:"]),
    "critic_beside_megatron": (_override("trainer.backend=megatron", "critic.enabled=true", "advantage.estimator=gae"),
                               ["`critic.enabled`", "trainer.backend 'megatron'", "trainer.backend: torch"]),
    "seed_too_large": (_recipe(f"grpo:\n  seed: {2**70}\n"), ["grpo.seed"]),
    "seed_negative": (_recipe("grpo:\n  seed: -1\n"), ["grpo.seed"]),
    "float16_on_cpu": (_recipe("runtime: {device: cpu}\nmodel: {dtype: float16}\n"), ["model.dtype", "float32"]),
    "max_train_examples_below_step": (_recipe("data:\n  max_train_examples: 4\n"), ["data.max_train_examples", "64"]),
    "missing_data_file": (_recipe("data:\n  train_file: data/nope/train.jsonl\n"), ["data.train_file"]),
    "sampler_not_importable": (_sampler("no_such_module_xyz:Sampler"), ["async_rl.sampler.target", "no_such_module_xyz"]),
    "sampler_class_missing": (_sampler("my_samplers:Missing"), ["async_rl.sampler.target", "Missing"]),
    "sampler_not_a_sampler": (_sampler("my_samplers:NotASampler"), ["async_rl.sampler.target", "Sampler protocol"]),
    "sampler_not_a_class": (_sampler("my_samplers:not_a_class"), ["async_rl.sampler.target"]),
    "sampler_bad_kwargs": (_sampler("my_samplers:OnlyP", "{window: 3}"), ["async_rl.sampler.kwargs", "window"]),
    "sampler_constructor_raises": (_sampler("my_samplers:Exploding"), ["async_rl.sampler.target", "boom"]),
    "output_dir_is_file": (_output_file, ["`output_dir`", "a_file"]),
    "output_dir_under_file": (_output_under_file, ["`output_dir`", "is a file"]),
    "output_dir_not_writable": (_output_readonly, ["`output_dir`", "not writable"]),
    "out_flag_is_file": (_out_flag_file, ["`--out`", "a_file"]),
    "output_dir_cannot_be_created": (_override("output_dir=/proc/rl_core_no_such_dir"), ["`output_dir`", "/proc/rl_core_no_such_dir"]),
    "out_flag_cannot_be_created": (lambda tmp: ("", ["--out", "/proc/rl_core_no_such_dir"]), ["`--out`"]),
    # ---- command-line overrides
    "override_bool_as_int": (_override("grpo.max_num_steps=true"), ["grpo.max_num_steps"]),
    "override_seed_2_70": (_override(f"grpo.seed={2**70}"), ["grpo.seed"]),
    "override_seed_negative": (_override("grpo.seed=-5"), ["grpo.seed"]),
    "override_float16_cpu": (_override("runtime.device=cpu", "model.dtype=float16"), ["model.dtype"]),
    "override_max_train_examples": (_override("data.max_train_examples=3"), ["data.max_train_examples"]),
    "override_no_equals": (_override("grpo.seed"), ["(override)"]),
    "override_empty_key_part": (_override("grpo..seed=1"), ["(override)", "grpo..seed"]),
    "override_duplicate_key": (_override("grpo={seed: 1, seed: 2}"), ["`grpo.seed`", "(command line)"]),
    "override_alias_bomb": (_override("grpo.seed=" + "[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + ["*a"] * 2000) + "]"),
                            ["(YAML aliases)"]),
    "override_unknown_key": (_override("grpo.sed=3"), ["grpo.sed", "did you mean"]),
    "override_custom_sampler_missing": (_override("async_rl.sampler.type=custom", "async_rl.sampler.target=nope_mod:S",
                                                  "loss.importance_sampling.enabled=true"),
                                        ["async_rl.sampler.target", "nope_mod"]),
    # ---- data files
    "data_numeric_prompt": (_data_case("num.jsonl", GOOD_ROW + '{"prompt": 745, "answer": "250"}\n'),
                            ["num.jsonl", "line 2", "'prompt'", "an integer", "expected a string", "data.train_file"]),
    "data_list_answer": (_data_case("list.jsonl", '{"prompt": "07+45=", "answer": ["2", "5", "0"]}\n'),
                         ["list.jsonl", "line 1", "'answer'", "a list"]),
    "data_int_answer": (_data_case("int.jsonl", '{"prompt": "07+45=", "answer": 250}\n'), ["int.jsonl", "'answer'"]),
    "data_null_prompt": (_data_case("null.jsonl", '{"prompt": null, "answer": "250"}\n'), ["null.jsonl", "'prompt'", "null"]),
    "data_bool_operand": (_data_case("op.jsonl", '{"prompt": "07+45=", "answer": "250", "a": true}\n'), ["op.jsonl", "'a'"]),
    "data_long_line": (_data_case("long.jsonl", GOOD_ROW + '{"prompt": "' + "1" * (3 << 20) + '", "answer": "1"}\n'),
                       ["long.jsonl", "line 2", "1,048,576 bytes"]),
    "data_not_utf8": (_data_case("latin1.jsonl", GOOD_ROW.encode() * 2 + b'{"prompt": "caf\xe9", "answer": "1"}\n'),
                      ["latin1.jsonl", "line 3", "UTF-8"]),
    "data_malformed_json": (_data_case("bad.jsonl", GOOD_ROW + '{"prompt": "1+1=",\n'), ["bad.jsonl", "line 2", "malformed JSON"]),
    "data_line_not_object": (_data_case("arr.jsonl", '["07+45=", "250"]\n'), ["arr.jsonl", "line 1", "JSON object"]),
    "data_missing_answer": (_data_case("miss.jsonl", '{"prompt": "07+45="}\n'), ["miss.jsonl", "'answer'"]),
    "data_empty_file": (_data_case("empty.jsonl", "\n\n"), ["empty.jsonl", "no examples"]),
    "data_val_file_bad": (_data_case("val.jsonl", '{"prompt": 1, "answer": "1"}\n', field="val_file"),
                          ["data.val_file", "val.jsonl", "'prompt'"]),
    "data_too_few_examples": (_data_case("few.jsonl", GOOD_ROW * 3), ["grpo.num_prompts_per_step", "3"]),
    "data_file_is_directory": (lambda tmp: (f"data:\n  train_file: {tmp}\n", []), ["data.train_file"]),
    "eval_set_bad_row": (_eval_set, ["evaluation.sets.hard", "eval.jsonl", "line 2", "'prompt'"]),
    # ---- data formats and field mapping
    "data_parquet_bad_row": (_rows_file("t.parquet", GOOD_ROWS[:3] + [{"prompt": None, "answer": "1"}], "parquet"),
                             ["data.train_file", "t.parquet, row 4", "'prompt'", "null"]),
    "data_save_to_disk_bad_row": (_rows_file("t_dir", GOOD_ROWS[:2] + [{"prompt": "1+1=", "answer": None}], "dir"),
                                  ["data.train_file", "t_dir, row 3", "'answer'"]),
    "data_dataset_dict": (_rows_file("dd", GOOD_ROWS, "dataset_dict"), ["data.train_file", "DatasetDict", "dd/train"]),
    "data_not_parquet": (_data_case("fake.parquet", GOOD_ROW), ["data.train_file", "fake.parquet", "not a readable Parquet"]),
    "data_prompt_key_missing": (_recipe("data:\n  prompt_key: question\n"), ["data.train_file", "line 1", "'question'"]),
    "data_answer_key_missing": (_rows_file("a.parquet", GOOD_ROWS, "parquet", "  answer_key: solution\n"),
                                ["a.parquet, row 1", "'solution'"]),
    "data_messages_not_a_list": (_rows_file("m.parquet", [{"chat": "hi", "answer": "1"}] * 20, "parquet",
                                            "  messages_key: chat\n" + CHAT_ENV), ["m.parquet, row 1", "'chat'", "list of messages"]),
    "data_messages_bad_role": (_rows_file("r_dir", [{"chat": [{"role": "robot", "content": "x"}], "answer": "1"}] * 20,
                                          "dir", "  messages_key: chat\n" + CHAT_ENV), ["r_dir, row 1", "'chat'", "'role'"]),
    "data_messages_without_chat_env": (_recipe("data:\n  messages_key: prompt\n"), ["data.messages_key", "chat template"]),
    "data_bad_prompt_key_type": (_override("data.prompt_key=5"), ["data.prompt_key"]),
    "data_no_answers_for_addition": (_override("data.answer_key=null"), ["data.answer_key", "env.type addition"]),
    "data_no_answers_for_tiny_model": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:reward'}]}",
                                            "data: {answer_key: null}\n"), ["data.answer_key", "model.source tiny"]),
    # ---- environments by import path (custom classes, reward functions, reasoning_gym)
    "env_custom_not_importable": (_env("{type: custom, target: 'no_such_env_mod_xyz:Env'}"),
                                  ["env.target", "no_such_env_mod_xyz", "PYTHONPATH"]),
    "env_custom_name_missing": (_env("{type: custom, target: 'my_env_plugins:Missing'}"), ["env.target", "Missing"]),
    "env_custom_not_a_class": (_env("{type: custom, target: 'my_env_plugins:reward'}"), ["env.target", "a class"]),
    "env_custom_not_an_env": (_env("{type: custom, target: 'my_env_plugins:NotAnEnv'}"),
                              ["env.target", "rl_core.protocols.Environment", "missing: name"]),
    "env_custom_abstract": (_env("{type: custom, target: 'my_env_plugins:Abstract'}"),
                            ["env.target", "score_completion"]),
    "env_custom_constructor": (_env("{type: custom, target: 'my_env_plugins:OneArg'}"),
                               ["env.target", "(config, tokenizer)"]),
    "env_custom_bad_target_syntax": (_env("{type: custom, target: 'my_env_plugins.Env'}"), ["env.target"]),
    "env_custom_no_target": (_env("{type: custom}"), ["env.target", "(missing)"]),
    "env_rf_not_importable": (_env("{type: reward_functions, functions: [{target: 'no_such_rf_mod:f'}]}"),
                              ["env.functions[0].target", "no_such_rf_mod"]),
    "env_rf_missing": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:reward'}, "
                            "{target: 'my_env_plugins:nope'}], success: {component: reward}}"),
                       ["env.functions[1].target", "nope"]),
    "env_rf_no_success": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:reward', name: right}, "
                               "{target: 'my_env_plugins:reward', name: bonus, weight: 0.1}]}"),
                          ["env.success", "(missing)", "right, bonus", "success: {component: right}", "threshold"]),
    "env_rf_success_unknown": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:reward'}], "
                                    "success: {component: corect}}"),
                               ["env.success.component", "'corect'", "env.functions: reward"]),
    "env_rf_success_empty": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:reward'}], "
                                  "success: {}}"), ["env.success", "a `component`, a `threshold` or both"]),
    "env_agent_success_unknown": (_env("{type: agent, target: 'my_env_plugins:reward', reward_names: [a, b], "
                                       "success: {component: c}}"),
                                  ["env.success.component", "env.reward_names: a, b"]),
    "env_rf_not_callable": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:not_callable'}]}"),
                            ["env.functions[0].target", "a function"]),
    "env_rf_signature": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:two_args'}]}"),
                         ["env.functions[0].target", "fn(prompt, completion, example)"]),
    "env_rf_duplicate_names": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:reward'}, "
                                    "{target: 'my_env_plugins:two_args', name: reward}]}"), ["env.functions[1].name"]),
    "env_rf_empty": (_env("{type: reward_functions, functions: []}"), ["env.functions"]),
    "env_rf_bool_weight": (_env("{type: reward_functions, functions: [{target: 'my_env_plugins:reward', weight: true}]}"),
                           ["env.functions[0].weight"]),
    "env_rg_unknown_task": (_env("{type: reasoning_gym, task: basic_arithmetc}"), ["env.task", "basic_arithmetic"]),
    "env_rg_bad_config": (_env("{type: reasoning_gym, task: basic_arithmetic, config: {min_terms: 5, max_terms: 2}}"),
                          ["env.config", "max_terms"]),
    "env_rg_size_in_config": (_env("{type: reasoning_gym, task: basic_arithmetic, config: {size: 5}}"),
                              ["env.config", "size"]),
}


FAIL_FAST = {"yaml_alias_bomb", "yaml_recursive_alias", "override_alias_bomb", "recipe_too_large", "data_long_line"}


def _run(tmp_path: Path, argv: list[str], capsys) -> tuple[int, str, float]:
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(argv)
    dt = time.perf_counter() - t0
    return rc, capsys.readouterr().err, dt


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_validate(name, tmp_path, capsys, monkeypatch):
    if name == "output_dir_not_writable" and os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(tmp_path))
    make, needles = CASES[name]
    made = make(tmp_path)
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    extra: list[str] = []
    if made[0] == "__RAW__":
        _, text, _ = made
        recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    elif made[0] == "__FILE__":
        recipe = made[1]
    else:
        body, extra = made
        recipe.write_text(f"extends: {RECIPE}\noutput_dir: {out}\n" + body)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    try:
        rc, err, dt = _run(tmp_path, ["validate", str(recipe), *extra], capsys)
    finally:
        sys.modules.pop("my_samplers", None)
        sys.modules.pop("my_env_plugins", None)
        if (tmp_path / "ro").exists():
            (tmp_path / "ro").chmod(0o700)
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    if name in FAIL_FAST:  # timed warm (the first call in a process also pays for imports)
        rc, _, dt = _run(tmp_path, ["validate", str(recipe), *extra], capsys)
        assert rc == 2 and dt < 1.0, f"took {dt:.2f} s"
    # nothing was built or written: no run directory, no resolved config, inputs untouched
    assert not out.exists(), list(out.rglob("*"))
    assert not list(tmp_path.rglob("resolved_config.json"))
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()
            and "__pycache__" not in p.parts} == {p: m for p, m in before.items() if "__pycache__" not in p.parts}


def test_data_limits_fail_fast(tmp_path):
    """A 50 MB line (no newline) and a numeric prompt are DataErrors naming file and line, fast."""
    from rl_core.data.dataset import load_jsonl
    from rl_core.errors import DataError

    big = tmp_path / "big.jsonl"
    with open(big, "wb") as fh:
        fh.write(GOOD_ROW.encode())
        fh.write(b'{"prompt": "' + b"7" * (50 << 20))
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"big\.jsonl, line 2: longer than 1,048,576 bytes"):
        load_jsonl(big)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.skipif(sys.platform != "linux", reason="CPU-only check needs a CPU-only machine")
def test_train_float16_on_auto_cpu_fails_before_build(tmp_path, capsys, monkeypatch):
    """`runtime.device: auto` resolves only at train time: float16 on a CPU-only machine stops
    `train` before the resolved config, the initial policy or anything else is written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: float16 is fine here")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    rc, err, _ = _run(tmp_path, ["train", str(RECIPE), f"output_dir={out}", "model.dtype=float16"], capsys)
    assert rc == 2 and "`model.dtype`" in err and "no CUDA device" in err and "Traceback" not in err, err
    assert not out.exists()


def test_train_bad_data_fails_before_build(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = _data(tmp_path, "train.jsonl", GOOD_ROW * 20 + '{"prompt": 12, "answer": "1"}\n')
    out = tmp_path / "out"
    rc, err, _ = _run(tmp_path, ["train", str(RECIPE), f"output_dir={out}", f"data.train_file={bad}"], capsys)
    assert rc == 2 and "train.jsonl, line 21" in err and "'prompt'" in err and "Traceback" not in err, err
    assert not out.exists()  # no init_policy, no resolved config


def test_valid_yaml_features_still_load(tmp_path, monkeypatch):
    """Anchors, merge keys and date-like strings are fine; only abuse is refused."""
    from rl_core.launch.preflight import load_recipe

    monkeypatch.chdir(ROOT)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {RECIPE}\noutput_dir: {tmp_path / 'out'}\nrun_name: 2026-12-01\n"
                      "validation: &v {max_val_samples: 64}\nevaluation:\n  <<: {num_generations_per_prompt: 2}\n"
                      "  max_samples: 10\n")
    cfg = load_recipe(recipe)
    assert cfg.run_name == "2026-12-01" and cfg.evaluation.num_generations_per_prompt == 2
    cfg = load_recipe(recipe, ["grpo.seed=18446744073709551615"])
    assert cfg.grpo.seed == 2**64 - 1


def test_case_count():
    assert len(CASES) >= 60


def test_yaml_12_booleans_keep_on_off_as_strings(tmp_path, capsys):
    """`logging.progress=off` is the documented value "off" (YAML 1.1 would read it as false)."""
    from rl_core.launch.preflight import load_recipe

    cfg = load_recipe(ROOT / "recipes" / "tiny-addition.yaml", ["logging.progress=off", f"output_dir={tmp_path}"])
    assert cfg.logging.progress == "off"

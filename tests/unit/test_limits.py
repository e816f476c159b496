"""Limits and silent accepts of issue 49: user data, user plug-ins and archives.

Each test feeds the real entry point (`rl-core validate` in this process, the loaders, the
plug-in loader, `rl-core inspect`) one bad input and checks that it is refused with one
paragraph naming the field or file, fast, before anything is built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rl_core.launch.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"
ROW = {"prompt": "07+45=", "answer": "250"}


def _validate(tmp_path: Path, body: str, capsys, *extra: str) -> tuple[int, str, float]:
    """`rl-core validate` on the default recipe plus `body`; (status, stderr, seconds)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: {RECIPE}\noutput_dir: {tmp_path / 'out'}\n" + textwrap.dedent(body))
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(["validate", str(recipe), *extra])
    return rc, capsys.readouterr().err, time.perf_counter() - t0


def _refused(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


# --------------------------------------------------------------------------- finding 4: data limits


def _big_rows(n_before: int = 10, size: int = 50 << 20) -> list[dict]:
    return [ROW] * n_before + [{"prompt": "7" * size, "answer": "1"}] + [ROW] * 10


@pytest.mark.parametrize("layout", ["one_group", "small_groups", "save_to_disk"])
def test_50mb_row_refused_by_validate(layout, tmp_path, capsys, monkeypatch):
    """A Parquet (or save_to_disk) row with a 50 MB prompt: refused by validate in seconds,
    naming the file and the row, as JSON lines are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(ROOT)
    table = pa.Table.from_pylist(_big_rows(100))
    if layout == "save_to_disk":
        import datasets

        path = tmp_path / "train_ds"
        datasets.Dataset(table).save_to_disk(str(path))
        row = "row 101"
    else:
        path = tmp_path / "train.parquet"
        pq.write_table(table, path, row_group_size=len(table) if layout == "one_group" else 8)
        row = "row 101" if layout == "one_group" else "rows 97-104"  # the batch check, or the footer's
    rc, err, dt = _validate(tmp_path, f"data:\n  train_file: {path}\n", capsys)
    _refused(rc, err, "`data.train_file`", str(path), row, "1,048,576 bytes")
    assert dt < 10, f"took {dt:.1f} s"


def test_row_over_limit_inside_small_batch(tmp_path):
    """A 2 MB row among many small ones (the row group's average is under the limit): the
    batch check names the row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rl_core.data.dataset import count_examples
    from rl_core.errors import DataError

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([ROW] * 300 + [{"prompt": "x" * (2 << 20), "answer": "1"}] + [ROW] * 3000),
                   path)
    with pytest.raises(DataError, match=r"t\.parquet, row 301: 2,097,\d+ bytes, longer than 1,048,576"):
        count_examples(path)
    pq.write_table(pa.Table.from_pylist([ROW] * 3000), path)
    assert count_examples(path) == 3000


# --------------------------------------------------------------------------- finding 7: plug-ins


def test_planted_module_in_working_directory_not_imported(tmp_path):
    """A recipe's plug-in in the working directory is found; a planted `triton.py` (a package
    torch imports optionally; a made-up name where triton is installed) beside it is never run
    by a later import."""
    import importlib.util

    name = "triton" if importlib.util.find_spec("triton") is None else "no_such_optional_package"
    marker = tmp_path / "planted_ran"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "my_rewards.py").write_text("def reward(prompt, completion, example):\n    return 1.0\n")
    script = textwrap.dedent(f"""
        from rl_core.plugins import load_target
        fn = load_target("my_rewards:reward", field="env.functions[0].target", kind="callable")
        assert fn(None, "", {{}}) == 1.0
        try:
            import {name}
        except ImportError:
            print("not importable")
        else:
            print("imported", {name}.__file__)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # -P: the interpreter does not add the working directory
    out = subprocess.run([sys.executable, "-P", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "not importable", out.stdout
    assert not marker.exists()


def test_huge_generate_refused_in_seconds(tmp_path, capsys, monkeypatch):
    """reasoning-gym `data.generate.num_train=1e8` is refused by validate with its bound, in
    seconds, before anything is generated; make-data refuses it too."""
    monkeypatch.chdir(ROOT)
    recipe = ROOT / "recipes" / "tiny-reasoning-gym.yaml"
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(["validate", str(recipe), f"output_dir={tmp_path / 'out'}", "data.generate.num_train=100000000"])
    err, dt = capsys.readouterr().err, time.perf_counter() - t0
    _refused(rc, err, "`data.generate.num_train`", "100000000", "1000000")
    assert dt < 5, f"took {dt:.1f} s"
    rc = main(["make-data", "reasoning_gym", "--name", "chain_sum", "--num-train", "100000000",
               "--out", str(tmp_path / "rg")])
    err = capsys.readouterr().err
    _refused(rc, err, "--num-train", "1,000,000")
    assert not (tmp_path / "rg").exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- finding 6: silent accepts


def test_env_result_refuses_non_numbers_and_float32_overflow():
    """`EnvResult(reward="1.0")` was coerced by float(); 1e300 is finite in float64 but not in
    float32, where advantages are computed. Both are refused, naming the field."""
    import numpy as np

    from rl_core.types import EnvResult

    for bad, where in [({"reward": "1.0"}, "EnvResult.reward got '1.0' (str)"),
                       ({"reward": None}, "EnvResult.reward got None"),
                       ({"reward": 1e300}, "EnvResult.reward got 1e+300"),
                       ({"reward": -1e300}, "EnvResult.reward got -1e+300"),
                       ({"reward": float("nan")}, "EnvResult.reward got nan"),
                       ({"reward": 1.0, "rewards": {"a": "0.5"}}, "EnvResult.rewards['a'] got '0.5'"),
                       ({"reward": 1.0, "rewards": {"a": 1e300}}, "EnvResult.rewards['a'] got 1e+300"),
                       ({"reward": 1.0, "rewards": [("a", 1.0)]}, "EnvResult.rewards got list")]:
        with pytest.raises(ValueError, match="float32|dict") as info:
            EnvResult(**bad)
        assert where in str(info.value), str(info.value)
    assert EnvResult(reward=np.float32(0.5), rewards={"a": 1, "b": True}).reward == 0.5
    assert EnvResult(reward=-3.4e38).reward == -3.4e38


AGENTS = '''
async def agent(client, example):
    return 1.0
'''


def test_agent_rewards_outside_float32_and_varying_names_refused(tmp_path, monkeypatch):
    from rl_core.envs.agent import AgentEnv, AgentError
    from rl_core.launch.preflight import load_recipe
    from rl_core.types import EnvResult
    from tests.helpers.fakes import FakeChatTokenizer
    from tests.helpers.user_code import user_module

    monkeypatch.chdir(ROOT)
    with user_module(tmp_path, monkeypatch, "limits_agents", AGENTS) as mod:
        cfg = load_recipe("tests/recipes/tiny-addition-loop.yaml", ["env.type=agent", f"env.target={mod}:agent"])
        env = AgentEnv(cfg.env, FakeChatTokenizer())
        for bad in (1e300, -1e300, {"a": 1e300}, {"a": 3e38, "b": 3e38}):
            with pytest.raises(AgentError, match="float32"):
                env.to_result(bad)
        assert env.to_result({"a": 1.0, "b": 0.5}).reward == 1.5  # the first episode's names...
        with pytest.raises(AgentError, match=r"returned reward components \['c'\]; an earlier episode returned "
                                              r"\['a', 'b'\]"):
            env.to_result({"c": 1.0})  # ...are every episode's
        with pytest.raises(AgentError, match=r"returned reward components \['a', 'c'\]; an earlier"):
            env.to_result(EnvResult(1.0, {"a": 1.0, "c": 0.0}))  # one the agent built, too
        env.reward_names = ("a", "b")
        with pytest.raises(AgentError, match=r"\['z'\]; env.reward_names says \['a', 'b'\]"):
            env.to_result(EnvResult(1.0, {"z": 1.0}))


CUSTOM_ENVS = '''
from rl_core.envs.base import BaseEnv
from rl_core.types import EnvResult

class Declared(BaseEnv):
    name = "declared"
    reward_names = ("correct", "format")
    def score_completion(self, example, completion):
        parts = {"correct": 1.0, "format": 0.0} if completion.text == "ok" else {"correct": 1.0, "fmt": 0.0}
        return EnvResult(reward=1.0, rewards=parts)

class Undeclared(BaseEnv):
    name = "undeclared"
    def score_completion(self, example, completion):
        return EnvResult(reward=1.0, rewards={completion.text: 1.0})

class Coerced(BaseEnv):
    name = "coerced"
    def score_completion(self, example, completion):
        return EnvResult(reward="1.0")
'''


def test_custom_env_reward_names_checked(tmp_path, monkeypatch):
    """Components other than the class's `reward_names`, or (without them) varying per sample,
    and a string reward are refused when the sample is scored."""
    from rl_core.config.schema import CustomEnvConfig
    from rl_core.data.dataset import load_jsonl
    from rl_core.envs import make_env
    from rl_core.model.tokenizer import build_tokenizer
    from tests.helpers.user_code import user_module

    monkeypatch.chdir(ROOT)
    tok = build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)

    def score(env, text):
        return env.score({"prompt": "1", "answer": "1"}, tok.encode(text, add_special_tokens=False), text, "stop")

    with user_module(tmp_path, monkeypatch, "limits_envs", CUSTOM_ENVS) as mod:
        declared = make_env(CustomEnvConfig(target=f"{mod}:Declared"), tok)
        assert score(declared, "ok").rewards == {"correct": 1.0, "format": 0.0}
        with pytest.raises(ValueError, match=r"reward components \['correct', 'fmt'\]; Declared.reward_names says "
                                             r"\['correct', 'format'\]"):
            score(declared, "no")
        undeclared = make_env(CustomEnvConfig(target=f"{mod}:Undeclared"), tok)
        score(undeclared, "a")
        score(undeclared, "a")
        with pytest.raises(ValueError, match=r"\['b'\]; an earlier sample returned \['a'\]"):
            score(undeclared, "b")
        with pytest.raises(ValueError, match=r"EnvResult.reward got '1.0' \(str\)"):
            score(make_env(CustomEnvConfig(target=f"{mod}:Coerced"), tok), "a")


RF = '''
async def async_reward(prompt, completion, example):
    return 1.0

def reward(prompt, completion, example):
    return 1.0
'''


def test_async_reward_function_and_misspelt_key_refused_by_validate(tmp_path, capsys, monkeypatch):
    from tests.helpers.user_code import user_module

    monkeypatch.chdir(ROOT)
    with user_module(tmp_path, monkeypatch, "limits_rf", RF) as mod:
        rc, err, _ = _validate(tmp_path, f"""
            env:
              type: reward_functions
              functions: [{{target: "{mod}:async_reward"}}]
            """, capsys)
        _refused(rc, err, "`env.functions[0].target`", "async def", "define it with `def`")
        rc, err, _ = _validate(tmp_path, f"""
            env:
              type: reward_functions
              functions: [{{target: "{mod}:reward", wieght: 2}}]
            """, capsys)
        _refused(rc, err, "`env.functions[0].wieght`", "name, target, weight", "did you mean `weight`?")
        rc, err, _ = _validate(tmp_path, f"""
            env:
              type: reward_functions
              functions: [{{target: "{mod}:reward", weight: 2}}]
            """, capsys)
        assert rc == 0, err


# --------------------------------------------------------------------------- finding 8: smaller ones


def test_empty_run_on_the_command_line_refused(monkeypatch):
    """`snakemake --config run=` reads as null: refused, not silently the recipe's run_name."""
    from rl_core.errors import RecipeError
    from rl_core.launch.workflow import load_workflow

    monkeypatch.chdir(ROOT)
    schema = ROOT / "workflow" / "schemas" / "config.schema.yaml"
    config = {"recipe": "recipes/tiny-addition-short.yaml", "run": None}
    with pytest.raises(RecipeError, match=r"field `run` got ''; expected a run name.*leave --config run= out"):
        load_workflow(config, schema, command_line={"run": None})
    assert load_workflow(config, schema, command_line={}).run == "tiny-addition-short"


def test_prompt_over_the_context_refused_when_init_policy_exists(tmp_path, capsys, monkeypatch):
    """With <run>/init_policy/ present (its tokenizer and config fix the model), a 300-token
    prompt is refused by validate naming the file and row, not after the build in the rollout."""
    import json

    from rl_core.data.dataset import load_jsonl
    from rl_core.model.tokenizer import build_tokenizer

    monkeypatch.chdir(ROOT)
    policy = tmp_path / "out" / "tiny-addition" / "init_policy"
    build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300, model_max_length=64).save_pretrained(str(policy))
    (policy / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    rows = [ROW] * 20 + [{"prompt": "12+34=" * 50, "answer": "46"}] + [ROW] * 80
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, err, dt = _validate(tmp_path, f"run_name: tiny-addition\ndata:\n  train_file: {data}\n", capsys)
    _refused(rc, err, "`data.train_file`", "row 21 has", "> 64, the model's context", str(policy / "config.json"),
             "rebuild it")
    rc, err, dt = _validate(tmp_path, "run_name: tiny-addition\n", capsys)  # the shipped data fits
    assert rc == 0, err
    assert dt < 30, f"validate took {dt:.1f} s"


def test_native_max_seq_len_beyond_the_model_refused(tmp_path, capsys, monkeypatch):
    """SmolLM2 with generation.native.max_seq_len 10,000,000 (train refused it at the engine's
    build): validate names the field and the model's 8,192 positions read from the GGUF header."""
    from rl_core.model.gguf import ModelFileError, find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except ModelFileError:
        pytest.skip("SmolLM2's GGUF file is not installed (make setup)")
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    rc = main(["validate", str(ROOT / "recipes" / "smollm2-arithmetic.yaml"), f"output_dir={tmp_path / 'out'}",
               "generation.native.max_seq_len=10000000"])
    _refused(rc, capsys.readouterr().err, "`generation.native.max_seq_len`", "10000000", "8,192 tokens",
             "llama.context_length")
    assert not (tmp_path / "out").exists()


def test_reasoning_gym_config_must_match_the_data(tmp_path, capsys, monkeypatch):
    """Data made with one reasoning-gym config and a recipe whose env.config differs (the task
    would score with other settings): refused naming env.config and the recorded settings."""
    from rl_core.data.reasoning_gym import make_reasoning_gym_data

    monkeypatch.chdir(ROOT)
    made = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"]}
    out = make_reasoning_gym_data(tmp_path / "rg", "basic_arithmetic", made, 40, 8)
    base = ["data.generate=null", f"data.train_file={out['train_file']}", f"data.val_file={out['val_file']}"]
    recipe = str(ROOT / "recipes" / "tiny-reasoning-gym.yaml")
    capsys.readouterr()
    rc = main(["validate", recipe, f"output_dir={tmp_path / 'out'}", *base])  # the recipe's config: max_digits 1
    _refused(rc, capsys.readouterr().err, "`env.config`", "'max_digits': 1", '"max_digits": 2', "generate.json")
    rc = main(["validate", recipe, f"output_dir={tmp_path / 'out'}", *base, "env.task=chain_sum", "env.config={}"])
    _refused(rc, capsys.readouterr().err, "`env.task`", "'basic_arithmetic'")
    rc = main(["validate", recipe, f"output_dir={tmp_path / 'out'}", *base, "env.config.max_digits=2"])
    assert rc == 0, capsys.readouterr().err


# --------------------------------------------------------------------------- finding 7/8: archives


def test_damaged_archive_reported_by_inspect(tmp_path, capsys):
    """8 KB zeroed in the middle of rollouts.h5: `rl-core inspect` reports it damaged from the
    checksum manifest, in seconds, before h5py opens it; the intact archive says it was verified."""
    from tests.unit.test_archive import _spool

    from rl_core.archive import compile_spool, manifest_path

    out = tmp_path / "rollouts.h5"
    compile_spool(_spool(tmp_path, num_steps=6)[0], out, attrs={"run": "r", "epoch": 1})
    assert manifest_path(out).is_file()
    capsys.readouterr()
    assert main(["inspect", str(out), "--num-samples", "1"]) == 0
    assert "checksum verified" in capsys.readouterr().out
    data = bytearray(out.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 8192] = bytes(min(8192, len(data) - mid))
    out.write_bytes(bytes(data))
    t0 = time.perf_counter()
    rc = main(["inspect", str(out)])
    err = capsys.readouterr().err
    _refused(rc, err, "rollouts.h5 is damaged", "manifest", "rollouts.h5.manifest.json", "rebuild it")
    assert time.perf_counter() - t0 < 5


def test_group_scores_refuse_non_numbers_and_float32_overflow():
    """A group scoring (`score_group` / `score_columns`) is held to what EnvResult is."""
    from rl_core.columns import GroupScores

    GroupScores([1.0, 0.0], {"a": [1, 0.5]}).check(2, "MyEnv.score_group")
    for scores, where in [(GroupScores(["1.0", 0.0]), "rewards holding '1.0' (str)"),
                          (GroupScores([1.0, -1e300]), "rewards holding -1e+300"),
                          (GroupScores([1.0, 0.0], {"a": [1.0, 1e300]}), "components['a'] holding 1e+300"),
                          (GroupScores([1.0, 0.0], [{"a": 1.0}, {"a": None}]), "components[1]['a'] holding None")]:
        with pytest.raises(ValueError, match="float32") as info:
            scores.check(2, "MyEnv.score_group")
        assert "MyEnv.score_group returned " + where in str(info.value), str(info.value)


def test_nul_byte_in_a_sharded_checkpoint_path_is_a_checkpoint_error(tmp_path):
    """A NUL byte in the checkpoint directory's path: a CheckpointError naming it, not a raw
    ValueError or DCP's CheckpointException (the storage-path case: test_no_pickle.py)."""
    from rl_core.errors import CheckpointError
    from rl_core.train.dcp_io import load_sharded

    with pytest.raises(CheckpointError, match=r"path '.*ck\\x00pt' holds a NUL byte.*FSDPTrainer.save_checkpoint"):
        load_sharded({}, str(tmp_path / "ck\x00pt"))

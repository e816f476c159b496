"""The rollout archive: spool JSON -> rollouts.h5 -> read back, and `rl-core inspect`."""

from __future__ import annotations

import json
import math
import random

import h5py
import numpy as np
import pytest

from rl_core.archive import FORMAT, RolloutArchive, compile_spool, inspect_main
from rl_core.errors import DataError
from rl_core.launch.cli import main as cli_main


def _spool(tmp_path, num_steps=3, groups=2, n=3, seed=0):
    rng = random.Random(seed)
    spool = tmp_path / "rollouts.spool"
    spool.mkdir()
    records = []
    for step in range(num_steps):
        gs = []
        for g in range(groups):
            samples = []
            for i in range(n):
                c = rng.randint(0, 5)  # empty completions happen (immediate end token)
                rewards = {"correct": float(rng.random() < 0.5)}
                if i != 1:
                    rewards["format"] = 0.5
                samples.append({
                    "prompt_ids": [rng.randint(0, 299) for _ in range(rng.randint(1, 6))],
                    "completion_ids": [rng.randint(0, 299) for _ in range(c)],
                    "gen_logprobs": [-rng.random() for _ in range(c)],
                    "reward": rewards["correct"] + rewards.get("format", 0.0), "rewards": rewards,
                    "advantage": rng.uniform(-1, 1), "finish_reason": rng.choice(["stop", "length"]),
                    "start_version": max(0, step - 1), "end_version": step, "env_mask": i == 2 and g == 0,
                    "token_versions": [step] * c if step % 2 else None})
            gs.append({"group_id": f"e0-p{step}{g}-d{step * groups + g}", "prompt_index": step * 10 + g, "epoch": 0,
                       "target_step": step, "start_version": max(0, step - 1), "end_version": step,
                       "staleness": 1 if step else 0, "samples": samples})
        rec = {"step": step, "weight_version": step, "groups": gs}
        records.append(rec)
        (spool / f"step_{step:06d}.json").write_text(json.dumps(rec))
    return spool, records


def test_compile_and_read_back_every_field(tmp_path):
    spool, records = _spool(tmp_path)
    out = tmp_path / "epoch_1" / "rollouts.h5"
    counts = compile_spool(spool, out, attrs={"run": "r", "epoch": 1})
    assert counts == {"num_steps": 3, "num_groups": 6, "num_samples": 18}
    flat = [(rec, g, s) for rec in records for g in rec["groups"] for s in g["samples"]]
    with RolloutArchive(out) as ar:
        assert ar.num_samples == 18
        assert ar.f.attrs["format"] == FORMAT and ar.f.attrs["run"] == "r"
        for i, (rec, g, s) in enumerate(flat):
            got = ar.sample(i)
            assert got["step"] == rec["step"] and got["group_id"] == g["group_id"]
            assert got["prompt_ids"] == s["prompt_ids"] and got["completion_ids"] == s["completion_ids"]
            np.testing.assert_allclose(got["gen_logprobs"], s["gen_logprobs"], rtol=1e-6)
            assert got["token_versions"] == (s["token_versions"] or [])
            assert got["reward"] == pytest.approx(s["reward"]) and got["advantage"] == pytest.approx(s["advantage"])
            assert got["env_mask"] == s["env_mask"] and got["finish_reason"] == s["finish_reason"]
            assert got["staleness"] == g["staleness"] and got["prompt_index"] == g["prompt_index"]
            assert got["rewards"]["correct"] == s["rewards"]["correct"]
            if "format" in s["rewards"]:
                assert got["rewards"]["format"] == 0.5
            else:
                assert math.isnan(got["rewards"]["format"])
        # group/sample indexing is consistent
        starts, counts_ = ar.column("groups/sample_start"), ar.column("groups/sample_count")
        assert list(starts) == [0, 3, 6, 9, 12, 15] and set(counts_) == {3}
        summ = ar.summary()
    assert summ["num_steps"] == 3 and summ["steps"] == [0, 2]
    assert summ["staleness"]["histogram"] == {0: 2, 1: 4}
    assert summ["env_masked"] == 3
    assert summ["accuracy"] == pytest.approx(np.mean([s["rewards"]["correct"] for _, _, s in flat]))
    assert summ["reward"]["mean"] == pytest.approx(np.mean([s["reward"] for _, _, s in flat]), rel=1e-6)
    # the write was atomic: no temporary left beside the archive and its checksum manifest
    assert sorted(p.name for p in out.parent.iterdir()) == ["rollouts.h5", "rollouts.h5.manifest.json"]


def test_routed_experts_of_moe_rollouts_round_trip(tmp_path):
    spool, records = _spool(tmp_path, num_steps=2)
    rng = random.Random(1)
    width = 3 * 2  # layers x k
    for path, rec in zip(sorted(spool.glob("step_*.json")), records):
        for g in rec["groups"]:
            for s in g["samples"]:
                fed = len(s["prompt_ids"]) + max(len(s["completion_ids"]) - 1, 0)
                s["routed_experts"] = [[rng.randint(0, 7) for _ in range(width)] for _ in range(fed)]
        path.write_text(json.dumps(rec))
    out = tmp_path / "rollouts.h5"
    compile_spool(spool, out)
    flat = [s for rec in records for g in rec["groups"] for s in g["samples"]]
    with RolloutArchive(out) as ar:
        assert ar.f["samples/routed_experts"].attrs["width"] == width
        for i, s in enumerate(flat):
            assert ar.sample(i)["routed_experts"] == s["routed_experts"]
    text = inspect_main(str(out), num_samples=1)
    assert f"routed experts: {len(flat[0]['routed_experts'])} positions x {width} ids" in text
    # dense rollouts: no routes column, no key
    (tmp_path / "dense").mkdir()
    spool2, _ = _spool(tmp_path / "dense")
    compile_spool(spool2, tmp_path / "dense.h5")
    with RolloutArchive(tmp_path / "dense.h5") as ar:
        assert "routed_experts" not in ar.f["samples"] and "routed_experts" not in ar.sample(0)


def test_inspect_prints_summary_and_samples(tmp_path, capsys):
    spool, _ = _spool(tmp_path, num_steps=2)
    out = tmp_path / "rollouts.h5"
    compile_spool(spool, out, attrs={"run": "r", "epoch": 2})
    text = inspect_main(str(out), num_samples=4, step=1)
    assert "run r, epoch 2" in text and "2 steps [0, 1]" in text and "staleness" in text
    assert text.count("[step 1 ") == 4 and "no tokenizer found" in text
    assert cli_main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_samples"] == 12


def test_inspect_decodes_with_a_tokenizer(tmp_path):
    from rl_core.config import read_recipe
    from rl_core.model.tokenizer import build_tokenizer

    cfg = read_recipe("recipes/tiny-addition.yaml")
    tok = build_tokenizer([{"prompt": "07+45=", "answer": "250"}, {"prompt": "12+34=", "answer": "640"}],
                          cfg.model.tiny.tokenizer_vocab_size)
    tok_dir = tmp_path / "epoch_1" / "checkpoint" / "model"
    tok.save_pretrained(str(tok_dir))
    spool = tmp_path / "spool"
    spool.mkdir()
    ids = tok.encode("07+45=", add_special_tokens=False)
    comp = tok.encode("250", add_special_tokens=False)
    rec = {"step": 0, "weight_version": 0, "groups": [{
        "group_id": "g", "prompt_index": 0, "epoch": 0, "target_step": 0, "start_version": 0, "end_version": 0,
        "staleness": 0, "samples": [{"prompt_ids": ids, "completion_ids": comp, "gen_logprobs": [0.0] * len(comp),
                                     "reward": 1.0, "rewards": {}, "advantage": 0.0, "finish_reason": "stop",
                                     "start_version": 0, "end_version": 0, "env_mask": False,
                                     "token_versions": None}]}]}
    (spool / "step_000000.json").write_text(json.dumps(rec))
    out = tmp_path / "epoch_1" / "rollouts.h5"
    compile_spool(spool, out)
    text = inspect_main(str(out))
    assert "'07+45=' -> '250'" in text and f"decoded with {tok_dir}" in text


def test_bad_inputs_name_the_file(tmp_path):
    empty = tmp_path / "spool"
    empty.mkdir()
    with pytest.raises(DataError, match=str(empty)):
        compile_spool(empty, tmp_path / "x.h5")
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    with pytest.raises(DataError, match="bad.h5"):
        RolloutArchive(bad)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something else"
    with pytest.raises(DataError, match="not an rl_core rollout archive"):
        RolloutArchive(other)
    assert cli_main(["inspect", str(tmp_path / "missing.h5")]) == 2


def test_turn_boundaries_versions_and_loss_mask_round_trip_and_inspect_shows_them(tmp_path):
    spool, records = _spool(tmp_path, num_steps=1, groups=1, n=2)
    two_turns = records[0]["groups"][0]["samples"][0]
    two_turns.update(completion_ids=[5, 6, 7, 8, 9, 10, 11], gen_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5],
                     token_versions=[3, 3, -1, -1, 4, 4, 4], completion_mask=[1, 1, 0, 0, 1, 1, 1],
                     turn_starts=[0, 4], turn_versions=[3, 4], segments=2)
    (spool / "step_000000.json").write_text(json.dumps(records[0]))
    out = tmp_path / "rollouts.h5"
    compile_spool(spool, out)
    with RolloutArchive(out) as ar:
        s0, s1 = ar.sample(0), ar.sample(1)
        summ = ar.summary()
    assert s0["completion_mask"] == [1, 1, 0, 0, 1, 1, 1] and s0["turn_starts"] == [0, 4]
    assert s0["turn_versions"] == [3, 4] and s0["segments"] == 2
    assert s1["completion_mask"] == [] and s1["turn_starts"] == [] and s1["segments"] == 1  # single-turn
    assert summ["multi_turn_samples"] == 1 and summ["segment_breaks"] == 1
    text = inspect_main(str(out), num_samples=2)
    assert "turns 2 starting at completion tokens [0, 4], versions [3, 4]; 2 observation tokens masked" in text
    assert "2 segments (the last trained)" in text and "1 multi-turn samples, 1 segment breaks" in text

"""Issue 13: bad reused state and bad command-line paths, as a table.

Every case runs `rl-core` in-process (`rl_core.launch.cli.main`) and must: exit 2, print one
paragraph on stderr naming the file or the option, print no traceback, and leave the
directory tree as it was (nothing built, written, moved or deleted before the error).

Cases: damaged or mismatched checkpoints given to `train --resume-from`, initial-policy
directories (`init-policy --out`, a stale `<run>/init_policy`), `inspect` (damaged
archives, bad options) and `make-data` (bad options, paths it must not overwrite).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rl_core.checkpoint.store import write_checkpoint
from rl_core.fsutil import write_marker
from rl_core.launch.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny-addition.yaml")

# the config.json of the default recipe's tiny model (what init_policy writes), vocabulary 300
_TINY_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                "intermediate_size": 512, "max_position_embeddings": 64, "tie_word_embeddings": False,
                "vocab_size": 300}


def _model_dir(d: Path, **changes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**_TINY_CONFIG, **changes}))
    (d / "model.safetensors").write_bytes(b"\0" * 64)  # never loaded: every case stops before
    (d / "tokenizer_config.json").write_text("{}")
    return d


def _checkpoint(path: Path, **model_changes) -> Path:
    """A structurally complete run checkpoint (manifest, controller state, buffer, model config)."""

    def fill(tmp: Path) -> None:
        _model_dir(tmp / "model", **model_changes)
        state = {"rl_step": 4, "epoch": 0, "source": {}, "sampler": {}, "rollout": {},
                 "trainer": {"version": 4, "optimizer_steps": 4}}
        (tmp / "controller_state.json").write_text(json.dumps(state))
        (tmp / "buffer.json").write_text(json.dumps({"capacity": 8, "counts": {}, "ready": []}))
        (tmp / "optimizer.pt").write_bytes(b"x" * 32)
        (tmp / "resolved_config.json").write_text(json.dumps({"model": {"source": "tiny", "tiny": {
            "tokenizer_vocab_size": 300}}}))

    return write_checkpoint(path, fill, {"weight_version": 4, "rl_step": 4, "open_step_next_ministep": None,
                                         "optimizer_steps": 4, "epoch": 0})


def _edit_manifest(ck: Path, fn) -> None:
    m = json.loads((ck / "manifest.json").read_text())
    (ck / "manifest.json").write_text(json.dumps(fn(m)))


def _archive(tmp: Path) -> Path:
    from rl_core.archive import compile_spool

    spool = tmp / "rollouts.spool"
    spool.mkdir()
    sample = {"prompt_ids": [1, 2], "completion_ids": [3], "gen_logprobs": [-0.5], "reward": 1.0,
              "rewards": {"correct": 1.0}, "advantage": 0.5, "finish_reason": "stop", "start_version": 0,
              "end_version": 0, "env_mask": False}
    for step in (0, 1):
        rec = {"step": step, "weight_version": step, "groups": [
            {"group_id": f"g{step}", "prompt_index": step, "epoch": 0, "target_step": step, "start_version": 0,
             "end_version": 0, "staleness": 0, "samples": [sample, sample]}]}
        (spool / f"step_{step:06d}.json").write_text(json.dumps(rec))
    out = compile_spool(spool, tmp / "epoch_1" / "rollouts.h5")
    shutil.rmtree(spool)
    return tmp / "epoch_1" / "rollouts.h5"


# --------------------------------------------------------------------------- case builders
# each: (tmp) -> (argv, words the message must contain)


def _train(tmp, *extra):
    return ["train", RECIPE, f"output_dir={tmp / 'results'}", "run_name=r", *extra]


def ck_manifest_missing(tmp):
    ck = _checkpoint(tmp / "ck")
    (ck / "manifest.json").unlink()
    return _train(tmp, "--resume-from", str(ck)), ["manifest.json is missing", "--resume-from"]


def ck_manifest_list(tmp):
    ck = _checkpoint(tmp / "ck")
    (ck / "manifest.json").write_text("[1, 2]")
    return _train(tmp, "--resume-from", str(ck)), ["manifest.json is a JSON list"]


def ck_manifest_no_files(tmp):
    ck = _checkpoint(tmp / "ck")
    _edit_manifest(ck, lambda m: {k: v for k, v in m.items() if k != "files"})
    return _train(tmp, "--resume-from", str(ck)), ["manifest.json has no `files`"]


def ck_manifest_not_json(tmp):
    ck = _checkpoint(tmp / "ck")
    (ck / "manifest.json").write_bytes(b"\xff\xfe{not json")
    return _train(tmp, "--resume-from", str(ck)), ["manifest.json cannot be read as JSON"]


def ck_manifest_bad_entry(tmp):
    ck = _checkpoint(tmp / "ck")
    _edit_manifest(ck, lambda m: {**m, "files": {**m["files"], "buffer.json": {"size": "9", "sha256": 1}}})
    return _train(tmp, "--resume-from", str(ck)), ["'buffer.json' without an integer `size`"]


def ck_manifest_wrong_format(tmp):
    ck = _checkpoint(tmp / "ck")
    _edit_manifest(ck, lambda m: {**m, "format": "other/9"})
    return _train(tmp, "--resume-from", str(ck)), ["has format 'other/9'"]


def ck_manifest_escapes(tmp):
    ck = _checkpoint(tmp / "ck")
    _edit_manifest(ck, lambda m: {**m, "files": {**m["files"], "../outside": {"size": 1, "sha256": "0"}}})
    return _train(tmp, "--resume-from", str(ck)), ["'../outside'", "outside the checkpoint"]


def ck_hash_mismatch(tmp):
    ck = _checkpoint(tmp / "ck")
    (ck / "optimizer.pt").write_bytes(b"y" * 32)  # same size, other bytes
    return _train(tmp, "--resume-from", str(ck)), ["optimizer.pt does not match its sha256"]


def ck_truncated(tmp):
    ck = _checkpoint(tmp / "ck")
    (ck / "optimizer.pt").write_bytes(b"x" * 7)
    return _train(tmp, "--resume-from", str(ck)), ["optimizer.pt has 7 bytes"]


def ck_file_missing(tmp):
    ck = _checkpoint(tmp / "ck")
    (ck / "buffer.json").unlink()
    return _train(tmp, "--resume-from", str(ck)), ["buffer.json is missing"]


def _restate(ck: Path, state) -> None:
    """Replace controller_state.json and re-hash it into the manifest (a consistent but bad checkpoint)."""
    from rl_core.checkpoint.store import sha256_file

    p = ck / "controller_state.json"
    p.write_text(json.dumps(state))
    _edit_manifest(ck, lambda m: {**m, "files": {**m["files"], "controller_state.json": {
        "size": p.stat().st_size, "sha256": sha256_file(p)}}})


def ck_state_without_trainer(tmp):
    ck = _checkpoint(tmp / "ck")
    _restate(ck, {"rl_step": 4, "source": {}, "sampler": {}, "rollout": {}})
    return _train(tmp, "--resume-from", str(ck)), ["controller_state.json has no `trainer`"]


def ck_state_is_list(tmp):
    ck = _checkpoint(tmp / "ck")
    _restate(ck, [1, 2, 3])
    return _train(tmp, "--resume-from", str(ck)), ["controller_state.json is a JSON list"]


def ck_missing_path(tmp):
    return _train(tmp, "--resume-from", str(tmp / "nope")), ["nope does not exist"]


def ck_steps_dir_given(tmp):
    _checkpoint(tmp / "steps" / "step_000004")
    return (_train(tmp, "--resume-from", str(tmp / "steps")),
            ["directory of step checkpoints", "step_000004"])


def ck_other_model_shape(tmp):
    ck = _checkpoint(tmp / "ck")
    return (_train(tmp, "--resume-from", str(ck), "model.tiny.hidden_size=64"),
            ["model.tiny.hidden_size is 64 in the recipe but 128", "model.tiny.hidden_size=128"])


def ck_other_vocab(tmp):
    ck = _checkpoint(tmp / "ck")
    return (_train(tmp, "--resume-from", str(ck), "model.tiny.tokenizer_vocab_size=400"),
            ["model.tiny.tokenizer_vocab_size is 400 in the recipe but 300"])


def run_stale_init_policy(tmp):
    pol = _model_dir(tmp / "results" / "r" / "init_policy", num_hidden_layers=4)
    write_marker(pol, "policy")
    return _train(tmp), ["model.tiny.num_hidden_layers is 2 in the recipe but 4", "init_policy"]


def run_checkpoint_other_shape(tmp):
    """A plain rerun (no --resume-from) whose newest step checkpoint has another model shape than
    the recipe (the initial policy was rebuilt for the new shape): refused before the run's
    resolved_config.json is rewritten or anything is built."""
    pol = _model_dir(tmp / "results" / "r" / "init_policy", hidden_size=64)
    write_marker(pol, "policy")
    _checkpoint(tmp / "results" / "r" / "steps" / "step_000004")
    (tmp / "results" / "r" / "resolved_config.json").write_text('{"model": "as the first run resolved it"}')
    return (_train(tmp, "model.tiny.hidden_size=64"),
            ["model.tiny.hidden_size is 64 in the recipe but 128", "step_000004", "--resume-from"])


def run_foreign_final_policy(tmp):
    d = tmp / "results" / "r" / "final_policy"
    d.mkdir(parents=True)
    (d / "my_model.bin").write_bytes(b"x")
    return _train(tmp), ["final_policy", "not written by rl_core"]


def ip_out_is_file(tmp):
    f = tmp / "a_file"
    f.write_text("user data")
    return ["init-policy", RECIPE, f"output_dir={tmp / 'results'}", "--out", str(f)], ["a_file", "not a directory"]


def ip_out_user_dir(tmp):
    d = tmp / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("x")
    return (["init-policy", RECIPE, f"output_dir={tmp / 'results'}", "--out", str(d)],
            ["--out", "mine", "not written by rl_core", "--force"])


def ip_out_user_dir_force(tmp):
    d = tmp / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("x")
    return (["init-policy", RECIPE, f"output_dir={tmp / 'results'}", "--out", str(d), "--force"],
            ["`--out`", "mine", ".rl_core-output"])


def ip_out_marked_other_shape(tmp):
    pol = _model_dir(tmp / "pol", hidden_size=256)
    write_marker(pol, "policy")
    return (["init-policy", RECIPE, f"output_dir={tmp / 'results'}", "--out", str(pol)],
            ["model.tiny.hidden_size is 128 in the recipe but 256", "--force"])


def _inspect(tmp, *extra):
    return ["inspect", str(_archive(tmp)), *extra]


def insp_garbage(tmp):
    f = tmp / "rollouts.h5"
    f.write_bytes(b"\x89HDF\r\n" + b"\0" * 100)
    return ["inspect", str(f)], ["rollouts.h5", "cannot be opened as HDF5"]


def insp_missing_datasets(tmp):
    import h5py

    from rl_core.archive import FORMAT

    f = tmp / "rollouts.h5"
    with h5py.File(f, "w") as h:
        h.attrs["format"] = FORMAT
        h.create_group("samples")
    return ["inspect", str(f)], ["rollouts.h5 is damaged"]


def insp_missing_file(tmp):
    return ["inspect", str(tmp / "none.h5")], ["none.h5 does not exist"]


def insp_tokenizer_missing(tmp):
    return _inspect(tmp, "--tokenizer", str(tmp / "no_tok")), ["`--tokenizer`", "no_tok"]


def insp_tokenizer_broken(tmp):
    d = tmp / "tok"
    d.mkdir()
    (d / "tokenizer_config.json").write_text("{broken")
    return _inspect(tmp, "--tokenizer", str(d)), ["Tokenizer directory", "tok", "--tokenizer"]


def insp_step_absent(tmp):
    return _inspect(tmp, "--step", "9999"), ["`--step` got 9999", "steps 0..1"]


def insp_negative_samples(tmp):
    return _inspect(tmp, "--num-samples", "-3"), ["`--num-samples` got -3"]


def md_num_val_negative(tmp):
    return ["make-data", "addition", "--out", str(tmp / "d"), "--num-val", "-5"], ["`--num-val` got -5", "1 to 9999"]


def md_num_val_too_big(tmp):
    return ["make-data", "addition", "--out", str(tmp / "d"), "--num-val", "20000"], ["`--num-val` got 20000"]


def md_num_val_all(tmp):
    return ["make-data", "addition", "--out", str(tmp / "d"), "--num-val", "10000"], ["`--num-val` got 10000"]


def md_out_is_file(tmp):
    f = tmp / "f.txt"
    f.write_text("mine")
    return ["make-data", "addition", "--out", str(f)], ["`--out`", "f.txt is a file"]


def md_out_other_data(tmp):
    d = tmp / "d"
    d.mkdir()
    (d / "train.jsonl").write_text('{"prompt": "my own data", "answer": "1"}\n')
    return ["make-data", "addition", "--out", str(d)], ["train.jsonl exists with different content", "--force"]


CASES = [ck_manifest_missing, ck_manifest_list, ck_manifest_no_files, ck_manifest_not_json, ck_manifest_bad_entry,
         ck_manifest_wrong_format, ck_manifest_escapes, ck_hash_mismatch, ck_truncated, ck_file_missing,
         ck_state_without_trainer, ck_state_is_list, ck_missing_path, ck_steps_dir_given, ck_other_model_shape,
         ck_other_vocab, run_stale_init_policy, run_checkpoint_other_shape, run_foreign_final_policy, ip_out_is_file, ip_out_user_dir, ip_out_user_dir_force,
         ip_out_marked_other_shape, insp_garbage, insp_missing_datasets, insp_missing_file, insp_tokenizer_missing,
         insp_tokenizer_broken, insp_step_absent, insp_negative_samples, md_num_val_negative, md_num_val_too_big,
         md_num_val_all, md_out_is_file, md_out_other_data]


def _tree(root: Path) -> dict[str, tuple[int, int, bytes | None]]:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = (st.st_mode, st.st_size, p.read_bytes() if p.is_file() else None)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_state_input_exits_2_naming_it_and_changes_nothing(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv, words = case(tmp_path)
    before = _tree(tmp_path)
    capsys.readouterr()
    rc = cli_main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err + out
    msg = err.strip()
    assert msg.startswith(f"rl-core {argv[0]}:") and "\n" not in msg, msg  # one paragraph
    for w in words:
        assert w in msg, (w, msg)
    assert "Fix:" in msg, msg
    assert _tree(tmp_path) == before, "something was written, moved or deleted before the error"


def test_the_table_is_large_enough():
    assert len(CASES) >= 20

"""Checkpoints of the multi-process trainers (2 processes): a resumed trainer takes exactly the
step the original took.

Two ways back (see `fsdp_checkpoint_worker.py`): the HF export + the full optimizer state
(`state_dict`, saved with torch.save and read with weights_only=True, as run checkpoints
do), and the sharded `torch.distributed.checkpoint` directory restored into a trainer
built from the initial weights. Both must reproduce the reference step bit for bit (same
world size, same reduction order), and the HF export must equal the exported weights.
Megatron (TP=2: its optimizer state is gathered per tensor-parallel rank) resumes the first way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.trainers import ROOT, free_port, tiny_hf_dir


def _run(tmp_path, *args: str) -> dict:
    model = tiny_hf_dir(tmp_path / "model", "qwen2")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "tests/unit/fsdp_checkpoint_worker.py"), str(model),
           str(tmp_path), str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def _same_step(r: dict, how: str) -> None:
    assert r[f"{how}_version"] == 1
    assert r[how]["loss"] == r["ref"]["loss"] and r[how]["grad_norm"] == r["ref"]["grad_norm"], how
    assert r[f"{how}_weight_diff"] == 0.0, how


def test_fsdp2_checkpoints_round_trip(tmp_path):
    r = _run(tmp_path)
    assert r["hf_export_diff"] == 0.0
    assert r["export_on_device_diff"] == 0.0
    _same_step(r, "resume_state")
    _same_step(r, "resume_dcp")
    assert ".metadata" in r["dcp_files"] and len([f for f in r["dcp_files"] if f.endswith(".distcp")]) == 2
    assert (tmp_path / "ckpt" / "hf" / "config.json").is_file()
    assert not list(tmp_path.glob(".ckpt.tmp*"))  # the temporary directory was renamed into place
    assert "metadata.json" in r["dcp_files"]  # the pickle-free metadata load_checkpoint reads
    modes = r["ckpt_modes"]  # readable by others like every other rl_core output (save_pretrained writes 0600)
    assert modes["hf/model.safetensors"] == modes["trainer_state.json"] and len(set(modes.values())) == 1, modes


def test_megatron_tensor_parallel_state_round_trip(tmp_path):
    r = _run(tmp_path, "megatron", "trainer.megatron.tensor_model_parallel_size=2")
    assert r["hf_export_diff"] == 0.0
    assert r["export_on_device_diff"] == 0.0
    _same_step(r, "resume_state")

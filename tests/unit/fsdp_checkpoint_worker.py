"""Run under torchrun by test_fsdp_checkpoint.py: trainer checkpoints round-trip on 2 processes.

`fsdp_checkpoint_worker.py MODEL WORK OUT [BACKEND [FIELD=VALUE ...]]` (BACKEND: fsdp2, the
default, or megatron; megatron has no DCP checkpoint, only the state-dict way back).

Rank 0: one RL step, then a DCP checkpoint, the full optimizer state (`state_dict`, saved
with torch.save and read back with weights_only=True, as run checkpoints do) and an HF
export; a second step gives the reference. Two fresh trainers then resume, one from the
HF export + the optimizer state, one from the DCP checkpoint, and take the same second
step. Rank 0 writes what it saw as JSON (argv[3]).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    model_dir, work, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    from rl_core.algorithms.losses import make_loss
    from rl_core.config import validate_dict
    from rl_core.train import close_trainer, make_trainer, start_trainer_group
    from rl_core.train.check_step import synthetic_chunk

    backend = sys.argv[4] if len(sys.argv) > 4 else "fsdp2"
    from rl_core.config import apply_overrides

    cfg = validate_dict(apply_overrides({"trainer": {"backend": backend, "microbatch_size": 4},
                                         "runtime": {"device": "cpu"}}, sys.argv[5:]))
    if start_trainer_group(cfg):
        return
    loss = make_loss(cfg.loss)
    chunk = synthetic_chunk(96, 10, seed=1)

    def step(trainer) -> dict:
        trainer.begin(loss)
        trainer.train_microbatches(chunk)
        return trainer.finish()

    def diff(a, b) -> float:
        assert sorted(a) == sorted(b)
        return max((a[k] - b[k]).abs().max().item() for k in a)

    t = make_trainer(cfg, model_dir)
    step(t)
    if backend == "fsdp2":
        t.save_checkpoint(work / "ckpt")
    torch.save(t.state_dict(), work / "trainer_state.pt")
    t.save_pretrained(work / "hf")
    w1 = t.export_weights()
    ref = step(t)
    w_ref = t.export_weights()
    result_on_device = diff(t.export_weights(on_device=True), w_ref)  # the broadcast refit's export

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(work / "hf")).state_dict()
    result = {"hf_export_diff": diff({k: v for k, v in hf.items()}, w1), "ref": ref,
              "export_on_device_diff": result_on_device}

    t2 = make_trainer(cfg, work / "hf")  # a new trainer replaces the first on every rank
    t2.load_state_dict(torch.load(work / "trainer_state.pt", weights_only=True))
    result["resume_state_version"] = t2.version
    result["resume_state"] = step(t2)
    result["resume_state_weight_diff"] = diff(t2.export_weights(), w_ref)

    last = t2
    if backend == "fsdp2":
        t3 = last = make_trainer(cfg, model_dir)  # initial weights; the DCP checkpoint brings step 1 back
        t3.load_checkpoint(work / "ckpt")
        result["resume_dcp_version"] = t3.version
        result["resume_dcp"] = step(t3)
        result["resume_dcp_weight_diff"] = diff(t3.export_weights(), w_ref)
        result["dcp_files"] = sorted(p.name for p in (work / "ckpt" / "dcp").iterdir())
        result["ckpt_modes"] = {p.relative_to(work / "ckpt").as_posix(): p.stat().st_mode & 0o777
                                for p in (work / "ckpt").rglob("*") if p.is_file()}
    close_trainer(last)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

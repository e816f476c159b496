"""The rollout spool: one JSON file per RL step with the rollouts that step trained on.

Owns: writing each step's trained groups (token ids, generation logprobs, rewards,
correctness, advantages, versions, staleness, masks; the routed experts of MoE rollouts) atomically to
`<dir>/step_{n:06d}.json`, and dropping records past a resume point; a killed run keeps every
finished step's file. Numbering, as in metrics.jsonl, TensorBoard and the folder names:
`step` is the 1-based RL step (its update makes weight version `step`), `weight_version` the
version the step's update started from (`step - 1`), a group's `epoch` the 1-based pass over
the data and `target_step` the RL step it was drawn for.

Does not own: the HDF5 archive or its inspection (rl_core.archive).

Read more: docs/workflow.md, "The rollout archive".
"""

from __future__ import annotations

import json
from pathlib import Path

from rl_core.fsutil import atomic_write_text
from rl_core.columns import plain
from rl_core.rollout.group import is_correct


def step_record(step: int, weight_version: int, trained) -> dict:
    """The spool record of RL step `step` (1-based; see the module docstring for the numbering)."""
    groups = []
    for t in trained:
        g = t.group
        groups.append({
            "group_id": g.group_id, "prompt_index": g.prompt_index, "epoch": g.epoch + 1,
            "target_step": None if g.target_step is None else g.target_step + 1,
            "start_version": g.start_version, "end_version": g.end_version, "staleness": t.staleness,
            "samples": [{
                "prompt_ids": plain(s.prompt_ids), "completion_ids": plain(s.completion_ids),
                "gen_logprobs": plain(s.gen_logprobs),
                "reward": s.reward, "rewards": s.rewards, "correct": is_correct(s), "advantage": a,
                "finish_reason": s.finish_reason,
                "start_version": s.start_version, "end_version": s.end_version, "env_mask": s.env_mask,
                "token_versions": plain(s.info.get("token_versions")), "completion_mask": s.completion_mask,
                **({k: s.info[k] for k in ("turn_starts", "turn_versions", "segments") if k in s.info}),
                **({"routed_experts": s.routed_experts} if s.routed_experts is not None else {}),
            } for s, a in zip(g.samples, t.advantages)],
        })
    return {"step": step, "weight_version": weight_version, "groups": groups}


class RolloutSpool:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, weight_version: int, trained) -> Path:
        path = self.dir / f"step_{step:06d}.json"
        atomic_write_text(path, json.dumps(step_record(step, weight_version, trained)))
        return path

    def truncate_after(self, step: int) -> None:
        """Remove records of steps after `step`, the RL steps a resume point has done (records a
        run killed after its last checkpoint left; they are trained again)."""
        for p in self.dir.glob("step_*.json"):
            if int(p.stem.split("_")[1]) > step:
                p.unlink()

    def steps(self) -> list[int]:
        return sorted(int(p.stem.split("_")[1]) for p in self.dir.glob("step_*.json"))

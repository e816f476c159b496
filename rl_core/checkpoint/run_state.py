"""Saving and restoring a whole run at an RL-step boundary.

Owns: what goes into a run checkpoint (trainer weights as an HF directory, optimizer
state, RNG states, the controller's quiescent state: versions, counters, dataloader
position, prompts drawn but not dispatched, sampler state, and the ready prompt groups
with their payloads and partial-rollout marks (`Slot.carried`: older checkpoints without it load as never carried); an RL step open between PPO mini-steps, `rl_core.buffer.replay_buffer.OpenStep`, as
JSON plus its batch's tensors) and turning it back into the objects the controller runs with.

The policy's `model/` carries its model card (card.py), listed in the manifest.

Does not own: the directory format and its verification (store.py), or deciding when a
checkpoint is taken (the train pump, at quiescent points: nothing in flight).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rl_core.checkpoint.card import render_card, write_card
from rl_core.checkpoint.store import load_json, load_torch, rng_state, set_rng_state, write_checkpoint
from rl_core.buffer.replay_buffer import OpenStep, Slot, SlotState, TrainedGroup
from rl_core.types import PromptGroup, Sample, TrainChunk
from rl_core.columns import plain


def group_to_json(g: PromptGroup) -> dict[str, Any]:
    if not isinstance(g.samples, list):  # a GroupSamples (column-wise): its Sample records
        g = dataclasses.replace(g, samples=list(g.samples))
    d = dataclasses.asdict(g)
    for s in d["samples"]:  # token ids / logprobs a backend handed over as arrays: JSON lists
        for k in ("prompt_ids", "completion_ids", "gen_logprobs"):
            s[k] = plain(s[k])
        if "token_versions" in s["info"]:
            s["info"]["token_versions"] = plain(s["info"]["token_versions"])
    return d


def group_from_json(d: dict[str, Any]) -> PromptGroup:
    d = dict(d)
    d["samples"] = [Sample(**s) for s in d["samples"]]
    return PromptGroup(**d)


def save_run_checkpoint(path: str | Path, *, trainer, tokenizer, controller_state: dict[str, Any],
                        resolved_config: dict[str, Any], critic=None, held_out: dict[str, Any] | None = None) -> Path:
    """Write a complete run checkpoint atomically (manifest last), with a model card in model/
    (card.py; `held_out`: a validation of this weight version, if one ran)."""
    import torch

    controller_state = dict(controller_state)
    buffer_state = controller_state.pop("buffer")
    open_step: OpenStep | None = controller_state.pop("open_step", None)
    open_json, open_tensors = None, None
    if open_step is not None:  # an RL step checkpointed between its mini-steps
        open_json = {"step": open_step.step, "next_ministep": open_step.next_ministep,
                     # the finished mini-steps' metric sums, so the resumed step reports the same means
                     "metric_sums": open_step.metric_sums, "metric_counts": open_step.metric_counts,
                     "trained": [{"slot": _slot_json(t.slot), "group": group_to_json(t.group),
                                  "advantages": t.advantages, "staleness": t.staleness} for t in open_step.trained]}
        chunk = open_step.chunk
        open_tensors = {k: getattr(chunk, k) for k in chunk.__dataclass_fields__ if getattr(chunk, k) is not None}
        served = open_step.served_weights
    ready = [{**{k: v for k, v in r.items() if k != "group"}, "group": group_to_json(r["group"])}
             for r in buffer_state["ready"]]
    buffer_json = {"capacity": buffer_state["capacity"], "counts": buffer_state["counts"], "ready": ready}
    trainer_state = dict(trainer.state_dict())
    trainer_state["reference_dir"] = getattr(trainer, "reference_dir", None)  # the KL reference (initial policy)

    def fill(tmp: Path) -> None:
        trainer.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(str(tmp / "model"))
        if "model" in resolved_config:  # a run's recipe (callers that checkpoint without one get no card)
            write_card(tmp / "model", render_card(resolved_config, rl_step=trainer_state["version"], held_out=held_out))
        if critic is not None:  # PPO's value model, with its optimizer
            critic.save(tmp / "critic")
        torch.save({"optimizer": trainer_state["optimizer"]}, tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        state = dict(controller_state)
        state["trainer"] = {k: v for k, v in trainer_state.items() if k != "optimizer"}
        if open_json is not None:
            state["open_step"] = open_json
            torch.save(open_tensors, tmp / "open_step.pt")
            if served is not None:  # the weights generation serves (this RL step's starting version)
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in served.items()}, str(tmp / "served_weights.safetensors"))
        (tmp / "controller_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "buffer.json").write_text(json.dumps(buffer_json))
        (tmp / "resolved_config.json").write_text(json.dumps(resolved_config, indent=2))

    meta = {"weight_version": trainer_state["version"], "rl_step": trainer_state["version"],
            "open_step_next_ministep": None if open_step is None else open_step.next_ministep,
            "optimizer_steps": trainer_state.get("optimizer_steps"), "epoch": controller_state.get("epoch")}
    return write_checkpoint(path, fill, meta)


def _slot_json(slot) -> dict[str, Any]:
    return {k: getattr(slot, k) for k in ("group_id", "dispatch_index", "prompt_index", "epoch", "start_version",
                                          "target_step", "end_version", "carried")}


@dataclasses.dataclass
class LoadedCheckpoint:
    path: Path
    manifest: dict[str, Any]
    model_dir: Path
    trainer_state: dict[str, Any]
    controller_state: dict[str, Any]

    @property
    def rl_step(self) -> int:
        return int(self.manifest["rl_step"])


def load_run_checkpoint(path: str | Path, restore_rng: bool = True, verified: bool = False) -> LoadedCheckpoint:
    """Verify every file against the manifest and the state's structure (`resume.check_run_checkpoint`;
    `verified`: the caller just did, skip the hashes), then load the non-weight state (weights load
    from model/)."""
    from rl_core.checkpoint.resume import check_run_checkpoint

    root = Path(path)
    manifest = check_run_checkpoint(root, hashes=not verified)
    state = load_json(root / "controller_state.json")
    buffer_json = load_json(root / "buffer.json")
    state["buffer"] = {"capacity": buffer_json["capacity"], "counts": buffer_json["counts"],
                       "ready": [{**r, "group": group_from_json(r["group"])} for r in buffer_json["ready"]]}
    trainer_state = dict(state.pop("trainer"))
    if "open_step" in state:
        o = state["open_step"]
        tensors = load_torch(root / "open_step.pt")
        served = None
        if (root / "served_weights.safetensors").is_file():
            from safetensors.torch import load_file

            served = load_file(str(root / "served_weights.safetensors"))
        state["open_step"] = OpenStep(
            step=o["step"], next_ministep=o["next_ministep"], chunk=TrainChunk(**tensors),
            served_weights=served, metric_sums=o.get("metric_sums", {}), metric_counts=o.get("metric_counts", {}),
            trained=[TrainedGroup(Slot(**{**t["slot"], "state": SlotState.SELECTED, "group": group_from_json(t["group"])}),
                                  group_from_json(t["group"]), t["advantages"], t["staleness"]) for t in o["trained"]])
    trainer_state["optimizer"] = load_torch(root / "optimizer.pt")["optimizer"]
    if restore_rng:
        set_rng_state(load_torch(root / "rng.pt"))
    return LoadedCheckpoint(root, manifest, root / "model", trainer_state, state)

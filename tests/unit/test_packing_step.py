"""Sequence packing and token-budget microbatches give the padded RL step, in every trainer.

Each run is `rl_core.train.check_step` (two RL steps on a fixed batch of mixed lengths,
streamed as two chunks, logprobs before and after, the exported weights). Against the torch
trainer's padded step, in the cross-backend tolerances of tests/unit/test_fsdp_step.py (loss
and gradient norm 1e-5 relative, logprobs and weights 1e-4 absolute): the torch trainer packed
(reference, chunked and fused logprob paths; a KL term's reference passes; sequence-level
aggregation), with two different token budgets, fsdp2 over 2 processes packed under a token
budget (shares by tokens, a dummy microbatch), megatron packed (1 process, and tensor parallel
2). The FLOPs counted (useful tokens only) are the same packed or not. Router replay (MoE)
replays the same routes packed, and the recipe rules refuse what a backend cannot honour.
"""

from __future__ import annotations

import pytest
import torch

from rl_core.config import validate_dict
from rl_core.config.schema import TrainerConfig
from rl_core.errors import RecipeError
from rl_core.packing import make_train_chunk
from rl_core.train.torch_trainer import TorchTrainer
from rl_core.types import Sample
from tests.helpers.trainers import assert_same_flops, assert_same_step, max_weight_diff, run_check, tiny_hf_dir

REL, ABS = 1e-5, 1e-4
PACKED = "trainer.packing=true"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing_models")
    return {"qwen2": tiny_hf_dir(root / "qwen2", "qwen2"), "llama": tiny_hf_dir(root / "llama", "llama", tied=True)}


def assert_same_run(ref: tuple, got: tuple) -> None:
    (r, w_r), (g, w_g) = ref, got
    assert_same_step(r, g, REL)
    for key in ("logprobs_initial", "logprobs"):
        assert (torch.tensor(r[key]) - torch.tensor(g[key])).abs().max().item() < ABS, key
    assert max_weight_diff(w_r, w_g) < ABS


@pytest.mark.parametrize("sets", [(), ("trainer.logprob_chunk_tokens=5",),
                                  ("loss.kl_coef=0.1", "loss.aggregation=sequence")],
                         ids=["reference", "chunked", "kl-sequence"])
def test_torch_packed_step_equals_padded(models, tmp_path, sets):
    ref = run_check(models["qwen2"], tmp_path, "torch", 1, *sets)
    got = run_check(models["qwen2"], tmp_path, "torch", 1, *sets, PACKED)
    assert_same_run(ref, got)
    assert_same_flops(ref[0], got[0])  # useful tokens only, counted the same way packed or padded
    assert ref[0]["steps"][0]["loss"] != ref[0]["steps"][1]["loss"]  # the first step changed the weights


def test_the_step_does_not_depend_on_the_token_budget(models, tmp_path):
    """Two token budgets packed (a few samples a microbatch; most of a chunk), and one padded,
    give the step of `microbatch_size` consecutive samples."""
    ref = run_check(models["llama"], tmp_path, "torch", 1, "trainer.microbatch_size=4")
    for sets in (("trainer.max_tokens_per_microbatch=16", PACKED), ("trainer.max_tokens_per_microbatch=60", PACKED),
                 ("trainer.max_tokens_per_microbatch=30",)):
        got = run_check(models["llama"], tmp_path, "torch", 1, "trainer.microbatch_size=64", *sets)
        assert_same_run(ref, got)
        assert_same_flops(ref[0], got[0])


def test_two_process_fsdp2_packed_under_a_budget_equals_torch_padded(models, tmp_path):
    """fsdp2 over 2 processes: the chunk's samples shared out by tokens, microbatches cut by the
    budget (one rank runs a dummy when its share is used up), packed; a KL term (reference passes)."""
    sets = ("loss.kl_coef=0.1",)
    ref = run_check(models["qwen2"], tmp_path, "torch", 1, *sets)
    got = run_check(models["qwen2"], tmp_path, "fsdp2", 2, *sets, PACKED, "trainer.max_tokens_per_microbatch=24")
    assert_same_run(ref, got)
    assert_same_flops(ref[0], got[0])


@pytest.mark.parametrize("nproc,sets", [(1, ("trainer.max_tokens_per_microbatch=40",)),
                                        (2, ("trainer.megatron.tensor_model_parallel_size=2",))],
                         ids=["one-process-budget", "tensor-parallel-2"])
def test_megatron_packed_equals_torch_padded(models, tmp_path, nproc, sets):
    ref = run_check(models["qwen2"], tmp_path, "torch", 1)
    got = run_check(models["qwen2"], tmp_path, "megatron", nproc, PACKED, *sets, timeout_s=400)
    assert_same_run(ref, got)
    assert_same_flops(ref[0], got[0])


# --------------------------------------------------------------------------- router replay (MoE)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=64, intermediate_size=32, max_position_embeddings=64, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=None)
    out = tmp_path_factory.mktemp("moe_packing") / "policy"
    MixtralForCausalLM(config).save_pretrained(out)
    return out


def moe_chunk(n: int = 10):
    """Samples with routes that are not the model's own (random experts, some tokens missing): a
    route applied to the wrong token would change the logprobs."""
    g = torch.Generator().manual_seed(5)
    samples = []
    for i in range(n):
        p, c = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        routes = [torch.randperm(4, generator=g)[:2].tolist() + torch.randperm(4, generator=g)[:2].tolist()
                  for _ in range(p + c)]
        routes[1] = []  # a token whose route generation did not record: backfilled by the trainer's router
        samples.append(Sample(torch.randint(1, 64, (p,), generator=g).tolist(),
                              torch.randint(1, 64, (c,), generator=g).tolist(), [-1.0] * c, float(i % 2),
                              "stop", 0, 0, routed_experts=routes))
    return make_train_chunk(samples, [float(i % 3) - 1 for i in range(n)])


def test_router_replay_packed_equals_padded(moe_dir):
    from rl_core.algorithms.losses import make_loss
    from rl_core.config.schema import LossConfig

    chunk = moe_chunk()
    out = {}
    for packing in (False, True):
        trainer = TorchTrainer(moe_dir, TrainerConfig(router_replay={"enabled": True}, microbatch_size=4,
                                                      packing=packing))
        free = TorchTrainer(moe_dir, TrainerConfig(microbatch_size=4, packing=packing))
        lp, own = trainer.logprobs(chunk), free.logprobs(chunk)
        trainer.begin(make_loss(LossConfig()))
        trainer.train_microbatches(chunk)
        out[packing] = (lp, own, trainer.finish())
    real = chunk.loss_mask.bool()
    (lp0, own0, m0), (lp1, own1, m1) = out[False], out[True]
    assert (lp0 - lp1)[real].abs().max().item() < 1e-5
    assert (lp1 - own1)[real].abs().max().item() > 1e-2  # the replayed routes really changed the forward
    assert abs(m0["loss"] - m1["loss"]) <= REL * max(1.0, abs(m0["loss"]))
    assert abs(m0["grad_norm"] - m1["grad_norm"]) <= REL * max(1.0, abs(m0["grad_norm"]))
    assert m0["router_replay_backfill_frac"] == m1["router_replay_backfill_frac"] > 0


# --------------------------------------------------------------------------- what a backend cannot honour


def test_recipe_rules_for_packing(tmp_path):
    with pytest.raises(RecipeError, match="trainer.packing"):
        validate_dict({"trainer": {"backend": "megatron", "packing": True, "megatron": {"attention": "local"}}})
    validate_dict({"trainer": {"backend": "megatron", "packing": True, "max_tokens_per_microbatch": 4096}})
    with pytest.raises(Exception, match="max_tokens_per_microbatch"):
        validate_dict({"trainer": {"max_tokens_per_microbatch": -1}})
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(RecipeError, match="trainer.packing.*gpt2"):
        TorchTrainer(tmp_path / "gpt2", TrainerConfig(packing=True))

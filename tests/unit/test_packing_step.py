"""Sequence packing and token-budget microbatches give the padded RL step, in every trainer.

Each run is `rl_core.train.check_step` (two RL steps on a fixed batch of ragged samples, right
padded, streamed as two chunks; logprobs before and after; the exported weights). A packed run
against the same backend's padded run (`trainer.packing: off`), in the tolerances of the
cross-backend tests (tests/unit/test_fsdp_step.py: loss and gradient norm 1e-5 relative,
logprobs and weights 1e-4 absolute), the FLOPs counted (useful tokens) identical: the torch
trainer (reference, chunked logprob paths; a KL term's reference passes; sequence-level
aggregation) and with several token budgets; fsdp2 over 2 gloo processes under a budget (shares
by tokens, a dummy microbatch); megatron in 1 process under a budget and at tensor parallel 2.
The critic's step, and router replay (MoE), packed equal padded. Broken layouts (no document
mask, boundaries or positions one token late) fail the same comparison. Recipe rules: `on`
where a model or backend is not served is an error, `auto` falls back to padding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_core.config import validate_dict
from rl_core.config.schema import CriticConfig, TrainerConfig
from rl_core.errors import RecipeError
from rl_core.packing import PackedRows, make_train_chunk
from rl_core.train import varlen
from rl_core.train.check_step import synthetic_chunk
from rl_core.train.critic import Critic
from rl_core.train.torch_trainer import TorchTrainer
from rl_core.types import Sample
from tests.helpers.trainers import VOCAB, assert_same_flops, assert_same_step, max_weight_diff, run_check, tiny_hf_dir

REL, ABS = 1e-5, 1e-4
PACKED, PADDED = "trainer.packing=on", "trainer.packing=off"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing_models")
    return {"qwen2": tiny_hf_dir(root / "qwen2", "qwen2"), "llama": tiny_hf_dir(root / "llama", "llama", tied=True)}


def run_diff(ref: tuple, got: tuple) -> float:
    """The largest difference of two runs' logprobs (before and after training) and weights."""
    (r, w_r), (g, w_g) = ref, got
    lp = max((torch.tensor(r[k]) - torch.tensor(g[k])).abs().max().item() for k in ("logprobs_initial", "logprobs"))
    return max(lp, max_weight_diff(w_r, w_g))


def assert_same_run(ref: tuple, got: tuple) -> None:
    assert_same_step(ref[0], got[0], REL)
    assert run_diff(ref, got) < ABS
    assert_same_flops(ref[0], got[0])  # useful tokens only, counted the same way packed or padded


@pytest.fixture
def attention_calls(monkeypatch):
    """How often the packed attention ran (in this process): the packed path is the one measured."""
    calls = []
    real = varlen.varlen_attention

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(varlen, "varlen_attention", counted)
    return calls


@pytest.mark.parametrize("sets", [(), ("trainer.logprob_chunk_tokens=5",),
                                  ("loss.kl_coef=0.1", "loss.aggregation=sequence")],
                         ids=["reference", "chunked", "kl-sequence"])
def test_torch_packed_step_equals_padded(models, tmp_path, sets, attention_calls):
    ref = run_check(models["qwen2"], tmp_path, "torch", 1, *sets, PADDED)
    assert not attention_calls
    got = run_check(models["qwen2"], tmp_path, "torch", 1, *sets, PACKED)
    assert attention_calls  # 2 layers x every forward, over packed rows
    assert_same_run(ref, got)
    assert ref[0]["steps"][0]["loss"] != ref[0]["steps"][1]["loss"]  # the first step changed the weights


def test_the_step_does_not_depend_on_the_token_budget(models, tmp_path):
    """Two token budgets packed (a few samples a microbatch; most of a chunk), one padded, and
    packing by default (`auto`), give the padded step of `microbatch_size` consecutive samples."""
    ref = run_check(models["llama"], tmp_path, "torch", 1, "trainer.microbatch_size=4", PADDED)
    for sets in (("trainer.max_tokens_per_microbatch=16", PACKED), ("trainer.max_tokens_per_microbatch=60", PACKED),
                 ("trainer.max_tokens_per_microbatch=30", PADDED), ()):
        got = run_check(models["llama"], tmp_path, "torch", 1, "trainer.microbatch_size=64", *sets)
        assert_same_run(ref, got)


def _shifted_starts(rows: PackedRows) -> torch.Tensor:
    """The sequences' first packed tokens, each but the first one token late."""
    starts = rows.cu_seqlens[:-1].long().clone()
    starts[1:] += 1
    return starts


def _positions_from(rows: PackedRows, starts: torch.Tensor) -> torch.Tensor:
    tok = torch.arange(rows.num_tokens)
    return tok - starts[torch.searchsorted(starts, tok, right=True) - 1]


BROKEN = {  # a wrong packed layout -> is the packed step still the padded one?
    # every token attends to all earlier tokens of the row, other samples' included (no document mask)
    "one document": (False, lambda r: dataclasses.replace(
        r, cu_seqlens=torch.tensor([0, r.num_tokens], dtype=torch.int32), max_len=r.num_tokens)),
    # the document boundaries one token late: a sample's first token attends into the one before
    "boundaries one token late": (False, lambda r: dataclasses.replace(
        r, cu_seqlens=torch.cat([r.cu_seqlens[:1], r.cu_seqlens[1:-1] + 1, r.cu_seqlens[-1:]]),
        max_len=r.max_len + 1)),
    # positions restarting one token late: a sample's first token keeps counting from the one before
    "positions one token late": (False, lambda r: dataclasses.replace(
        r, position_ids=_positions_from(r, _shifted_starts(r)))),
    # positions counted across the whole row (0..N-1), boundaries right: each sample's positions are
    # shifted by a constant, which rotary embeddings cannot see (their scores depend on position
    # differences only: Su et al. 2021, RoFormer, arXiv:2104.09864, section 3.4.2), so the step is the
    # padded one to rounding. Every model packing serves uses rotary embeddings.
    "positions counted across the row": (True, lambda r: dataclasses.replace(r, position_ids=torch.arange(
        r.num_tokens))),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_wrong_packed_layout_fails_the_comparison(models, tmp_path, monkeypatch, name):
    """The tests above can fail: the same comparison with one part of the layout broken."""
    same, broken = BROKEN[name]
    ref = run_check(models["qwen2"], tmp_path, "torch", 1, PADDED)
    real = PackedRows.of.__func__
    monkeypatch.setattr(PackedRows, "of", classmethod(lambda cls, mask: broken(real(cls, mask))))
    got = run_check(models["qwen2"], tmp_path, "torch", 1, PACKED)
    diff = run_diff(ref, got)
    if same:
        assert diff < ABS, diff
    else:
        assert diff > 10 * ABS, f"{name}: the broken layout gave the padded step (largest difference {diff:g})"


def test_fsdp2_packed_under_a_budget_equals_padded(models, tmp_path):
    """fsdp2 over 2 gloo processes: the chunk's samples shared out by tokens, microbatches cut by
    the budget (a rank whose share is used up runs a dummy), packed; a KL term (reference passes);
    against fsdp2's padded step of contiguous blocks."""
    sets = ("loss.kl_coef=0.1",)
    ref = run_check(models["qwen2"], tmp_path, "fsdp2", 2, *sets, PADDED)
    got = run_check(models["qwen2"], tmp_path, "fsdp2", 2, *sets, PACKED, "trainer.max_tokens_per_microbatch=24")
    assert_same_run(ref, got)


TP2 = "trainer.megatron.tensor_model_parallel_size=2"


@pytest.mark.parametrize("nproc,both,packed", [(1, (), ("trainer.max_tokens_per_microbatch=40",)), (2, (TP2,), ())],
                         ids=["one-process-budget", "tensor-parallel-2"])
def test_megatron_packed_equals_padded(models, tmp_path, nproc, both, packed):
    """Megatron's THD rows (PackedSeqParams, the SDPA core attention over them, rotary at each
    token's position) against its padded [b, t] step: in one process under a token budget, and
    at tensor parallel 2."""
    ref = run_check(models["qwen2"], tmp_path, "megatron", nproc, *both, PADDED, timeout_s=400)
    got = run_check(models["qwen2"], tmp_path, "megatron", nproc, *both, *packed, PACKED, timeout_s=400)
    assert_same_run(ref, got)


def test_critic_step_packed_equals_padded(models):
    """The critic's values and two steps (loss, gradient norm, weights after), packed and under a
    token budget, against the padded critic: the values the GAE and the value loss read are the same."""
    chunk = synthetic_chunk(VOCAB, 12, 0)
    g = torch.Generator().manual_seed(7)
    chunk.values = torch.randn(chunk.input_ids.shape, generator=g) * chunk.attention_mask
    chunk.returns = torch.randn(chunk.input_ids.shape, generator=g) * chunk.attention_mask
    runs = {}
    for name, kwargs in {"padded": dict(packing="off"), "packed": dict(packing="on"),
                         "packed-budget": dict(packing="on", max_tokens_per_microbatch=20)}.items():
        torch.manual_seed(0)  # the same fresh head
        critic = Critic(models["qwen2"], CriticConfig(enabled=True, microbatch_size=4), **kwargs)
        torch.nn.init.normal_(critic.model.head.weight, 0, 0.5)  # values differ by token
        assert critic.packed == (kwargs["packing"] == "on")
        steps = []
        for _ in range(2):
            critic.begin()
            critic.train_microbatches(chunk.slice(0, 6))
            critic.train_microbatches(chunk.slice(6, 12))
            steps.append(critic.finish())
        values, final = critic.values(chunk, with_final=True)
        runs[name] = (steps, values, final, {k: v.detach().clone() for k, v in critic.model.state_dict().items()})
    steps0, v0, f0, w0 = runs["padded"]
    real = chunk.attention_mask.bool()
    for name in ("packed", "packed-budget"):
        steps, v, f, w = runs[name]
        assert_same_step({"steps": [dict(s, num_tokens=0) for s in steps0]},
                         {"steps": [dict(s, num_tokens=0) for s in steps]}, REL)
        assert (v0 - v)[real].abs().max().item() < ABS and (f0 - f).abs().max().item() < ABS, name
        assert max_weight_diff(w0, w) < ABS, name
    assert steps0[0]["loss"] != steps0[1]["loss"]


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
    for packing in ("off", "on"):
        trainer = TorchTrainer(moe_dir, TrainerConfig(router_replay={"enabled": True}, microbatch_size=4,
                                                      packing=packing))
        free = TorchTrainer(moe_dir, TrainerConfig(microbatch_size=4, packing=packing))
        assert trainer.packed == (packing == "on")
        lp, own = trainer.logprobs(chunk), free.logprobs(chunk)
        trainer.begin(make_loss(LossConfig()))
        trainer.train_microbatches(chunk)
        out[packing] = (lp, own, trainer.finish())
    real = chunk.loss_mask.bool()
    (lp0, own0, m0), (lp1, own1, m1) = out["off"], out["on"]
    assert (lp0 - lp1)[real].abs().max().item() < 1e-5
    assert (lp1 - own1)[real].abs().max().item() > 1e-2  # the replayed routes really changed the forward
    assert abs(m0["loss"] - m1["loss"]) <= REL * max(1.0, abs(m0["loss"]))
    assert abs(m0["grad_norm"] - m1["grad_norm"]) <= REL * max(1.0, abs(m0["grad_norm"]))
    assert m0["router_replay_backfill_frac"] == m1["router_replay_backfill_frac"] > 0


# --------------------------------------------------------------------------- what a backend cannot honour


def test_recipe_rules_for_packing(tmp_path):
    assert TrainerConfig().packing == "auto"
    with pytest.raises(RecipeError, match="trainer.packing"):
        validate_dict({"trainer": {"backend": "megatron", "packing": "on", "megatron": {"attention": "local"}}})
    validate_dict({"trainer": {"backend": "megatron", "megatron": {"attention": "local"}}})  # auto: padded there
    validate_dict({"trainer": {"backend": "megatron", "packing": "on", "max_tokens_per_microbatch": 4096}})
    with pytest.raises(Exception, match="max_tokens_per_microbatch"):
        validate_dict({"trainer": {"max_tokens_per_microbatch": -1}})
    with pytest.raises(Exception, match="packing"):
        validate_dict({"trainer": {"packing": "yes"}})
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(RecipeError, match="trainer.packing.*gpt2"):
        TorchTrainer(tmp_path / "gpt2", TrainerConfig(packing="on"))
    assert not TorchTrainer(tmp_path / "gpt2", TrainerConfig()).packed  # auto: padded for a model not served
    windowed = type("C", (), {"model_type": "mistral", "sliding_window": 16})()
    assert not varlen.resolve_packing("auto", windowed)
    with pytest.raises(RecipeError, match="sliding window"):
        varlen.resolve_packing("on", windowed, "critic model")

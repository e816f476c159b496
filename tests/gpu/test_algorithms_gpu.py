"""The algorithm library and the critic on CUDA (marked `gpu`, skipped without a GPU).

- every loss variant gives the same value, metrics and gradient on CUDA as on the CPU;
- a policy-loss call makes at most one device-to-host sync (all metrics and the
  normaliser leave the GPU in one transfer);
- `estimate_advantages` (GAE with critic values, KL in the reward) agrees with the CPU;
- the critic trains on CUDA in bf16 and its fp32 values match the CPU's;
- the peak FLOP/s of the device is known, so MFU can be reported.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rl_core.algorithms.estimate import estimate_advantages
from rl_core.algorithms.flops import peak_flops_per_s
from rl_core.algorithms.losses import make_loss
from rl_core.config.schema import AdvantageConfig, CriticConfig, LossConfig
from rl_core.train.critic import Critic
from rl_core.types import TrainChunk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LOSSES = {
    "default": {},
    "dual_clip_kl": {"dual_clip_c": 3.0, "kl_coef": 0.05, "kl_estimator": "k3"},
    "gspo_icepop": {"ratio_level": "sequence", "aggregation": "sequence",
                    "importance_sampling": {"truncation": "icepop", "min_ratio": 0.5, "max_ratio": 2.0}},
    "seq_mask_tis_threshold": {"importance_sampling": {"truncation": "seq-mask-tis", "level": "sequence",
                                                       "min_ratio": 0.5, "max_seq_mult_prob_error": 1.3}},
    "reinforce": {"type": "reinforce"},
}


def random_chunk(B=16, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(B, T, generator=g) > 0.2).float()
    loss_mask[:, :4] = 0
    loss_mask[0] = 0  # one all-masked row
    lp = -torch.rand(B, T, generator=g) * 3
    return TrainChunk(
        input_ids=torch.randint(0, 50, (B, T), generator=g), attention_mask=torch.ones(B, T, dtype=torch.long),
        loss_mask=loss_mask, gen_logprobs=lp + 0.3 * torch.randn(B, T, generator=g),
        advantages=torch.randn(B, 1, generator=g).expand(B, T).contiguous(),
        sample_mask=(torch.rand(B, generator=g) > 0.1).float(), start_versions=torch.zeros(B, dtype=torch.long),
        ref_logprobs=lp + 0.2 * torch.randn(B, T, generator=g), prev_logprobs=lp + 0.1 * torch.randn(B, T, generator=g),
        returns=torch.randn(B, T, generator=g), values=torch.randn(B, T, generator=g)), lp


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_matches_cpu(name):
    chunk, lp = random_chunk()
    loss = make_loss(LossConfig(**LOSSES[name]))
    out = {}
    for dev in ("cpu", "cuda"):
        x = lp.clone().to(dev).requires_grad_()
        o = loss(x, chunk.to(dev))
        o.loss_sum.backward()
        out[dev] = (o, x.grad.cpu())
    (c, gc), (g, gg) = out["cpu"], out["cuda"]
    assert c.normalizer == g.normalizer
    assert g.loss_sum.item() == pytest.approx(c.loss_sum.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(gc, gg, atol=1e-6)
    assert c.metrics.keys() == g.metrics.keys()
    for k in c.metrics:
        assert g.metrics[k] == pytest.approx(c.metrics[k], rel=1e-5, abs=1e-6), k


def test_policy_loss_makes_at_most_one_device_sync():
    chunk, lp = random_chunk()
    chunk = chunk.to("cuda")
    x = lp.cuda().requires_grad_()
    loss = make_loss(LossConfig(kl_coef=0.05, dual_clip_c=3.0,
                                importance_sampling={"max_seq_mult_prob_error": 1.3}))
    loss(x, chunk)  # warm-up (lazy CUDA init may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss(x, chunk)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]


def test_estimate_advantages_matches_cpu():
    chunk, _ = random_chunk(B=8)
    rewards = torch.rand(8).tolist()
    for cfg in (AdvantageConfig(estimator="gae", lam=0.9, value_lam=1.0, kl_in_reward_coef=0.1,
                                kl_in_reward_level="token"),
                AdvantageConfig(estimator="reinforce_pp", kl_in_reward_coef=0.1, kl_in_reward_level="token"),
                AdvantageConfig(kl_in_reward_coef=0.1)):
        res = {}
        for dev in ("cpu", "cuda"):
            c = chunk.to(dev)
            res[dev] = estimate_advantages(cfg, c, rewards, [4, 4], ref_logprobs=c.ref_logprobs, values=c.values)
        assert torch.allclose(res["cpu"].advantages, res["cuda"].advantages.cpu(), atol=1e-5)
        if res["cpu"].returns is not None:
            assert torch.allclose(res["cpu"].returns, res["cuda"].returns.cpu(), atol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("critic_gpu")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(d))
    return d


def critic_chunk():
    g = torch.Generator().manual_seed(3)
    B, T = 8, 16
    loss_mask = torch.zeros(B, T)
    loss_mask[:, 6:] = 1
    returns = torch.linspace(-1, 1, B)[:, None].expand(B, T) * loss_mask
    return TrainChunk(input_ids=torch.randint(1, 64, (B, T), generator=g), attention_mask=torch.ones(B, T, dtype=torch.long),
                      loss_mask=loss_mask, gen_logprobs=torch.zeros(B, T), advantages=torch.zeros(B, T),
                      sample_mask=torch.ones(B), start_versions=torch.zeros(B, dtype=torch.long), returns=returns)


def test_critic_on_cuda_matches_cpu_and_trains_in_bf16(model_dir):
    chunk = critic_chunk()
    cpu = Critic(model_dir, CriticConfig(enabled=True))
    gpu = Critic(model_dir, CriticConfig(enabled=True), device="cuda")
    # the same head on both devices: drawn once on the CPU (CPU and CUDA RNG streams differ)
    head = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5
            for n, p in cpu.model.head.named_parameters()}
    for c in (cpu, gpu):
        with torch.no_grad():
            for n, p in c.model.head.named_parameters():
                p.copy_(head[n])
    assert torch.allclose(cpu.values(chunk), gpu.values(chunk), atol=1e-4)
    bf16 = Critic(model_dir, CriticConfig(enabled=True, lr=3e-3, value_clip_eps=None), device="cuda", dtype="bfloat16")
    first = last = None
    for _ in range(20):
        bf16.begin()
        bf16.train_microbatches(chunk)
        m = bf16.finish()
        first = m["value_loss"] if first is None else first
        last = m["value_loss"]
    assert last < 0.5 * first, (first, last)


def test_peak_flops_known_for_this_gpu():
    name = torch.cuda.get_device_name()
    if not any(k in name for k in ("H100", "H200", "A100")):
        pytest.skip(f"no peak FLOP/s entry for {name}")
    assert peak_flops_per_s() is not None

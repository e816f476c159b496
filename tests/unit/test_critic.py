"""The PPO critic: the clipped value loss by hand, and a real tiny value model behind the split step API."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rl_core.algorithms.value_loss import ClippedValueLoss, clipped_value_loss
from rl_core.config.schema import CriticConfig
from rl_core.train.critic import Critic
from rl_core.types import TrainChunk


def test_clipped_value_loss_by_hand():
    # token 1: (1 - 0)^2 = 1 vs clipped 0.5 + 0.2 = 0.7 -> 0.49 ; max 1 -> 0.5
    # token 2: (0.5 - 1)^2 = 0.25 both ways -> 0.125
    # token 3: (0.1 - 0)^2 = 0.01 vs clipped 0.5 - 0.2 = 0.3 -> 0.09 (clipped branch) -> 0.045
    v = torch.tensor([[7.0, 1.0, 0.5, 0.1]], requires_grad=True)
    old = torch.tensor([[0.0, 0.5, 0.5, 0.5]])
    ret = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    out = clipped_value_loss(v, old, ret, mask, 0.2)
    assert (out.loss_sum.item(), out.normalizer) == (pytest.approx(0.67), 3.0)
    assert out.metrics["value_clip_frac"] == (1.0, 3.0)
    out.loss_sum.backward()
    # d/dV: token 1 -> V - R = 1 ; token 2 -> -0.5 ; token 3 -> clipped branch, V outside the clip: 0
    assert torch.allclose(v.grad, torch.tensor([[0.0, 1.0, -0.5, 0.0]]))
    plain = clipped_value_loss(v.detach(), None, ret, mask, None)
    assert plain.loss_sum.item() == pytest.approx(0.5 + 0.125 + 0.005)
    with pytest.raises(ValueError, match="chunk.values"):
        clipped_value_loss(v, None, ret, mask, 0.2)


def test_all_masked_value_loss_is_empty():
    out = clipped_value_loss(torch.ones(2, 2), torch.ones(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), 0.2)
    assert (out.loss_sum.item(), out.normalizer) == (0.0, 0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("critic_base")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(d))
    return d


def make_chunk(returns_by_row):
    g = torch.Generator().manual_seed(1)
    B, T = len(returns_by_row), 8
    ids = torch.randint(1, 32, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[0, 6:] = 0  # one padded row
    loss_mask = torch.zeros(B, T)
    loss_mask[:, 3:] = 1.0
    loss_mask = loss_mask * attn
    returns = torch.tensor(returns_by_row, dtype=torch.float32)[:, None].expand(B, T) * loss_mask
    return TrainChunk(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, gen_logprobs=torch.zeros(B, T),
                      advantages=torch.zeros(B, T), sample_mask=torch.ones(B),
                      start_versions=torch.zeros(B, dtype=torch.long), returns=returns)


def value_loss_of(critic, chunk):
    with torch.no_grad():
        out = ClippedValueLoss(None)(critic.values(chunk), chunk)
    return out.loss_sum.item() / out.normalizer


def test_a_few_critic_steps_reduce_the_value_loss(model_dir):
    critic = Critic(model_dir, CriticConfig(enabled=True, lr=3e-3, microbatch_size=2))
    chunk = make_chunk([1.0, 0.0, 0.5, -0.5])
    v0 = critic.values(chunk)
    assert v0.shape == (4, 8) and v0.abs().max().item() == 0.0  # zero-initialised head
    start = value_loss_of(critic, chunk)
    # 0.5 * mean R^2 over the valid tokens: row 0 has 3 (padding), the others 5
    assert start == pytest.approx(0.5 * (3 * 1.0 + 5 * 0.0 + 5 * 0.25 + 5 * 0.25) / 18, rel=1e-6)
    for _ in range(30):
        chunk.values = critic.values(chunk)  # V_old for value clipping, as at advantage time
        critic.begin()
        critic.train_microbatches(chunk)
        m = critic.finish()
        assert m["skipped_update"] == 0.0 and "value_clip_frac" in m
    end = value_loss_of(critic, chunk)
    assert end < 0.1 * start, (start, end)
    assert critic.version == 30 and critic.optimizer_steps == 30
    critic.begin()
    critic.train_microbatches(chunk)
    critic.finish(advance_version=False)  # a PPO mini-step inside an RL step
    assert critic.version == 30 and critic.optimizer_steps == 31


def test_values_are_causal_and_aligned_like_logprobs(model_dir):
    critic = Critic(model_dir, CriticConfig(enabled=True))
    torch.nn.init.normal_(critic.model.head.weight, std=1.0)
    chunk = make_chunk([0.0, 0.0, 0.0, 0.0])
    v = critic.values(chunk)
    assert v[:, 0].abs().max().item() == 0.0  # position 0 has no prefix
    changed = make_chunk([0.0, 0.0, 0.0, 0.0])
    changed.input_ids[:, 5] = (changed.input_ids[:, 5] % 31) + 1
    v2 = critic.values(changed)
    # token 5 only informs V(s_6) onwards: values up to position 5 are unchanged
    assert torch.allclose(v[1:, :6], v2[1:, :6], atol=1e-6) and not torch.allclose(v[1:, 6:], v2[1:, 6:])
    assert critic.model.training  # values() restores the train mode


def test_split_step_guards_and_abort(model_dir):
    critic = Critic(model_dir, CriticConfig(enabled=True))
    chunk = make_chunk([1.0, 0.0, 1.0, 0.0])
    chunk.values = critic.values(chunk)
    with pytest.raises(RuntimeError, match="without begin"):
        critic.train_microbatches(chunk)
    critic.begin()
    with pytest.raises(RuntimeError, match="already|open"):
        critic.begin()
    critic.train_microbatches(chunk)
    before = [p.detach().clone() for p in critic.model.parameters()]
    critic.abort()
    assert all(p.grad is None for p in critic.model.parameters())
    with pytest.raises(RuntimeError, match="without begin"):
        critic.finish()
    assert all(torch.equal(a, b) for a, b in zip(before, critic.model.parameters()))
    no_returns = make_chunk([1.0, 0.0, 1.0, 0.0])
    no_returns.returns = None
    critic.begin()
    with pytest.raises(ValueError, match="returns"):
        critic.train_microbatches(no_returns)
    critic.abort()
    # an all-masked chunk trains nothing: the step is skipped, not an error
    empty = make_chunk([1.0, 0.0, 1.0, 0.0])
    empty.values = chunk.values
    empty.sample_mask = torch.zeros(4)
    critic.begin()
    critic.train_microbatches(empty)
    assert critic.finish()["skipped_update"] == 1.0


def test_save_and_load_round_trip(model_dir, tmp_path):
    cfg = CriticConfig(enabled=True, lr=1e-2, value_clip_eps=None)
    critic = Critic(model_dir, cfg)
    chunk = make_chunk([1.0, 0.0, 0.5, -0.5])
    for _ in range(2):
        critic.begin()
        critic.train_microbatches(chunk)
        critic.finish()
    saved = critic.save(tmp_path / "critic")
    assert {"config.json", "model.safetensors", "value_head.safetensors", "critic_state.pt", "critic.json"} <= {
        p.name for p in saved.iterdir()}
    again = Critic(saved, cfg)
    assert torch.allclose(critic.values(chunk), again.values(chunk), atol=1e-6)
    again.load_state(saved)
    assert (again.version, again.optimizer_steps) == (2, 2)
    # the restored optimizer continues exactly like the original
    for c in (critic, again):
        c.begin()
        c.train_microbatches(chunk)
        c.finish()
    assert torch.allclose(critic.values(chunk), again.values(chunk), atol=1e-6)
    bare = critic.save(tmp_path / "bare", with_optimizer=False)
    with pytest.raises(FileNotFoundError, match="without optimizer"):
        Critic(bare, cfg).load_state(bare)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="critic.model_path"):
        Critic(tmp_path, CriticConfig(enabled=True))


def test_final_value_is_the_value_after_the_last_token(model_dir):
    """`values(chunk, with_final=True)`: V after each sample's last real token, i.e. the value the
    next position would get (the bootstrap value of a truncated completion)."""
    critic = Critic(model_dir, CriticConfig(enabled=True, microbatch_size=3))
    torch.nn.init.normal_(critic.model.head.weight, std=1.0)
    chunk = make_chunk([0.0, 0.0, 0.0, 0.0])  # row 0 has 6 real tokens, the others 8
    v, final = critic.values(chunk, with_final=True)
    assert torch.equal(v, critic.values(chunk)) and final.shape == (4,)
    # row 0 is padded: position 6 (a pad) already holds V after token 5, from the same hidden state
    assert final[0].item() == pytest.approx(v[0, 6].item(), abs=1e-6)
    # full rows: append one token; its position's value is V after the old last token
    longer = make_chunk([0.0, 0.0, 0.0, 0.0])
    for name in ("input_ids", "attention_mask", "loss_mask", "gen_logprobs", "advantages", "returns"):
        t = getattr(longer, name)
        setattr(longer, name, torch.cat([t, t[:, -1:]], dim=1))
    longer.attention_mask[0, 6:] = 0
    v_long = critic.values(longer)
    assert torch.allclose(final[1:], v_long[1:, 8], atol=1e-5)
    assert not torch.allclose(final[1:], v[1:, 7], atol=1e-3)  # not the value before the last token

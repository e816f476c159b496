"""The packed layout, the microbatch plans and the variable-length attention, on their own.

- `PackedRows`: the real tokens end to end, positions restarting per row, offsets, and
  `unpack` as the inverse of `pack` (zeros at the padding, gradients back to the packed tokens);
- `microbatch_rows`: every row once, within the sample and token budgets (packed: sum of
  lengths; padded: rows x the longest), longest first; `split_rows` balances tokens;
- `varlen_attention`'s CPU path (`padded`) equals causal attention of each sequence alone
  (float64, grouped-query heads), with and without padding, and its gradients too;
- a packed forward of an HF model (`token_logprobs(packed=...)`, reference, chunked and fused
  paths; critic values) equals the padded one, so does the router's replay of routes.
"""

from __future__ import annotations

import pytest
import torch

from rl_core.packing import PackedRows, microbatch_rows, select_rows, split_rows
from rl_core.train import varlen
from rl_core.train.logprobs import token_logprobs
from rl_core.types import TrainChunk
from tests.helpers.trainers import tiny_hf_dir


def ragged_mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


def test_packed_rows_pack_and_unpack():
    mask = ragged_mask([3, 1, 4, 2], 6)
    rows = PackedRows.of(mask)
    assert rows.lengths == [3, 1, 4, 2] and rows.width == 6 and rows.max_len == 4 and rows.num_tokens == 10
    assert rows.cu_seqlens.tolist() == [0, 3, 4, 8, 10] and rows.cu_seqlens.dtype == torch.int32
    assert rows.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1]
    ids = torch.arange(24).view(4, 6)
    assert rows.pack(ids).tolist() == [0, 1, 2, 6, 12, 13, 14, 15, 18, 19]
    x = torch.randn(10, 3, requires_grad=True)
    back = rows.unpack(x)
    assert back.shape == (4, 6, 3)
    assert torch.equal(rows.pack(back), x) and back[mask == 0].abs().sum() == 0
    (back * torch.arange(72.0).view(4, 6, 3)).sum().backward()
    assert torch.equal(x.grad, rows.pack(torch.arange(72.0).view(4, 6, 3)))


def test_packed_rows_skip_empty_rows_in_the_offsets():
    rows = PackedRows.of(ragged_mask([2, 0, 3], 4))
    assert rows.cu_seqlens.tolist() == [0, 2, 5] and rows.num_tokens == 5


def test_microbatch_rows_without_a_budget_are_consecutive_runs():
    assert microbatch_rows([5, 1, 2, 7, 3], 2) == [range(0, 2), range(2, 4), range(4, 5)]


@pytest.mark.parametrize("packed", [True, False])
def test_microbatch_rows_respect_the_budgets(packed):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (200,), generator=g).tolist() + [150]  # one row over the budget
    plan = microbatch_rows(lengths, 16, 120, packed)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        assert mb == sorted(mb) and len(mb) <= 16
        cost = sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb)
        assert cost <= 120 or len(mb) == 1
    assert plan[0] == [200]  # longest first, alone
    firsts = [max(lengths[i] for i in mb) for mb in plan]
    assert firsts == sorted(firsts, reverse=True)


def test_split_rows_balances_tokens():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 500, (64,), generator=g).tolist()
    shares = split_rows(lengths, 4)
    assert sorted(i for s in shares for i in s) == list(range(64))
    sums = [sum(lengths[i] for i in s) for s in shares]
    assert max(sums) - min(sums) <= max(lengths)


def reference_attention(q, k, v, lengths):
    """Each sequence alone: [L, H, D] causal attention, key/value heads repeated for GQA."""
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lengths", [[5, 1, 7, 3], [4, 4, 4]])  # ragged, and the equal-length reshape
def test_padded_path_is_causal_attention_per_sequence(lengths):
    g = torch.Generator().manual_seed(2)
    n = sum(lengths)
    q = torch.randn(n, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    rows = PackedRows.of(ragged_mask(lengths))
    assert varlen.attention_path(q) == "padded"
    got = varlen.varlen_attention(q, k, v, rows.cu_seqlens, rows.max_len)
    want = reference_attention(q, k, v, lengths)
    assert (got - want).abs().max().item() < 1e-12
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    wants = torch.autograd.grad((want * w).sum(), (q, k, v))
    assert max((a - b).abs().max().item() for a, b in zip(grads, wants)) < 1e-12


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_packed_model_still_takes_unpacked_calls(tmp_path, arch):
    """Outside the trainers' packed forwards (a test reading routes, a user's own call) a packed
    model gives the padded model's outputs at every real token: right- and left-padded rows with
    their mask, and one row packed the transformers way (positions restarting at 0, no mask)."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_hf_dir(tmp_path / "m", arch))
    packed = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    varlen.use_packed_attention(packed)
    ids, mask = ragged_batch([6, 2, 9, 4])
    right = ((plain(input_ids=ids, attention_mask=mask).logits - packed(input_ids=ids, attention_mask=mask).logits)
             [mask.bool()].abs().max())
    left_ids, left_mask = ids.flip(1), mask.flip(1)  # the same rows left-padded, positions from the mask
    pos = (left_mask.cumsum(1) - 1).clamp(min=0)
    a = plain(input_ids=left_ids, attention_mask=left_mask, position_ids=pos).logits
    b = packed(input_ids=left_ids, attention_mask=left_mask, position_ids=pos).logits
    left = (a - b)[left_mask.bool()].abs().max()
    rows = PackedRows.of(mask)
    one_row = packed(input_ids=rows.pack(ids)[None], position_ids=rows.position_ids[None]).logits[0]
    alone = plain(input_ids=ids, attention_mask=mask).logits
    hf_packed = (rows.unpack(one_row) - alone)[mask.bool()].abs().max()
    assert max(right, left, hf_packed).item() < 1e-5
    assert (packed(input_ids=ids[:1, :6]).logits - plain(input_ids=ids[:1, :6]).logits).abs().max() < 1e-5


def test_packing_unsupported_model_type():
    assert varlen.packing_unsupported_reason(type("C", (), {"model_type": "qwen2"})()) is None
    assert "gpt2" in varlen.packing_unsupported_reason(type("C", (), {"model_type": "gpt2"})())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("packed_models")
    out = {}
    for arch in ("qwen2", "llama"):
        padded = AutoModelForCausalLM.from_pretrained(tiny_hf_dir(root / arch, arch, tied=arch == "llama"))
        packed = AutoModelForCausalLM.from_pretrained(root / arch)
        varlen.use_packed_attention(packed)
        out[arch] = (padded, packed)
    return out


def ragged_batch(lengths: list[int], vocab: int = 96, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = ragged_mask(lengths)
    return torch.randint(0, vocab, mask.shape, generator=g) * mask, mask


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("path", [dict(), dict(chunk_tokens=5), dict(fused=True)], ids=["reference", "chunked", "fused"])
def test_packed_logprobs_equal_padded_and_so_do_gradients(models, arch, path):
    padded, packed = models[arch]
    ids, mask = ragged_batch([9, 2, 13, 5, 13, 1])
    rows = PackedRows.of(mask)
    a = token_logprobs(padded, ids, mask, 0.7, **path)
    b = token_logprobs(packed, ids, mask, 0.7, packed=rows, **path)
    real = mask.bool()
    assert (a - b)[real].abs().max().item() < 1e-5
    assert b[~real].abs().sum() == 0 and b[:, 0].abs().sum() == 0
    w = torch.randn(a.shape, generator=torch.Generator().manual_seed(4)) * mask
    ga = torch.autograd.grad((a * w).sum(), list(padded.parameters()))
    gb = torch.autograd.grad((b * w).sum(), list(packed.parameters()))
    assert max((x - y).abs().max().item() for x, y in zip(ga, gb)) < 1e-4


def test_critic_values_packed_equal_padded(tmp_path):
    from rl_core.config.schema import CriticConfig
    from rl_core.train.critic import Critic

    model_dir = tiny_hf_dir(tmp_path / "m")
    ids, mask = ragged_batch([7, 3, 11, 1, 6])
    chunk = TrainChunk(ids, mask, mask.float(), torch.zeros(ids.shape), torch.zeros(ids.shape), torch.ones(5),
                       torch.zeros(5, dtype=torch.long))
    plain = Critic(model_dir, CriticConfig(enabled=True, microbatch_size=2))
    torch.nn.init.normal_(plain.model.head.weight, 0, 0.5)  # a head that is not zero: values differ by token
    for kwargs in (dict(packing="on"), dict(packing="on", max_tokens_per_microbatch=12),
                   dict(max_tokens_per_microbatch=12)):
        other = Critic(model_dir, CriticConfig(enabled=True, microbatch_size=2), **kwargs)
        other.model.head.load_state_dict(plain.model.head.state_dict())
        v0, f0 = plain.values(chunk, with_final=True)
        v1, f1 = other.values(chunk, with_final=True)
        # the real tokens' values (the one after the last token is `final`; beyond it the padding is the split's)
        assert (v0 - v1)[mask.bool()].abs().max().item() < 1e-5, kwargs
        assert (f0 - f1).abs().max().item() < 1e-5, kwargs


def test_select_rows_slices_ranges_and_takes_lists():
    ids, mask = ragged_batch([4, 2, 6])
    chunk = TrainChunk(ids, mask, mask.float(), torch.zeros(ids.shape), torch.zeros(ids.shape), torch.ones(3),
                       torch.arange(3))
    assert select_rows(chunk, range(0, 2)).input_ids.shape == (2, 4)
    taken = select_rows(chunk, [0, 2])
    assert taken.start_versions.tolist() == [0, 2] and taken.input_ids.shape == (2, 6)

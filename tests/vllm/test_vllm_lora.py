"""LoRA adapter refits (`trainer.lora.refit: adapters`, docs/lora.md) through vLLM's LoRA support,
on both vLLM backends (the async engine and the OpenAI server process):

- before any update the served adapter is zero: the logprobs are the base policy's;
- after an adapter update the sampled tokens' logprobs equal the trainer's under the merged
  weights W + B @ A (the trainer's tolerance of the full-weight refit tests), the tokens carry
  the new version, and a second update replaces the first (never accumulated);
- a backend built without LoRA refuses an adapter update by name.

Adapters here are random (rank 8, every linear layer of the decoder): the vLLM tier's venv has
no PEFT, and what vLLM must honour is the refit format (rl_core.adapters), whoever made it.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from rl_core.adapters import LORA_A, LORA_B, adapter_pairs, merged_weight
from rl_core.types import GenerationRequest, SamplingParams

from tests.helpers.vllm_tier import encode_prompt, generate_all, started, trainer_logprobs

RANK = 8


def _adapters(trainer, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in trainer.model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            out[name + LORA_A] = torch.randn(RANK, module.in_features, generator=g) * 0.1
            out[name + LORA_B] = torch.randn(module.out_features, RANK, generator=g) * 0.1 * scale
    return out


def _merged(trainer, adapters) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for module, (a, b) in adapter_pairs(adapters).items():
        state[f"{module}.weight"] = merged_weight(state[f"{module}.weight"], a, b)
    return state


def _check(backend, loop, tokenizer, trainer, tag: str, state=None) -> float:
    reqs = [GenerationRequest(f"{tag}{i}", encode_prompt(tokenizer, i), SamplingParams(temperature=1.0, max_tokens=16,
                                                                                        seed=i)) for i in range(16)]
    results = generate_all(loop, backend, reqs)
    assert all(r.token_versions == [backend.weight_version] * len(r.token_ids) for r in results)
    chunk, lp = trainer_logprobs(trainer, results, 1.0, tokenizer.pad_token_id, state=state)
    mask = chunk.loss_mask.bool()
    err = (lp[mask] - chunk.gen_logprobs[mask]).abs()
    assert mask.sum() >= 16 and err.max().item() < 1e-2
    assert err.mean().item() < 1e-3, err.mean().item()
    return err.mean().item()


def _updates_follow_the_adapters(backend, loop, tokenizer, trainer):
    _check(backend, loop, tokenizer, trainer, "z")  # the zero adapter: the base policy
    first, second = _adapters(trainer, 1), _adapters(trainer, 1, scale=1.5)
    loop.run_until_complete(backend.update_weights(1, first))
    _check(backend, loop, tokenizer, trainer, "a", _merged(trainer, first))
    loop.run_until_complete(backend.update_weights(2, second))
    _check(backend, loop, tokenizer, trainer, "b", _merged(trainer, second))
    # the first adapter's logprobs are far from what is served now: the check above can fail
    results = generate_all(loop, backend, [GenerationRequest(f"c{i}", encode_prompt(tokenizer, i), SamplingParams(
        temperature=1.0, max_tokens=16, seed=i)) for i in range(8)])
    chunk, lp = trainer_logprobs(trainer, results, 1.0, tokenizer.pad_token_id, state=_merged(trainer, first))
    mask = chunk.loss_mask.bool()
    assert (lp[mask] - chunk.gen_logprobs[mask]).abs().mean().item() > 1e-2


def test_async_engine_serves_adapter_refits(tiny_policy, loop, tokenizer, trainer):
    from rl_core.generation.vllm.backend import VLLMBackend, VLLMOptions

    backend = started(loop, VLLMBackend(VLLMOptions(model=str(tiny_policy), max_model_len=64, max_num_seqs=16,
                                                    lora_rank=RANK), name="vllm-lora"))
    try:
        assert backend.options.engine_args()["max_lora_rank"] == 8
        _updates_follow_the_adapters(backend, loop, tokenizer, trainer)
    finally:
        loop.run_until_complete(backend.shutdown())


def test_server_serves_adapter_refits(tiny_policy, loop, tokenizer, trainer, tmp_path):
    from rl_core.generation.vllm.backend import VLLMOptions
    from rl_core.generation.vllm.server import VLLMServerBackend

    backend = started(loop, VLLMServerBackend(VLLMOptions(model=str(tiny_policy), max_model_len=64, max_num_seqs=16,
                                                          lora_rank=RANK), weights_dir=tmp_path, startup_timeout_s=300))
    pids = set(backend._reaper.pids) | ({backend._proc.pid} if backend._proc else set())
    try:
        _updates_follow_the_adapters(backend, loop, tokenizer, trainer)
    finally:
        loop.run_until_complete(backend.shutdown())
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"vLLM server processes left behind: {alive}"


def test_a_backend_without_lora_refuses_adapters(tiny_backend, loop, trainer):
    from rl_core.generation.vllm.common import VLLMError

    v0 = tiny_backend.weight_version
    with pytest.raises(VLLMError, match="lora_rank"):
        loop.run_until_complete(tiny_backend.update_weights(v0 + 1, _adapters(trainer, 3)))
    assert tiny_backend.weight_version == v0

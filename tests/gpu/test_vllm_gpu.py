"""VLLMBackend on a CUDA GPU with GPU vLLM (marked `gpu` and `vllm`; skipped without CUDA or
without an importable vllm). The same contract as the CPU tier (tests/vllm): vLLM's logprobs
equal the trainer's on the same tokens, a weight update (no LM-head re-pack on GPU: the
extension's platform check) changes outputs and per-token versions, abort, and the engine
sharing the device with the trainer within `kv_cache_memory_bytes` (placement colocated).

Run on the GPU machine in a venv holding vllm and rl_core (`pip install --no-deps -e .`):
    python -m pytest -m gpu tests/gpu/test_vllm_gpu.py -q
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from rl_core.packing import make_train_chunk
from rl_core.types import GenerationRequest, Sample, SamplingParams

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or
                       getattr(importlib.util.find_spec("vllm"), "origin", None) is None,
                       reason="needs GPU vLLM installed in this venv"),
]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl_core.model.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("gpu_vllm") / "policy"
    tok = build_tokenizer([{"prompt": f"{a:02d}+{b:02d}=", "answer": "000"} for a in range(30) for b in range(30)], 300)
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=256, vocab_size=len(tok), max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def backend(policy, loop):
    from rl_core.generation.vllm.backend import VLLMBackend, VLLMOptions

    b = VLLMBackend(VLLMOptions(model=str(policy), max_model_len=128, max_num_seqs=64,
                                kv_cache_memory_bytes=256 * 2**20))
    loop.run_until_complete(b.start())
    yield b
    loop.run_until_complete(b.shutdown())


def _run(loop, backend, reqs):
    async def go():
        return await asyncio.gather(*(backend.generate(r) for r in reqs))

    return loop.run_until_complete(go())


def _trainer_lp(policy, results, temperature, state=None):
    from rl_core.config.schema import TrainerConfig
    from rl_core.train.torch_trainer import TorchTrainer

    trainer = TorchTrainer(policy, TrainerConfig(), logprob_temperature=temperature, device="cuda")
    if state is not None:
        trainer.model.load_state_dict(state)
    samples = [Sample(r.prompt_ids, r.token_ids, r.logprobs, 0.0, r.finish_reason, 0, 0) for r in results]
    chunk = make_train_chunk(samples, [0.0] * len(samples), pad_id=0)
    lp = trainer.logprobs(chunk).cpu()
    mask = chunk.loss_mask.bool()
    return (lp[mask] - chunk.gen_logprobs[mask]).abs(), trainer


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_vllm_logprobs_agree_with_the_trainer(policy, backend, loop, temperature):
    reqs = [GenerationRequest(f"g{temperature}-{i}", [5 + i % 7, 9, 11], SamplingParams(
        temperature=temperature, max_tokens=32, seed=i)) for i in range(64)]
    err, _ = _trainer_lp(policy, _run(loop, backend, reqs), temperature)
    assert err.mean().item() < 1e-3, err.mean().item()


def test_gpu_vllm_weight_update_and_abort(policy, backend, loop):
    _, trainer = _trainer_lp(policy, _run(loop, backend, [GenerationRequest("w", [5, 9], SamplingParams(
        greedy=True, max_tokens=4))]), 1.0)
    gen = torch.Generator().manual_seed(1)
    new = {k: (v.cpu() + 0.05 * torch.randn(v.shape, generator=gen) * v.abs().mean().cpu())
           for k, v in trainer.export_weights().items() if k != "lm_head.weight"}
    loop.run_until_complete(backend.update_weights(1, new))
    out = _run(loop, backend, [GenerationRequest(f"u{i}", [5 + i, 9, 11], SamplingParams(greedy=True, max_tokens=16))
                               for i in range(8)])
    assert all(r.token_versions == [1] * len(r.token_ids) for r in out)
    state = dict(new, **{"lm_head.weight": new["model.embed_tokens.weight"]})
    err, _ = _trainer_lp(policy, out, 1.0, state=state)
    assert err.max().item() < 1e-2

    async def abort():
        busy = [asyncio.ensure_future(backend.generate(GenerationRequest(
            f"b{i}", [5, 9], SamplingParams(max_tokens=120, seed=i)))) for i in range(64)]
        await asyncio.sleep(0)
        await backend.abort("b0")
        res = await asyncio.gather(*busy)
        return res[0]

    assert loop.run_until_complete(abort()).finish_reason == "abort"

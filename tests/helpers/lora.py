"""LoRA checks shared by the CPU tests (tests/unit/test_lora.py) and their CUDA variants
(tests/gpu/test_lora_gpu.py): a torch trainer with LoRA, random B, the hand-written low-rank
reference of a step's adapter gradients, and the engine-versus-trainer logprob agreement."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from tests.helpers.trainers import VOCAB

LORA = {"enabled": True, "rank": 4, "alpha": 8.0}


def make_loss(**kw):
    from rl_core.algorithms.losses import make_loss as make
    from rl_core.config.schema import LossConfig

    return make(LossConfig(**kw))


def lora_trainer(base: Path, device: str = "cpu", **lora):
    from rl_core.config.schema import TrainerConfig
    from rl_core.train.torch_trainer import TorchTrainer

    return TorchTrainer(base, TrainerConfig(lora={**LORA, **lora}, microbatch_size=4), device=device)


def randomize_b(trainer, seed: int = 0) -> None:
    """B starts at zero (the base policy); a random B makes every adapter count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p))


def check_adapter_gradients(base: Path, device: str = "cpu", rtol: float = 1e-4, atol: float = 1e-7) -> None:
    """A LoRA step's adapter gradients (two microbatches, summed) equal those of the plain HF
    model with forward hooks adding scale * (x A^T) B^T to each adapted linear layer (no PEFT),
    on the same batch and loss; no base weight gets a gradient; the optimizer holds adapters only."""
    from transformers import AutoModelForCausalLM

    from rl_core.train.check_step import synthetic_chunk
    from rl_core.train.logprobs import token_logprobs

    trainer = lora_trainer(base, device)
    randomize_b(trainer)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert {id(p) for p in trainer.optimizer.param_groups[0]["params"]} == {
        id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    chunk = synthetic_chunk(VOCAB, num_samples=6)
    loss = make_loss()
    trainer.begin(loss)
    trainer.train_microbatches(chunk)  # microbatches of 4: gradients summed over two
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.abort()
    assert set(got) == set(start)  # every adapter has a gradient, no base weight has one

    ref = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).to(device)
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
        mb = chunk.slice(s, min(s + 4, chunk.num_samples)).to(device)
        loss(token_logprobs(ref, mb.input_ids, mb.attention_mask), mb).loss_sum.backward()
    for h in hooks:
        h.remove()
    for name, (a, b) in leaves.items():
        torch.testing.assert_close(got[f"{name}.lora_A.default.weight"], a.grad, rtol=rtol, atol=atol)
        torch.testing.assert_close(got[f"{name}.lora_B.default.weight"], b.grad, rtol=rtol, atol=atol)


def engine_logprob_error(trainer, engine) -> float:
    """Mean |trainer - engine| logprob over sampled completions of the engine (T = 1); every
    token within 1e-2."""
    from rl_core.generation.native.backend import NativeBackend
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
    lp = trainer.logprobs(chunk).cpu()
    mask = chunk.loss_mask.bool()
    assert mask.sum() > 24
    err = (lp[mask] - chunk.gen_logprobs[mask]).abs()
    assert err.max().item() < 1e-2
    return err.mean().item()


def check_refit(base: Path, refit: str, device: str = "cpu") -> None:
    """After one LoRA step and a refit (`adapters` or `merged`), the native engine's logprobs
    equal the trainer's (mean |diff| < 1e-3), as for full-weight refits; before it, the base's."""
    from rl_core.adapters import LORA_A, LORA_B
    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.options import EngineOptions
    from rl_core.train.check_step import synthetic_chunk

    trainer = lora_trainer(base, device, refit=refit)
    trainer.begin(make_loss())
    trainer.train_microbatches(synthetic_chunk(VOCAB, num_samples=8))
    trainer.finish()
    randomize_b(trainer, seed=1)  # one optimizer step moves B a little: make the adapters matter
    weights = trainer.export_weights()
    adapters = refit == "adapters"
    assert all(n.endswith((LORA_A, LORA_B)) for n in weights) == adapters
    engine = NativeEngine.from_pretrained(base, EngineOptions(device=device))
    assert engine_logprob_error(lora_trainer(base, device), engine) < 1e-3  # the base = a fresh adapter (B = 0)
    engine.update_weights(1, weights)
    assert engine_logprob_error(trainer, engine) < 1e-3
    assert (engine.adapters.base_bytes > 0) == adapters  # merged full weights keep no base copies

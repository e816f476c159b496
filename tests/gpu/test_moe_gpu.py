"""MoE + router replay on CUDA (marked `gpu`, skipped without a GPU): the native engine runs
a tiny Mixtral eagerly (decode_path 'auto' is eager for MoE) with fp32 logits and routes
equal to transformers', and router replay shrinks the trainer/generation logprob mismatch
when generation runs in bf16, against an fp32 trainer and against a bf16 trainer (the
realistic GPU setting: same dtype, different kernels). Both mismatch numbers are printed."""

from __future__ import annotations

import pytest
import torch

from rl_core.config.schema import TrainerConfig
from rl_core.generation import EngineOptions, NativeEngine
from rl_core.train.torch_trainer import TorchTrainer
from rl_core.packing import make_train_chunk
from tests.unit.test_moe_engine import hf_routes, tiny_moe
from tests.unit.test_router_replay import generate, mismatch, moe_dir  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_engine_logits_and_routes_equal_transformers_on_cuda():
    model = tiny_moe().to("cuda")
    engine = NativeEngine(model.config, model.state_dict(), EngineOptions(device="cuda", max_batch_size=4))
    assert engine.decode_path == "eager"  # MoE: no CUDA-graph decode
    ids = torch.randint(0, 100, (3, 11), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(engine.model.sequence_logits(ids), expected, atol=1e-3, rtol=1e-3)
    assert torch.equal(engine.model.last_routes, hf_routes(model, ids))


@pytest.mark.parametrize("trainer_dtype", ["float32", "bfloat16"])
def test_replay_shrinks_bf16_generation_mismatch_on_cuda(moe_dir, trainer_dtype):  # noqa: F811
    samples = generate(moe_dir, "bfloat16", n=64, device="cuda")
    chunk = make_train_chunk(samples, [0.0] * len(samples), require_routes=True)
    plain = TorchTrainer(moe_dir, TrainerConfig(microbatch_size=16), device="cuda", dtype=trainer_dtype)
    replay = TorchTrainer(moe_dir, TrainerConfig(microbatch_size=16, router_replay={"enabled": True}),
                          device="cuda", dtype=trainer_dtype)
    flip_frac, err_plain, err_replay = mismatch(plain, replay, chunk)
    print(f"\n[cuda] bf16 generation vs {trainer_dtype} trainer: routes flipped for {flip_frac:.2%} of tokens; mean "
          f"|trainer - generation logprob| without replay {err_plain:.6f}, with replay {err_replay:.6f}")
    assert flip_frac > 0
    assert err_replay < err_plain

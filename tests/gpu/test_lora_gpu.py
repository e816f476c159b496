"""LoRA (`trainer.lora`, docs/lora.md) on one CUDA device (marked `gpu`, skipped without CUDA or
PEFT): the CUDA variants of tests/unit/test_lora.py's numerics.

- A LoRA step's adapter gradients equal the hand-written low-rank reference (fp32; TF32 off).
- After a refit (adapters merged into the engine's weights, or merged full weights), the native
  engine's logprobs on CUDA equal the trainer's (mean |diff| < 1e-3).
- fsdp2 (NCCL, world 1, fp32) trains the torch trainer's adapters.
"""

from __future__ import annotations

import pytest
import torch

from rl_core.adapters import LORA_A, LORA_B
from tests.helpers.lora import check_adapter_gradients, check_refit
from tests.helpers.trainers import max_weight_diff, run_check, tiny_hf_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("peft")
CUDA = ("runtime.device=cuda",)
LORA = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_hf_dir(tmp_path_factory.mktemp("lora_gpu") / "base", "qwen2", tied=False)


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_adapter_gradients_equal_a_hand_written_low_rank_reference_on_cuda(base, no_tf32):
    check_adapter_gradients(base, "cuda", rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("refit", ["adapters", "merged"])
def test_engine_logprobs_equal_the_trainers_after_a_refit_on_cuda(base, refit, no_tf32):
    check_refit(base, refit, "cuda")


def test_fsdp2_trains_the_torch_trainers_adapters_on_cuda(base, tmp_path):
    ref, w_ref = run_check(base, tmp_path, "torch", 1, *CUDA, *LORA)
    got, w_got = run_check(base, tmp_path, "fsdp2", 1, *CUDA, *LORA, "trainer.fsdp.mixed_precision=none")
    assert set(w_ref) == set(w_got) and all(k.endswith((LORA_A, LORA_B)) for k in w_ref)
    for a, b in zip(ref["steps"], got["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert max_weight_diff(w_ref, w_got) < 1e-3
    assert max(v.abs().max().item() for k, v in w_ref.items() if k.endswith(LORA_B)) > 0

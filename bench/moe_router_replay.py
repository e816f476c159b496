"""Router replay (R3) on a random-init Mixtral: what it buys and what it costs, side by side.

Run: `.venv/bin/python bench/moe_router_replay.py` (tiny CPU shapes) or
`.venv/bin/python bench/moe_router_replay.py --gpu` (a ~0.3B Mixtral, 8 experts top-2, on CUDA).
One run does, on the same weights and samples:
1. generation with the native engine in bf16 (tokens/s printed);
2. trainer logprobs of those samples without and with replay (trainer dtype: fp32 and, on
   GPU, bf16 too): the fraction of tokens whose routes the trainer flips, and mean
   |trainer - generation logprob| for both (their ratio is what replay buys);
3. the trainer forward + backward time per microbatch without and with replay, alternating,
   best of N (their ratio is the hook's overhead).
Timings are never test assertions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.algorithms.losses import make_loss  # noqa: E402
from rl_core.config.schema import LossConfig, TrainerConfig  # noqa: E402
from rl_core.generation import EngineOptions, NativeEngine  # noqa: E402
from rl_core.train.torch_trainer import TorchTrainer  # noqa: E402
from rl_core.packing import make_train_chunk  # noqa: E402
from rl_core.types import GenerationRequest, Sample, SamplingParams  # noqa: E402
from tests.unit.test_router_replay import mismatch  # noqa: E402

SHAPES = {
    "cpu": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=100, num_local_experts=8, num_experts_per_tok=2,
                requests=32, prompt=8, max_tokens=16, expert_std=0.3),
    "gpu": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=1024, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                requests=64, prompt=128, max_tokens=256, expert_std=0.05),
}


def build(shape: dict, out: Path) -> Path:
    s = dict(shape)
    expert_std = s.pop("expert_std")
    for k in ("requests", "prompt", "max_tokens"):
        s.pop(k)
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(max_position_embeddings=1024, sliding_window=None, eos_token_id=0,
                                             tie_word_embeddings=True, **s))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0, expert_std)
            layer.mlp.experts.down_proj.normal_(0, expert_std)
    model.save_pretrained(out)
    return out


def generate(model_dir: Path, shape: dict, device: str) -> list[Sample]:
    engine = NativeEngine.from_pretrained(model_dir, EngineOptions(
        device=device, dtype="bfloat16", max_batch_size=shape["requests"],
        max_seq_len=shape["prompt"] + shape["max_tokens"] + 1))
    g = torch.Generator().manual_seed(1)
    for i in range(shape["requests"]):
        prompt = torch.randint(1, shape["vocab_size"], (shape["prompt"],), generator=g).tolist()
        engine.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=shape["max_tokens"], seed=i)))
    results, t0 = [], time.perf_counter()
    while engine.has_work():
        results += engine.step()
    dt = time.perf_counter() - t0
    print(f"generation (native engine, bf16, MoE eager): {engine.stats.tokens_generated / dt:.0f} tokens/s")
    return [Sample(r.prompt_ids, r.token_ids, r.logprobs, float(i % 2), r.finish_reason, 0, 0,
                   routed_experts=r.routed_experts) for i, r in enumerate(results)]


def step_time(trainer: TorchTrainer, chunk, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        if chunk.input_ids.is_cuda or trainer.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.begin(make_loss(LossConfig()))
        trainer.train_microbatches(chunk)
        trainer.abort()  # time forward + backward only, keep the weights
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if args.gpu else "cpu"
    shape = SHAPES["gpu" if args.gpu else "cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(shape, Path(tmp) / "policy")
        samples = generate(model_dir, shape, device)
        chunk = make_train_chunk(samples, [1.0, -1.0] * (len(samples) // 2), require_routes=True)
        for dtype in (["float32", "bfloat16"] if args.gpu else ["float32"]):
            n = len(samples)
            plain = TorchTrainer(model_dir, TrainerConfig(microbatch_size=n), device=device, dtype=dtype)
            replay = TorchTrainer(model_dir, TrainerConfig(microbatch_size=n, router_replay={"enabled": True}),
                                  device=device, dtype=dtype)
            flip, err_plain, err_replay = mismatch(plain, replay, chunk)
            print(f"bf16 generation vs {dtype} trainer: routes flipped for {flip:.2%} of tokens; mean |trainer - "
                  f"generation logprob| without replay {err_plain:.6f}, with replay {err_replay:.6f} "
                  f"(ratio {err_plain / err_replay:.2f})")
            times = {"plain": [], "replay": []}
            for _ in range(2):  # alternate, so a busy machine hurts both alike
                times["plain"].append(step_time(plain, chunk, args.repeats))
                times["replay"].append(step_time(replay, chunk, args.repeats))
            t_plain, t_replay = min(times["plain"]), min(times["replay"])
            print(f"  forward+backward of {chunk.num_samples} samples: {t_plain * 1e3:.1f} ms without replay, "
                  f"{t_replay * 1e3:.1f} ms with replay (ratio {t_replay / t_plain:.3f})")


if __name__ == "__main__":
    main()

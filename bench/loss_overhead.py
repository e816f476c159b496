"""Cost of rl_core's full policy loss next to a bare policy-gradient loss, and the step's MFU.

Run: `.venv/bin/python bench/loss_overhead.py` (CPU shapes) or
`.venv/bin/python bench/loss_overhead.py --gpu` (Qwen2.5-0.5B shapes, bf16, on CUDA).
Both variants do the same forward + backward of a random-init Qwen2 policy on the same
microbatch, side by side in one run (alternating, best of N):
- `bare`: -(A * logp) summed over the mask (nothing else);
- `full`: `PolicyGradientLoss` with TIS importance weights, the logprob-error threshold,
  dual clip, a k3 KL term (reference logprobs given) and all its metrics.
It prints the seconds per microbatch of each, their ratio (the overhead of the loss's extra
terms and metrics), model FLOP/s from `FlopsCounter`, MFU when the device's peak is known,
and the loss computations alone (less sensitive to a busy machine than whole steps).
Timings are never test assertions.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_core.algorithms.flops import FlopsCounter, FlopsSpec, peak_flops_per_s
from rl_core.algorithms.losses import make_loss
from rl_core.config.schema import LossConfig
from rl_core.train.torch_trainer import token_logprobs
from rl_core.types import TrainChunk

SHAPES = {
    "cpu": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=512, vocab_size=1000, batch=16, seq=64, dtype=torch.float32),
    "gpu": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, batch=8, seq=1024, dtype=torch.bfloat16),
}


def build(shape: dict, device: str):
    s = dict(shape)
    batch, seq, dtype = s.pop("batch"), s.pop("seq"), s.pop("dtype")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(max_position_embeddings=seq, tie_word_embeddings=True, **s))
    model = model.to(device, dtype).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s["vocab_size"], (batch, seq), generator=g)
    loss_mask = torch.zeros(batch, seq)
    loss_mask[:, seq // 4:] = 1.0
    with torch.no_grad():
        lp = token_logprobs(model, ids.to(device), torch.ones_like(ids).to(device)).float().cpu()
    chunk = TrainChunk(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask,
                       gen_logprobs=lp + 0.05 * torch.randn(batch, seq, generator=g),
                       advantages=torch.randn(batch, 1, generator=g).expand(batch, seq).contiguous(),
                       sample_mask=torch.ones(batch), start_versions=torch.zeros(batch, dtype=torch.long),
                       ref_logprobs=lp + 0.05 * torch.randn(batch, seq, generator=g))
    return model, chunk.to(device)


def step_times(model, chunk, loss_fns: dict, repeats: int) -> dict[str, float]:
    """Best seconds per forward+backward of each loss, measured alternately (same machine state for both)."""
    def once(loss_fn):
        lp = token_logprobs(model, chunk.input_ids, chunk.attention_mask)
        loss_fn(lp, chunk).backward()
        model.zero_grad(set_to_none=True)
        if chunk.input_ids.is_cuda:
            torch.cuda.synchronize()

    best = {name: float("inf") for name in loss_fns}
    for fn in loss_fns.values():
        once(fn)  # warm-up
    for _ in range(repeats):
        for name, fn in loss_fns.items():
            t0 = time.perf_counter()
            once(fn)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def loss_only_times(chunk, loss_fns: dict, repeats: int) -> dict[str, float]:
    """Best seconds of the loss alone (forward + backward to a leaf logprob tensor), alternately."""
    with torch.no_grad():
        base = chunk.gen_logprobs.clone()
    best = {name: float("inf") for name in loss_fns}
    for i in range(repeats + 1):
        for name, fn in loss_fns.items():
            lp = base.clone().requires_grad_()
            t0 = time.perf_counter()
            fn(lp, chunk).backward()
            if chunk.input_ids.is_cuda:
                torch.cuda.synchronize()
            if i:  # the first round is a warm-up
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="Qwen2.5-0.5B shapes in bf16 on CUDA")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: small ops are not slowed by thread hand-offs on a busy machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if args.gpu else "cpu"
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device")
    model, chunk = build(SHAPES["gpu" if args.gpu else "cpu"], device)
    mask = chunk.loss_mask * chunk.sample_mask[:, None]
    full = make_loss(LossConfig(kl_coef=0.01, dual_clip_c=3.0,
                                importance_sampling={"truncation": "tis", "max_ratio": 2.0,
                                                     "max_seq_mult_prob_error": 2.0}))
    fns = {"bare": lambda lp, c: -(c.advantages * lp * mask).sum(), "full": lambda lp, c: full(lp, c).loss_sum}
    t = step_times(model, chunk, fns, args.repeats)
    t_bare, t_full = t["bare"], t["full"]
    alone = loss_only_times(chunk, fns, 10 * args.repeats)
    counter = FlopsCounter(FlopsSpec.from_model(model))
    counter.add_train(chunk)
    peak = peak_flops_per_s() if args.gpu else None
    name = torch.cuda.get_device_name() if args.gpu else "cpu"
    print(f"device {name}; microbatch {tuple(chunk.input_ids.shape)}; {counter.total / 1e12:.3f} TFLOP per step")
    for label, t in (("bare", t_bare), ("full", t_full)):
        m = counter.metrics(t, peak)
        mfu = f", MFU {m['perf/mfu']:.1%}" if "perf/mfu" in m else ""
        print(f"  {label:4s}: {t * 1e3:8.1f} ms per forward+backward, {m['flops/per_s'] / 1e12:7.2f} TFLOP/s{mfu}")
    print(f"full / bare time ratio: {t_full / t_bare:.3f}")
    print(f"the loss alone (forward + backward to the logprobs): bare {alone['bare'] * 1e3:.3f} ms, "
          f"full {alone['full'] * 1e3:.3f} ms; extra cost of the full loss = "
          f"{(alone['full'] - alone['bare']) / t_bare:.1%} of a bare training microbatch")


if __name__ == "__main__":
    main()

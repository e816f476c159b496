"""Training-step throughput of the trainer backends on one GPU: TFLOP/s and the fraction of peak.

Run (one command, < 4 minutes on an H200, --ragged < 10; prints a table; writes
$OUT/train_step_gpu.json when OUT is set, or --json PATH):

    python bench/train_step_gpu.py            # every backend on the GPU
    python bench/train_step_gpu.py --smoke    # CPU, tiny shape: checks the code paths only
    python bench/train_step_gpu.py --host-overhead   # CPU: host time per step of torch vs fsdp2 vs megatron
    python bench/train_step_gpu.py --ragged --json r.json   # long-tail batch: padded vs packed vs full batch
    python bench/train_step_gpu.py --ragged --device cpu    # the same on the CPU, tiny shape (= --smoke)

Shape: Qwen2.5-0.5B (hidden 896, 24 layers, 14 query / 2 key-value heads, MLP 4864, vocabulary
151936, tied embeddings, RoPE base 1e6), random weights, bf16 compute. One RL step = one
`begin / train_microbatches / finish` of the split step API on 16 sequences x 1024 tokens
(microbatches of 8), the clipped policy-gradient loss, AdamW and gradient clipping.

FLOPs of a step (Chowdhery et al. 2022, PaLM, appendix B): tokens x (6 N + 12 L H Q T), N the
parameters of the matrix multiplies (attention and MLP projections and the LM head; the
embedding lookup is not one), L layers, H heads, Q head dim, T = 1024 (attention counted
without the causal halving, as PaLM does). The fraction is TFLOP/s / 771, the bf16 dense
matmul rate measured on the same H200 (the issue's reference: plain transformers with
fused AdamW reached 286 TFLOP/s = 37%; target >= 50%).

Variants, each in its own process (fresh memory and global state), measured side by side
(`--backends` picks a subset; the default runs them all, more than one call's time box):
- torch: `TorchTrainer`, bf16 parameters, fused AdamW, the full-logits logprob path
  (`trainer.logprob_chunk_tokens=0`): the baseline;
- torch+chunked: logprobs chunked over 4,096 tokens (`trainer.logprob_chunk_tokens`), no full logits;
- torch+compile / torch+chunked+compile: `trainer.compile` (each decoder layer compiled; without
  chunking it also takes the fused logprob path: compiled log-sum-exp and gradient kernels over
  the bf16 logits, `rl_core.train.logprobs.FusedLogprobs`);
- ...+mb2x: the same with twice --microbatch (chunked logprobs leave the memory for it);
- fsdp2: `FSDPTrainer` on 1 GPU, fp32 master weights, bf16 mixed precision, fused AdamW over the local
  shards (`ShardLocalAdamW`, `rl_core.train.fused_adam`);
- fsdp2+foreach: the same with torch's multi-tensor AdamW (the default before; fused over the DTensors
  themselves had measured slower);
- fsdp2+compile: the same with `trainer.fsdp.compile` (each decoder layer compiled, fused logprobs);
- fsdp2+compile+noreshard+mb2x: and `trainer.fsdp.reshard_after_forward: false`, twice the microbatch;
- fsdp2+compile+noreshard+unit24+mb2x: and `trainer.fsdp.layers_per_unit: 24` (all layers one FSDP unit);
  ...+foreach+mb2x: and the multi-tensor AdamW (megatron+foreach+mb2x: Megatron's fallback, unfused);
- megatron: `MegatronTrainer`, bf16 with Megatron's optimizer (fp32 main weights), SDPA attention,
  fused logprobs (on CUDA at tensor parallel size 1); megatron+mb2x: twice the microbatch.
- fsdp2+bf16+..., megatron+bf16+...: the torch backend's precision (bf16 weights and AdamW state, no
  fp32 master copy; megatron with torch's AdamW), to compare the sharded backends' own cost like for like.
- ...+dyn: fsdp2 / megatron with their compiled pieces at dynamic=True (every size a symbol, the parameters'
  too under FSDP2), as before they moved to automatic dynamic shapes.
- ...+ragged+padded / sorted / packed / packed-sdpa: the ragged long-tail batch (`--ragged-batch` samples up
  to `--ragged-cap` tokens, bench/train_step_ragged.py: the modes, and the one table `--ragged` prints) by
  sample count (as many as `--max-tokens` holds at the cap), by that token budget sorted, packed
  (`trainer.packing: on`), and packed through SDPA instead of the varlen kernels; useful tokens/s and TFLOP/s
  of useful work, against the padded mode and the backend's full batch (`...+mb2x`) of the same call.
  torch+compile+packed+mb2x: the full batch packed. Every other variant pins `trainer.packing: off` (the
  figures in docs/benchmarks.md are padded); `--ragged` runs in `RAGGED_BUDGET_S` by default.
Before its warm-up steps each variant runs one step 16 tokens shorter, as an RL run's lengths vary: the
compiled pieces see two shapes and make the sizes that changed dynamic before anything is timed.
`--profile` adds one profiled step per variant: device time by kernel category, the top kernels and
the top aten operators by their own kernels' device time (with their input shapes), the device's idle
time charged to the host code that launched the kernel after each idle interval (by step phase,
operator or range, and innermost operator), and the generated source of the top compiled kernels;
`--host-profile` one cProfiled step (the host's Python work, top functions by own time).
`--host-overhead` (CPU, no GPU needed): the same split step on a model of the same depth (24 layers)
but 32 wide, 2 x 16 tokens in one microbatch, so compute is negligible and the time per step is the
backends' own host work (Python, hooks, dispatch, optimizer loops); also the aten operators one step
dispatches (torch.profiler, CPU) and the process's CPU seconds per step (min over 40 steps: the least disturbed
by other processes). Variants `HOST_BACKENDS`, side by side in one run, one thread each.
A backend that cannot run (e.g. megatron-core not installed) is reported as skipped. The
'trainer MFU' column is the trainer's own `perf/mfu` metric (over the datasheet peak, 989
TFLOP/s on an H200, and the step's compute time), a check that the metric exists and is sane.
Time per step is the median of the timed steps after warm-up steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train_step_profile import count_ops, host_profile, print_profiles, profile_step, triton_sources
from train_step_ragged import (RAGGED_MODES, force_sdpa_attention, full_summary, model_flops, print_ragged_table,
                               ragged_chunk, ragged_mode, ragged_overrides, ragged_summary)

PEAK_TFLOPS = 771.0
BUDGET_S = float(os.environ.get("RL_CORE_BENCH_BUDGET_S", "225"))  # whole-run time box, seconds
RAGGED_BUDGET_S = float(os.environ.get("RL_CORE_BENCH_BUDGET_S", "500"))  # --ragged: within a 10-minute call
SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
             rope_theta=1e6, rms_norm_eps=1e-6)
SMOKE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True,
                   rope_theta=1e6, rms_norm_eps=1e-6)
TORCH = ["trainer.backend=torch", "model.dtype=bfloat16"]
BACKENDS = {  # name -> recipe overrides (after --microbatch, so a variant's own microbatch wins)
    "torch": TORCH + ["trainer.logprob_chunk_tokens=0"],  # the full-logits path: the baseline
    "torch+chunked": TORCH + ["trainer.logprob_chunk_tokens=4096"],
    "torch+compile": TORCH + ["trainer.logprob_chunk_tokens=0", "trainer.compile=true"],
    "torch+chunked+compile": TORCH + ["trainer.logprob_chunk_tokens=4096", "trainer.compile=true"],
    "torch+chunked+mb2x": TORCH + ["trainer.logprob_chunk_tokens=4096"],  # twice --microbatch (set in run_one)
    "torch+chunked+compile+mb2x": TORCH + ["trainer.logprob_chunk_tokens=4096", "trainer.compile=true"],
    "torch+compile+mb2x": TORCH + ["trainer.logprob_chunk_tokens=0", "trainer.compile=true"],
    "fsdp2": ["trainer.backend=fsdp2", "model.dtype=float32", "trainer.fsdp.mixed_precision=bf16"],
    # fsdp2 with torch's multi-tensor AdamW (run_one turns the fused update off)
    "fsdp2+foreach": ["trainer.backend=fsdp2", "model.dtype=float32", "trainer.fsdp.mixed_precision=bf16"],
    "fsdp2+compile": ["trainer.backend=fsdp2", "model.dtype=float32", "trainer.fsdp.mixed_precision=bf16",
                      "trainer.fsdp.compile=true"],
    "fsdp2+compile+noreshard+mb2x": ["trainer.backend=fsdp2", "model.dtype=float32",
                                     "trainer.fsdp.mixed_precision=bf16", "trainer.fsdp.compile=true",
                                     "trainer.fsdp.reshard_after_forward=false"],
    # one FSDP unit for all 24 layers (trainer.fsdp.layers_per_unit): FSDP's hooks and collectives once a pass
    "fsdp2+compile+noreshard+unit24+mb2x": ["trainer.backend=fsdp2", "model.dtype=float32",
                                            "trainer.fsdp.mixed_precision=bf16", "trainer.fsdp.compile=true",
                                            "trainer.fsdp.reshard_after_forward=false",
                                            "trainer.fsdp.layers_per_unit=24"],
    # and torch's multi-tensor AdamW (as fsdp2+foreach)
    "fsdp2+compile+noreshard+unit24+foreach+mb2x": ["trainer.backend=fsdp2", "model.dtype=float32",
                                                  "trainer.fsdp.mixed_precision=bf16", "trainer.fsdp.compile=true",
                                                  "trainer.fsdp.reshard_after_forward=false",
                                                  "trainer.fsdp.layers_per_unit=24"],
    "megatron": ["trainer.backend=megatron", "model.dtype=float32", "trainer.megatron.mixed_precision=bf16",
                 "trainer.megatron.optimizer=megatron"],
    # fsdp2 / megatron with every compiled size a symbol (dynamic=True, before automatic dynamic shapes)
    "fsdp2+compile+noreshard+unit24+dyn+mb2x": ["trainer.backend=fsdp2", "model.dtype=float32",
                                                "trainer.fsdp.mixed_precision=bf16", "trainer.fsdp.compile=true",
                                                "trainer.fsdp.reshard_after_forward=false",
                                                "trainer.fsdp.layers_per_unit=24"],
    "megatron+foreach+mb2x": ["trainer.backend=megatron", "model.dtype=float32",
                              "trainer.megatron.mixed_precision=bf16", "trainer.megatron.optimizer=megatron"],
    "megatron+dyn+mb2x": ["trainer.backend=megatron", "model.dtype=float32", "trainer.megatron.mixed_precision=bf16",
                          "trainer.megatron.optimizer=megatron"],
    "megatron+mb2x": ["trainer.backend=megatron", "model.dtype=float32", "trainer.megatron.mixed_precision=bf16",
                      "trainer.megatron.optimizer=megatron"],
    # Megatron's eager element-wise ops (trainer.megatron.fused_elementwise off): the step before the fusions
    "megatron+eager+mb2x": ["trainer.backend=megatron", "model.dtype=float32", "trainer.megatron.mixed_precision=bf16",
                            "trainer.megatron.optimizer=megatron", "trainer.megatron.fused_elementwise=off"],
    "megatron+compile+mb2x": ["trainer.backend=megatron", "model.dtype=float32",
                              "trainer.megatron.mixed_precision=bf16", "trainer.megatron.optimizer=megatron",
                              "trainer.megatron.compile=true"],
    # the torch backend's precision (bf16 weights and AdamW state, no fp32 master copy), for a like-for-like
    # comparison of the sharded backends' own cost on one GPU
    "fsdp2+bf16+compile+noreshard+mb2x": ["trainer.backend=fsdp2", "model.dtype=bfloat16",
                                          "trainer.fsdp.mixed_precision=none", "trainer.fsdp.compile=true",
                                          "trainer.fsdp.reshard_after_forward=false"],
    "fsdp2+bf16+compile+noreshard+unit24+mb2x": ["trainer.backend=fsdp2", "model.dtype=bfloat16",
                                                 "trainer.fsdp.mixed_precision=none", "trainer.fsdp.compile=true",
                                                 "trainer.fsdp.reshard_after_forward=false",
                                                 "trainer.fsdp.layers_per_unit=24"],
    "megatron+bf16+mb2x": ["trainer.backend=megatron", "model.dtype=bfloat16",
                           "trainer.megatron.mixed_precision=none", "trainer.megatron.optimizer=torch"],
    "megatron+bf16+compile+mb2x": ["trainer.backend=megatron", "model.dtype=bfloat16",
                                   "trainer.megatron.mixed_precision=none", "trainer.megatron.optimizer=torch",
                                   "trainer.megatron.compile=true"],
}
SMOKE_BACKENDS = {
    "torch": ["trainer.backend=torch", "trainer.logprob_chunk_tokens=0"],
    "torch+chunked": ["trainer.backend=torch", "trainer.logprob_chunk_tokens=40"],
    "torch+chunked+mb2x": ["trainer.backend=torch", "trainer.logprob_chunk_tokens=40"],
    "fsdp2": ["trainer.backend=fsdp2"],
    "megatron": ["trainer.backend=megatron"],
    "megatron+compile": ["trainer.backend=megatron", "trainer.megatron.compile=true"],
}
# the ragged long-tail batch (bench/train_step_ragged.py): each base backend in every mode; the full batch packed
RAGGED_BASES = {"torch+compile": BACKENDS["torch+compile"],
                "fsdp2+compile+noreshard+unit24": BACKENDS["fsdp2+compile+noreshard+unit24+mb2x"],
                "megatron": BACKENDS["megatron"]}
BACKENDS.update({f"{base}+ragged+{mode}": sets for base, sets in RAGGED_BASES.items() for mode in RAGGED_MODES})
BACKENDS["torch+compile+packed+mb2x"] = BACKENDS["torch+compile+mb2x"]
SMOKE_BASES = {"torch": "torch", "fsdp2": "fsdp2", "megatron": "megatron"}
SMOKE_BACKENDS.update({f"{base}+ragged+{mode}": SMOKE_BACKENDS[base] for base in SMOKE_BASES for mode in RAGGED_MODES})
SMOKE_BACKENDS.update({f"{base}+mb2x": SMOKE_BACKENDS[base] for base in ("fsdp2", "megatron")})
SMOKE_BACKENDS["torch+mb2x"] = SMOKE_BACKENDS["torch+packed+mb2x"] = SMOKE_BACKENDS["torch"]


def _ragged_default(bases: list[str]) -> list[str]:
    """--ragged, in the order that matters if the time box ends the run early: each backend's
    padded and packed ragged modes, its full batch, then the extra rows."""
    torch_base = bases[0]
    core = [f"{torch_base}+mb2x", f"{torch_base}+ragged+padded", f"{torch_base}+ragged+packed"]
    for base in bases[1:]:
        core += [f"{base}+ragged+padded", f"{base}+ragged+packed", f"{base}+mb2x"]
    return core + [f"{torch_base}+packed+mb2x", f"{torch_base}+ragged+packed-sdpa", f"{torch_base}+ragged+sorted"]


RAGGED_DEFAULT = _ragged_default(list(RAGGED_BASES))
SMOKE_RAGGED_DEFAULT = _ragged_default(list(SMOKE_BASES))

# --host-overhead: the depth of the GPU shape (the per-layer hooks and launches scale with it), negligible width
HOST_SHAPE = dict(SMOKE_SHAPE, num_hidden_layers=24, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=256)
HOST_BACKENDS = {
    "torch": ["trainer.backend=torch"],
    "fsdp2": ["trainer.backend=fsdp2"],
    "fsdp2+unit4": ["trainer.backend=fsdp2", "trainer.fsdp.layers_per_unit=4"],
    "fsdp2+unit24": ["trainer.backend=fsdp2", "trainer.fsdp.layers_per_unit=24"],
    "fsdp2+noreshard": ["trainer.backend=fsdp2", "trainer.fsdp.reshard_after_forward=false"],
    "fsdp2+noreshard+unit24": ["trainer.backend=fsdp2", "trainer.fsdp.reshard_after_forward=false",
                               "trainer.fsdp.layers_per_unit=24"],
    "megatron": ["trainer.backend=megatron"],
}


def step_flops(shape: dict, batch: int, seq: int) -> float:
    return model_flops(shape, [seq] * batch)


def write_json(result: dict, dest: str | None, name: str) -> None:
    """`result` as JSON to `dest`, or to $OUT/`name` when OUT is set (the device runner's folder)."""
    dest = dest or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if dest:
        Path(dest).write_text(json.dumps(result, indent=1))
        print(f"wrote {dest}")


def build_model(out: Path, shape: dict, device: str) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.save_pretrained(out)
    return out


def chunk(vocab: int, batch: int, seq: int):
    import torch

    from rl_core.types import TrainChunk

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, :seq // 4] = 0  # a prompt of a quarter, the rest is the completion
    adv = torch.randn(batch, 1, generator=g).expand(batch, seq) * loss_mask
    return TrainChunk(input_ids=ids, attention_mask=torch.ones(batch, seq, dtype=torch.long), loss_mask=loss_mask,
                      gen_logprobs=-2.0 * loss_mask, advantages=adv.contiguous(), sample_mask=torch.ones(batch),
                      start_versions=torch.zeros(batch, dtype=torch.long))


def time_steps(trainer, loss, c, warmup: int, steps: int, device: str) -> tuple[list[float], dict]:
    """Seconds of each timed split step (after `warmup` untimed ones) and the last step's metrics (with
    `_cpu_steps_s`: the process's CPU seconds of each timed step, all its threads)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, metrics = [], {}
    cpu: list[float] = []
    for i in range(warmup + steps):
        sync()
        t, p = time.perf_counter(), time.process_time()
        trainer.begin(loss)
        trainer.train_microbatches(c)
        metrics = trainer.finish()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - p)
    metrics = dict(metrics, _cpu_steps_s=cpu)
    return times, metrics


def _table(args) -> dict:
    return HOST_BACKENDS if args.host_overhead else SMOKE_BACKENDS if args.smoke else BACKENDS


def _shape(args) -> dict:
    return HOST_SHAPE if args.host_overhead else SMOKE_SHAPE if args.smoke else SHAPE


def run_one(args) -> None:
    """Child process: time one backend, write its JSON."""
    import torch

    from rl_core.algorithms.losses import make_loss
    from rl_core.config import apply_overrides, validate_dict
    from rl_core.train import close_trainer, make_trainer

    device = "cpu" if args.smoke or args.host_overhead else "cuda"
    if device == "cpu":
        torch.set_num_threads(1)  # host work is single-threaded; one thread keeps the CPU numbers steadier
    microbatch = args.microbatch * (2 if args.run.endswith("+mb2x") else 1)
    sets = [f"runtime.device={device}", f"trainer.microbatch_size={microbatch}"] + _table(args)[args.run]
    mode = ragged_mode(args.run)
    ragged = mode is not None
    if ragged:  # padded: as many samples as the token budget holds at the cap; the other modes: the budget
        sets += ragged_overrides(mode, args.ragged_cap, args.max_tokens)
        if mode == "packed-sdpa":
            force_sdpa_attention()
    else:  # the full batch: padded, as docs/benchmarks.md measured it, unless the variant says packed
        sets.append(f"trainer.packing={'on' if '+packed' in args.run else 'off'}")
    cfg = validate_dict(apply_overrides({}, sets))
    shape = _shape(args)
    if "+foreach" in args.run:  # fsdp2 / megatron with torch's multi-tensor AdamW, as before the fused update
        import rl_core.train.fsdp as fsdp_module
        import rl_core.train.megatron as megatron_module

        fsdp_module.fused_adamw = megatron_module.fused_adamw = lambda optimizer: None
    if "+dyn" in args.run:  # the compiled pieces with dynamic=True (every size a symbol), as before automatic
        import torch.nn                   # dynamic shapes: fsdp2's layers, megatron's norm and rotary functions

        real_compile, real_module_compile = torch.compile, torch.nn.Module.compile

        def compile_dynamic(*a, **kw):
            return real_compile(*a, **{**kw, "dynamic": True if kw.get("dynamic") is None else kw["dynamic"]})

        def module_compile_dynamic(self, *a, **kw):
            return real_module_compile(self, *a, **{**kw, "dynamic": True if kw.get("dynamic") is None
                                                    else kw["dynamic"]})

        torch.compile, torch.nn.Module.compile = compile_dynamic, module_compile_dynamic
    c = (ragged_chunk(shape["vocab_size"], args.ragged_batch, args.ragged_cap) if ragged
         else chunk(shape["vocab_size"], args.batch, args.seq))
    t0 = time.perf_counter()
    trainer = make_trainer(cfg, args.model_dir)
    build_s = time.perf_counter() - t0
    loss = make_loss(cfg.loss)
    try:
        # one step at a shorter length first: as in an RL run, where every step's length differs, the compiled
        # pieces see a second shape and mark what changed (batch, sequence) dynamic before the timed steps
        if not ragged:  # (the ragged batch's microbatches already come in several shapes)
            time_steps(trainer, loss, chunk(shape["vocab_size"], args.batch, args.seq - 16), 0, 1, device)
        times, metrics = time_steps(trainer, loss, c, args.warmup, args.steps, device)
        prof = profile_step(trainer, loss, c, device) if args.profile else None
        if prof and device == "cuda":
            prof["kernel_src"] = triton_sources([name for name, _ in prof["top"]])
        host = host_profile(trainer, loss, c, device) if args.host_profile else None
        ops = count_ops(trainer, loss, c) if args.host_overhead else None
    finally:
        close_trainer(trainer)
    step_s = statistics.median(times)
    flops = step_flops(shape, args.batch, args.seq)
    out = {"backend": args.run, "microbatch": microbatch, "step_s": step_s, "steps_s": times,
           "cpu_steps_s": metrics.pop("_cpu_steps_s", None),
           "tflops": flops / step_s / 1e12, "trainer_flops_per_s": metrics.get("flops/per_s"),
           "trainer_mfu": metrics.get("perf/mfu"),
           "mfu": flops / step_s / 1e12 / PEAK_TFLOPS, "step_tflop": flops / 1e12, "build_s": build_s,
           "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
           "profile": prof, "host_profile": host, "aten_ops": ops}
    if ragged:  # useful work only: the full-batch formula above does not apply
        for key in ("tflops", "mfu", "step_tflop", "trainer_flops_per_s"):
            out.pop(key)
        out.update(ragged_summary(c, cfg, shape, step_s))
    else:
        out.update(full_summary(args.batch, args.seq, out["tflops"], step_s))
    Path(args.json).write_text(json.dumps(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU and a tiny shape: check the code paths")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the same as --smoke")
    ap.add_argument("--host-overhead", action="store_true",
                    help="CPU: host time per step of each backend on a 24-layer, 32-wide model (compute negligible)")
    ap.add_argument("--backends", default=None, help="comma-separated subset of: " + ", ".join(BACKENDS)
                    + "; with --host-overhead: " + ", ".join(HOST_BACKENDS))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--microbatch", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step of each variant (device time by kernel category, top kernels)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile one step of each variant (the host's Python work, top functions by own time)")
    ap.add_argument("--ragged", action="store_true",
                    help="the ragged long-tail batch: each backend padded vs packed, and its full batch (default variants)")
    ap.add_argument("--ragged-batch", type=int, default=None, help="samples of the ragged batch (64; smoke 16)")
    ap.add_argument("--ragged-cap", type=int, default=None, help="the ragged batch's length cap (4096; smoke 48)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="token budget of the ragged sorted/packed microbatches (16384; smoke 96)")
    ap.add_argument("--json", default=None, help="where to write all results (default $OUT/train_step_gpu.json)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.smoke = args.smoke or args.device == "cpu"
    if args.host_overhead:
        args.batch, args.seq = args.batch or 2, args.seq or 16
        args.microbatch = args.microbatch or args.batch  # one microbatch: the step's fixed host cost
        args.warmup, args.steps = max(args.warmup, 3), max(args.steps, 40)
    args.batch = args.batch or (4 if args.smoke else 16)
    args.seq = args.seq or (64 if args.smoke else 1024)
    args.microbatch = args.microbatch or (2 if args.smoke else 8)
    if args.smoke:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
    args.ragged_batch = args.ragged_batch or (16 if args.smoke else 64)
    args.ragged_cap = args.ragged_cap or (48 if args.smoke else 4096)
    args.max_tokens = args.max_tokens or (96 if args.smoke else 16384)
    if args.run:
        run_one(args)
        return 0

    t_start = time.monotonic()
    budget_s = RAGGED_BUDGET_S if args.ragged else BUDGET_S
    cpu = args.smoke or args.host_overhead
    table = _table(args)
    names = [b.strip() for b in args.backends.split(",")] if args.backends else (
        (SMOKE_RAGGED_DEFAULT if args.smoke else RAGGED_DEFAULT) if args.ragged else list(table))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]) + os.pathsep +
           os.environ.get("PYTHONPATH", ""), "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rl_core_bench_") as tmp:
        if not cpu:
            import torch

            if not torch.cuda.is_available():
                print("no CUDA device: run with --device cpu (or --smoke) on a CPU", file=sys.stderr)
                return 2
        model_dir = build_model(Path(tmp) / "model", _shape(args), "cpu" if cpu else "cuda")
        for name in names:
            left = budget_s - (time.monotonic() - t_start)
            if name not in table:
                results[name] = {"backend": name, "failed": f"unknown variant (known: {', '.join(table)})"}
                continue
            if name.startswith("megatron") and importlib.util.find_spec("megatron") is None:
                results[name] = {"backend": name, "skipped": "megatron-core is not installed"}
                continue
            if left < 20 and not cpu:
                results[name] = {"backend": name, "skipped": f"time budget ({budget_s:.0f}s) used up"}
                continue
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--run", name, "--model-dir", str(model_dir), "--json", str(out),
                   "--batch", str(args.batch), "--seq", str(args.seq), "--microbatch", str(args.microbatch),
                   "--warmup", str(args.warmup + (1 if "compile" in name else 0)), "--steps", str(args.steps),
                   "--ragged-batch", str(args.ragged_batch), "--ragged-cap", str(args.ragged_cap),
                   "--max-tokens", str(args.max_tokens)]
            if args.smoke:
                cmd += ["--smoke", "--device", "cpu"]
            if args.host_overhead:
                cmd.append("--host-overhead")
            if args.profile:
                cmd.append("--profile")
            if args.host_profile:
                cmd.append("--host-profile")
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=None if cpu else max(20.0, left))
                if proc.returncode == 0:
                    results[name] = json.loads(out.read_text())
                else:
                    results[name] = {"backend": name, "failed": (proc.stderr or proc.stdout)[-2000:]}
            except subprocess.TimeoutExpired:
                results[name] = {"backend": name, "skipped": f"did not finish within the time budget ({left:.0f}s)"}
    if args.host_overhead:
        _print_host_table(results, args)
    elif args.ragged:
        print_ragged_table(results, PEAK_TFLOPS, args.batch, args.seq)
    else:
        _print_table({k: v for k, v in results.items() if "+ragged+" not in k}, args)
        if any("+ragged+" in k for k in results):
            print_ragged_table(results, PEAK_TFLOPS, args.batch, args.seq)
    if args.profile:
        print_profiles(results)
    for name, r in results.items():
        if r.get("host_profile"):
            print(f"\nhost profile of one step (cProfile), {name}:")
            print("\n".join(r["host_profile"]))
    summary = {"shape": _shape(args), "batch": args.batch, "seq": args.seq,
               "microbatch": args.microbatch, "peak_tflops": PEAK_TFLOPS, "smoke": args.smoke,
               "host_overhead": args.host_overhead, "load_average": os.getloadavg(),
               "step_tflop": step_flops(_shape(args), args.batch, args.seq) / 1e12,
               "wall_s": time.monotonic() - t_start, "results": results}
    write_json(summary, args.json, "train_step_gpu.json")
    return 0


def _print_table(results: dict[str, dict], args) -> None:
    print(f"\ntraining step, {args.batch} x {args.seq} tokens, microbatch {args.microbatch} "
          f"({'smoke: CPU, tiny shape' if args.smoke else 'Qwen2.5-0.5B shape, bf16'}); peak {PEAK_TFLOPS:.0f} TFLOP/s")
    print(f"{'backend':<28}{'mb':>4}{'step s':>9}{'TFLOP/s':>10}{'of peak':>9}{'vs torch':>10}{'mem GB':>8}"
          f"{'trainer MFU':>13}  note")
    base = results.get("torch", {}).get("tflops")
    for name, r in results.items():
        if "tflops" not in r:
            note = r.get("skipped") or "FAILED: " + (r.get("failed", "").strip().splitlines() or [""])[-1][:90]
            print(f"{name:<28}{'-':>4}{'-':>9}{'-':>10}{'-':>9}{'-':>10}{'-':>8}{'-':>13}  {note}")
            continue
        ratio = f"{r['tflops'] / base:.2f}x" if base else "-"
        mem = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        tm = f"{r['trainer_mfu'] * 100:.1f}%" if r.get("trainer_mfu") is not None else "-"
        print(f"{name:<28}{r['microbatch']:>4}{r['step_s']:>9.3f}{r['tflops']:>10.1f}{r['mfu'] * 100:>8.1f}%"
              f"{ratio:>10}{mem:>8}{tm:>13}  loss {r['loss']:.4f}")


def _print_host_table(results: dict[str, dict], args) -> None:
    """--host-overhead: CPU seconds of the process per step (min and median over the timed steps; the
    min is the least disturbed by other processes on a shared machine), wall time per step (median)
    and aten operators per step."""
    load = os.getloadavg()
    print(f"\nhost work per split step on CPU, {args.batch} x {args.seq} tokens in one microbatch, 24 layers 32 wide "
          f"(compute negligible); {args.steps} steps after {args.warmup} warm-up; load average {load[0]:.2f}")
    print(f"{'variant':<26}{'CPU ms min':>11}{'vs torch':>10}{'CPU ms med':>11}{'wall ms':>9}{'aten ops':>10}  note")
    base = results.get("torch", {}).get("cpu_steps_s")
    base = min(base) if base else None
    for name, r in results.items():
        if "step_s" not in r:
            note = r.get("skipped") or "FAILED: " + (r.get("failed", "").strip().splitlines() or [""])[-1][:90]
            print(f"{name:<26}{'-':>11}{'-':>10}{'-':>11}{'-':>9}{'-':>10}  {note}")
            continue
        cpu = r["cpu_steps_s"]
        ratio = f"{min(cpu) / base:.2f}x" if base else "-"
        print(f"{name:<26}{min(cpu) * 1e3:>11.1f}{ratio:>10}{statistics.median(cpu) * 1e3:>11.1f}"
              f"{r['step_s'] * 1e3:>9.1f}{r.get('aten_ops') or 0:>10}  loss {r['loss']:.6f}")


if __name__ == "__main__":
    sys.exit(main())

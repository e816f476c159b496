"""Native engine vs transformers `generate()` on a GPU, and the fraction of the weight-read roofline.

Run on a CUDA machine (one GPU):

    .venv/bin/python bench/generation_gpu.py                       # batch 64 and 256, all paths
    .venv/bin/python bench/generation_gpu.py --batch-sizes 64 --paths graph --skip-hf
    .venv/bin/python bench/generation_gpu.py --paths graph --compile --overlap --fused   # + the fused attention kernel
    .venv/bin/python bench/generation_gpu.py --paths graph --compile --overlap --fused --fused-mlp --only-fastest
                                                                   # + the fused gate/up + SiLU kernel
    .venv/bin/python bench/generation_gpu.py --paths graph --compile --overlap --fused --fused-mlp --only-fastest --fp8
                                                                   # each also on the FP8 KV cache (+fp8)

Model: Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14 query / 2 KV heads, MLP 4864, vocab
151,936, tied embeddings), random init, bf16. Workload per batch size B: B prompts of
`--prompt-len` random tokens, exactly `--new-tokens` new tokens each (no end token), sampled
at temperature 1. Everything is measured side by side in one run, best of `--repeats`
after a warm-up (which also captures the CUDA graphs); timings are never test assertions.

Reported per engine configuration: tokens/s end to end (prefill included), the median
decode-step time and decode-only tokens/s, the ratio to transformers `generate()` at the
same batch, and the fraction of the *weight-read roofline*: a decode step must read every
weight once, so at batch B it cannot exceed B / (weight_bytes / HBM bandwidth) tokens/s.
The bandwidth is measured here (a device-to-device copy of 2 GiB: bytes read + written
per second), or given with `--hbm-tbps`; both rooflines are printed. (KV-cache reads add to
the bytes per step; the "with KV" roofline includes them at the mean sequence length.)
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from contextlib import contextmanager

import torch


def qwen25_05b_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def measure_hbm_tbps(num_bytes: int = 2 * 2**30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), TB/s."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / best / 1e12


def weight_bytes(model: torch.nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def best_of(fn, repeats: int, warm: bool = True) -> tuple[float, int]:
    if warm:
        fn()  # warm-up (captures CUDA graphs, autotunes kernels)
    best, count = float("inf"), 0
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        count = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, count


def make_engine(model, cfg, prompts, new_tokens: int, path: str, kv_dtype: str, compile: bool, overlap: bool = False,
                attention: str = "torch"):
    from rl_core.generation import EngineOptions, NativeEngine

    batch, prompt_len = prompts.shape
    parts = attention.split("+")  # e.g. fused+mlp+cublas: decode_attention, decode_mlp, then twins (TWINS)
    return NativeEngine(cfg, model.state_dict(), EngineOptions(
        device="cuda", dtype=torch.bfloat16, max_batch_size=batch, max_seq_len=prompt_len + new_tokens + 8,
        eos_token_ids=[], decode_path=path, kv_cache_dtype=kv_dtype, decode_compile=compile, overlap_steps=overlap,
        decode_attention=parts[0], decode_mlp="fused" if "mlp" in parts else "torch"))


IDLE_STEPS = 48  # decode steps profiled by --idle


def device_idle(engine, rows: list, params, steps: int = IDLE_STEPS) -> dict:
    """The device's idle time over `steps` decode steps of a fresh run (torch.profiler), split
    into gaps of >= 5 us (the device waiting for the host: the step is host-bound there) and the
    shorter ones (mostly between the kernels of a graph replay), with the host code the long
    gaps are charged to (train_step_profile.device_gaps)."""
    from torch.profiler import ProfilerActivity, profile

    from rl_core.types import GenerationRequest, SamplingParams
    from train_step_profile import device_gaps

    short = SamplingParams(temperature=params.temperature, max_tokens=steps + 8)
    for i, p in enumerate(rows):
        engine.add_request(GenerationRequest(f"idle{i}", p, short))
    for _ in range(8):  # prefill and the first decode steps outside the window
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_work():
        engine.step()
    gaps = device_gaps(prof, top=4, min_us=5.0)
    return {"idle_ms": gaps["idle_ms"] / steps, "short_ms": gaps["short_ms"] / steps, "span_ms": gaps["span_ms"] / steps,
            "intervals": gaps["intervals"], "charged": gaps["innermost"]}


# The twins of the fused configurations: (flag, name suffix, module of rl_core.generation.native,
# module value, its value in the twin, what the twin runs). Some values are read when the engine is
# built, others at each kernel launch (so while its graphs are captured): `twin_switches` holds them
# for the whole run.
TWINS = [
    ("--cublas", "cublas", "fused_stack", "SPLIT_K", False,
     "the stack's output and down projections on cuBLAS + the compiled add + norm instead of the split-K kernels"),
    ("--cublas-qkv", "cublasqkv", "fused_stack", "TRITON_QKV", False, "the QKV projection on cuBLAS"),
    ("--unfused-head", "unfusedhead", "fused_sampling", "LM_HEAD", False,
     "the LM head on cuBLAS and the sampling's two passes after it"),
    ("--no-pdl", "nopdl", "triton_support", "PDL", False,
     "its Triton kernels launched without programmatic dependent launch"),
    ("--tile64", "tile64", "decode_attention", "SMALL_ROWS", 0,
     "the attention kernel's 64-key tile at every row count"),
    ("--cols-first", "colsfirst", "triton_support", "ROWS_FIRST", False,
     "the TMA matmul kernels' programs numbered column block first"),
]


@contextmanager
def twin_switches(attention: str):
    """The module values of the twins named in a configuration (e.g. fused+mlp+nopdl), set while it
    builds and runs its engine, then put back."""
    parts = attention.split("+")
    changed = [(importlib.import_module(f"rl_core.generation.native.{module}"), name, value)
               for _, suffix, module, name, value, _ in TWINS if suffix in parts]
    saved = [(module, name, getattr(module, name)) for module, name, _ in changed]
    try:
        for module, name, value in changed:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def run_native(model, cfg, prompts, new_tokens: int, path: str, kv_dtype: str, compile: bool, overlap: bool,
               repeats: int, attention: str = "torch", idle: bool = False) -> dict:
    """One configuration's run, its twins' module values set meanwhile (`twin_switches`)."""
    with twin_switches(attention):
        return _run_native(model, cfg, prompts, new_tokens, path, kv_dtype, compile, overlap, repeats, attention, idle)


def _run_native(model, cfg, prompts, new_tokens: int, path: str, kv_dtype: str, compile: bool, overlap: bool,
                repeats: int, attention: str, idle: bool) -> dict:
    from rl_core.types import GenerationRequest, SamplingParams

    batch = prompts.shape[0]
    built = time.perf_counter()
    engine = make_engine(model, cfg, prompts, new_tokens, path, kv_dtype, compile, overlap, attention)
    rows = prompts.tolist()
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)

    def once() -> int:
        for i, p in enumerate(rows):
            engine.add_request(GenerationRequest(str(i), p, params))
        n = 0
        while engine.has_work():
            n += sum(len(r.token_ids) for r in engine.step())
        return n

    first = time.perf_counter()
    once()  # warm-up outside best_of's: also times graph capture (and compilation)
    warmup_s = time.perf_counter() - first
    seconds, tokens = best_of(once, repeats, warm=False)
    decode = sorted(r.duration_s for r in list(engine.stats.trace)[-new_tokens:] if r.num_tokens == batch)
    step_ms = statistics.median(decode) * 1e3 if decode else float("nan")
    out = {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "step_ms": step_ms,
           "decode_tok_s": batch / (step_ms / 1e3) if decode else float("nan"),
           "graphs": engine.decoder.num_graphs if engine.decoder is not None else 0,
           "kv_gib": engine.cache.nbytes / 2**30, "build_s": first - built, "warmup_s": warmup_s}
    if idle:
        out["idle"] = device_idle(engine, rows, params)
    engine = None  # free the cache and graphs before empty_cache()
    torch.cuda.empty_cache()
    return out


def profile_decode(model, cfg, prompts, new_tokens: int, path: str, compile: bool, out_dir: str | None,
                   attention: str = "torch") -> dict:
    """Where a decode step's time goes: the whole `engine.step()`, the graph replay alone
    (CUDA events; when plain rows sample inside the step, the one graph of the step and its
    sampling), sampling alone (0 then, else the engine's sampler: parameters + kernels + the
    host copy), and the rest (host work: scheduling, index building, bookkeeping, launches). Also a torch.profiler table of
    10 steps (written under `out_dir` when given); the twins' module values set meanwhile."""
    with twin_switches(attention):
        return _profile_decode(model, cfg, prompts, new_tokens, path, compile, out_dir, attention)


def _profile_decode(model, cfg, prompts, new_tokens: int, path: str, compile: bool, out_dir: str | None,
                    attention: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from rl_core.generation.native.sampling import SamplingBatch, sample_tokens
    from rl_core.types import GenerationRequest, SamplingParams

    batch = prompts.shape[0]
    engine = make_engine(model, cfg, prompts, new_tokens, path, "auto", compile, attention=attention)
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)
    for i, p in enumerate(prompts.tolist()):
        engine.add_request(GenerationRequest(str(i), p, params))
    for _ in range(30):  # prefill, then decode steps in the 128-key bucket (its graph captured)
        engine.step()

    def timed(fn, n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    step_ms = timed(engine.step, 20)
    seqs = list(engine._running.values())
    slots = [s.slot for s in seqs]
    s, k = engine.decoder.buckets_for(slots)
    sampled = engine.decoder.graph_of(s, k, sampled=True)  # plain rows: the step and its sampling, one graph
    graph, logits = sampled or engine.decoder.graph_of(s, k, sampled=False)

    def device_ms(fn, n: int = 50) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    # Replaying rewrites the keys/values of the inputs left in the static buffers: the same values.
    replay_ms = device_ms(graph.replay)
    if sampled is not None:  # plain rows sample inside the step's graph: counted in the replay
        sample_ms = 0.0
    else:  # the engine samples the logits: parameters, kernels and the copy back, wall time
        rows = logits.index_select(0, torch.tensor(slots, device="cuda"))

        def sample_once():
            b = SamplingBatch.build([q.request.params for q in seqs], [q.generator for q in seqs], engine.generator,
                                    engine.device)
            out = sample_tokens(rows, b)
            torch.stack((out.tokens.double(), out.logprobs.double())).tolist()

        sample_ms = timed(sample_once, 50)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if out_dir:
        import os
        name = f"profile_b{batch}_{path}{'_compiled' if compile else ''}{'' if attention == 'torch' else '_' + attention}"
        with open(os.path.join(out_dir, name + ".txt"), "w") as f:
            f.write(table + "\n\n" + cpu_table)
        prof.export_chrome_trace(os.path.join(out_dir, name + ".json"))
    print(table[:6000])
    engine = None  # free the cache and graphs before empty_cache()
    torch.cuda.empty_cache()
    return {"step_ms": step_ms, "replay_ms": replay_ms, "sample_ms": sample_ms,
            "host_ms": step_ms - replay_ms - sample_ms, "bucket": (s, k)}


def run_hf(model, prompts, new_tokens: int, repeats: int) -> dict:
    prompt_len = prompts.shape[1]

    def once() -> int:
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                 top_k=None, top_p=None, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0, eos_token_id=None)
        return out[:, prompt_len:].numel()

    seconds, tokens = best_of(once, repeats)
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--paths", nargs="+", default=["graph", "eager"], choices=["graph", "static", "eager"])
    parser.add_argument("--fp8", action="store_true",
                        help="also run the graph path with the FP8 KV cache (named +fp8; with --overlap its overlap "
                             "twin too, with --fused their fused twins: e.g. graph+compile+overlap+fused+mlp+fp8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth for the roofline (default: measured)")
    parser.add_argument("--skip-hf", action="store_true", help="skip transformers generate()")
    parser.add_argument("--compile", action="store_true", help="also run each path with decode_compile (torch.compile)")
    parser.add_argument("--overlap", action="store_true",
                        help="also run the graph path with decode_compile (if --compile) and overlap_steps")
    parser.add_argument("--fused", action="store_true",
                        help="also run each graph/static configuration (model-dtype KV cache) with decode_attention "
                             "fused (the Triton RoPE + cache-write + attention kernel)")
    parser.add_argument("--fused-mlp", action="store_true",
                        help="with --fused: also run each fused configuration with decode_mlp fused (the gate/up "
                             "projection and SiLU gate in one Triton kernel)")
    for flag, suffix, module, name, value, what in TWINS:
        parser.add_argument(flag, action="store_true",
                            help=f"with --fused: also run each fused configuration with {what} ({module}.{name} "
                                 f"{value}; named +{suffix})")
    parser.add_argument("--lm-head-rows", type=int, default=None,
                        help="steps of up to this many rows sample through the fused LM head "
                             "(fused_sampling.LM_HEAD_ROWS; default: the module's)")
    parser.add_argument("--only-fastest", action="store_true",
                        help="with --compile --overlap: run only graph+compile+overlap (and its fused twin)")
    parser.add_argument("--profile", action="store_true",
                        help="at the first batch size, break one decode step down (replay / sampling / host) and "
                             "print a torch.profiler table")
    parser.add_argument("--out", default=None, help="directory for profiler tables and traces")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="run only these configurations, named as printed (e.g. graph+compile+overlap+fused+mlp)")
    parser.add_argument("--idle", action="store_true",
                        help=f"also profile {IDLE_STEPS} decode steps of each configuration: the device's idle time per step, "
                             "gaps of >= 5 us (the device waiting for the host) apart from shorter ones")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    if args.lm_head_rows is not None:
        from rl_core.generation.native import fused_sampling

        fused_sampling.LM_HEAD_ROWS = args.lm_head_rows

    from transformers import Qwen2ForCausalLM

    cfg = qwen25_05b_config()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    wbytes = weight_bytes(model)
    measured = measure_hbm_tbps()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; weights {wbytes / 1e9:.3f} GB (bf16, "
          f"tied embedding counted once); HBM copy bandwidth measured {measured:.2f} TB/s"
          + (f", given {args.hbm_tbps:.2f} TB/s" if args.hbm_tbps else ""))
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    configs = [(p, "auto", False, False) for p in args.paths]
    configs += [(p, "auto", True, False) for p in args.paths if args.compile and p != "eager"]
    configs += [("graph", "auto", args.compile, True)] if args.overlap else []
    if args.fp8:
        configs += [("graph", "fp8_e4m3", args.compile, False)] + ([("graph", "fp8_e4m3", args.compile, True)]
                                                                   if args.overlap else [])
    if args.only_fastest:
        configs = [c for c in configs if c[3]]
    configs = [c + ("torch",) for c in configs]
    if args.fused:  # the fused kernel reads and writes an FP8 cache too
        configs += [c[:4] + ("fused",) for c in configs if c[0] != "eager"]
        if args.fused_mlp:
            configs += [c[:4] + ("fused+mlp",) for c in configs if c[4] == "fused"]
        for flag, suffix, *_ in TWINS:
            if getattr(args, flag[2:].replace("-", "_")):  # each twin of every fused configuration so far
                configs += [c[:4] + (c[4] + "+" + suffix,) for c in configs if c[4].startswith("fused")]
    def name_of(path, kv, compiled, overlap, attention) -> str:
        return (path + ("+compile" if compiled else "") + ("+overlap" if overlap else "")
                + ("" if attention == "torch" else "+" + attention) + ("+fp8" if kv == "fp8_e4m3" else ""))

    if args.only:
        names = {name_of(*c) for c in configs}
        unknown = sorted(set(args.only) - names)
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: not among this run's configurations {sorted(names)} "
                         "(add --compile / --overlap / --fused / --fused-mlp / --fp8 to include them)")
        configs = [c for c in configs if name_of(*c) in args.only]
    for batch in args.batch_sizes:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        prompts = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), device="cuda", generator=gen)
        hf = None if args.skip_hf else run_hf(model, prompts, args.new_tokens, args.repeats)
        mean_len = args.prompt_len + args.new_tokens / 2
        roofs = {"measured": batch / (wbytes / (measured * 1e12))}
        roofs["measured, with KV"] = batch / ((wbytes + batch * mean_len * kv_per_token) / (measured * 1e12))
        if args.fp8:  # 1 byte a key/value element instead of 2
            roofs["measured, with FP8 KV"] = batch / ((wbytes + batch * mean_len * kv_per_token / 2) / (measured * 1e12))
        if args.hbm_tbps:
            roofs["given"] = batch / (wbytes / (args.hbm_tbps * 1e12))
        print(f"\nbatch {batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, bf16, Qwen2.5-0.5B shapes")
        print("  weight-read roofline: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in roofs.items()))
        if hf is not None:
            print(f"  transformers generate(): {hf['tok_s']:>10,.0f} tok/s ({hf['seconds']:.2f} s)")
        for path, kv, compiled, overlap, attention in configs:
            m = run_native(model, cfg, prompts, args.new_tokens, path, kv, compiled, overlap, args.repeats, attention,
                           idle=args.idle)
            ratio = f", {m['tok_s'] / hf['tok_s']:.1f}x generate()" if hf is not None else ""
            frac = ", ".join(f"{m['decode_tok_s'] / v:.1%} of {k}" for k, v in roofs.items())
            name = name_of(path, kv, compiled, overlap, attention)
            print(f"  native {name:<32} kv {kv:<8}: {m['tok_s']:>10,.0f} tok/s end to end{ratio}; decode step "
                  f"{m['step_ms']:.2f} ms = {m['decode_tok_s']:,.0f} tok/s ({frac}); graphs {m['graphs']}, "
                  f"KV cache {m['kv_gib']:.2f} GiB; build {m['build_s']:.1f} s, first run {m['warmup_s']:.1f} s",
                  flush=True)
            if "idle" in m:
                g = m["idle"]
                charged = "; ".join(f"{n} {ms / IDLE_STEPS:.3f}" for n, ms in g["charged"])
                print(f"    device per decode step ({IDLE_STEPS} profiled): span {g['span_ms']:.3f} ms, idle in gaps >= 5 us "
                      f"{g['idle_ms']:.3f} ms ({g['intervals']} gaps; charged per step to: {charged}), shorter gaps "
                      f"{g['short_ms']:.3f} ms", flush=True)
            if (args.profile and path == "graph" and kv == "auto" and (not overlap or args.only_fastest or args.only)
                    and batch == args.batch_sizes[0]):  # profiled without overlap (its own engine)
                b = profile_decode(model, cfg, prompts, args.new_tokens, path, compiled, args.out, attention)
                print(f"    step breakdown at bucket {b['bucket']}: step {b['step_ms']:.3f} ms = graph replay "
                      f"{b['replay_ms']:.3f} + sampling {b['sample_ms']:.3f} + host/other {b['host_ms']:.3f} ms",
                      flush=True)


if __name__ == "__main__":
    main()

"""The profiles of `bench/train_step_gpu.py` (`--profile`, `--host-profile`, `--host-overhead`'s
operator count): one split step under torch.profiler (device time by kernel category, the top
kernels and aten operators, the device's idle intervals charged to the code that launched the
next kernel, the generated source of the top compiled kernels) or cProfile, and their printing.
Does not own: the variants, the timing of steps or the results table (train_step_gpu.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


# Kernel-name patterns of the profile's categories, first match wins (cuBLAS/CUTLASS GEMM kernel
# names: "gemm", "nvjet", "sm90_xmma", "cutlass"; flash/memory-efficient attention: "flash", "fmha").
KERNEL_CATEGORIES = [
    ("matmul (GEMM)", ("gemm", "nvjet", "xmma", "cutlass", "splitk", "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax / logsumexp / reductions", ("softmax", "logsumexp", "reduce", "norm_kernel")),
    ("fused by compile (triton)", ("triton",)),
    ("copies and casts", ("copy", "cast", "memcpy", "memset", "fill")),
    ("element-wise (eager)", ("elementwise", "vectorized", "unrolled")),
]


def profile_step(trainer, loss, c, device: str, top: int = 12) -> dict:
    """Device time of one split step by kernel category and its `top` kernels (torch.profiler; on
    the CPU of --smoke, the self CPU time of its operators: a check of the code path only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from torch.autograd import DeviceType

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    # on CUDA the CPU operators too, so that each kernel's time is also attributed to the aten operator
    # that launched it (the `ops` list: which operator, at which shapes, spends the device time)
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    from torch.profiler import record_function

    with profile(activities=acts, record_shapes=cuda) as prof:
        with record_function("step.begin"):
            trainer.begin(loss)
        with record_function("step.train_microbatches"):
            trainer.train_microbatches(c)
        with record_function("step.finish"):
            trainer.finish()
        sync()
    kernels: dict[str, float] = {}
    ops: dict[str, float] = {}
    for evt in prof.key_averages(group_by_input_shape=cuda):
        if cuda and evt.device_type == DeviceType.CPU:  # an operator: the device time of its own kernels
            if evt.self_device_time_total > 0:
                key = f"{evt.key} {evt.input_shapes}"[:120]
                ops[key] = ops.get(key, 0.0) + evt.self_device_time_total / 1e3
            continue
        # a named range mirrored on the GPU timeline ("## Call CompiledFxGraph ... ##", "Optimizer.step#AdamW.step"):
        # it spans kernels counted on their own
        if getattr(evt, "is_user_annotation", False) or "#" in evt.key:
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if us > 0:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + us / 1e3
    total = sum(kernels.values()) or 1.0
    cats: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        cat = next((c for c, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")
        cats[cat] = cats.get(cat, 0.0) + ms
    return {"device_ms": total, "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
            "top": sorted(kernels.items(), key=lambda kv: -kv[1])[:top],
            "ops": sorted(ops.items(), key=lambda kv: -kv[1])[:2 * top],
            "gaps": device_gaps(prof, top) if cuda else None}


def device_gaps(prof, top: int = 12, min_us: float = 0.0) -> dict:
    """Where the device sits idle in the profiled step: every interval between the end of the kernels
    so far and the start of the next kernel (or copy) is charged to the host code that launched that
    next kernel, found through the launch's correlation id and the CPU ranges open on the launching
    thread at the launch (outermost: the step phase; then the first operator or range inside it; and
    the innermost operator). An idle interval is the host being late: Python, hooks, dispatch, or a
    synchronisation after which the queue had to refill. Intervals shorter than `min_us` are only
    summed (`short_ms`): inside a CUDA graph replay they are the device's own launch latency."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    finally:
        os.unlink(path)
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                    key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ranges: dict = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e and e.get("ph") == "X":
            ranges.setdefault(e["tid"], []).append(e)
    # the idle intervals, each with the launch event of the kernel that ended it
    idle = []
    short = 0.0
    end = None
    for k in device:
        if end is not None and k["ts"] - end >= max(min_us, 1e-9):
            idle.append((k["ts"] - end, launches.get(k.get("args", {}).get("correlation"))))
        elif end is not None and k["ts"] > end:
            short += k["ts"] - end
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    # the ranges open at each launch, per thread, by a sweep over the (properly nested) ranges
    stacks: dict[int, list] = {}
    by_tid: dict = {}
    for i, (_, launch) in enumerate(idle):
        if launch is not None:
            by_tid.setdefault(launch["tid"], []).append((launch["ts"], i))
    for tid, queries in by_tid.items():
        opened = sorted(ranges.get(tid, []), key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []
        j = 0
        for ts, i in sorted(queries):
            while j < len(opened) and opened[j]["ts"] <= ts:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < opened[j]["ts"]:
                    stack.pop()
                stack.append(opened[j])
                j += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            stacks[i] = [e for e in stack if e["ts"] + e["dur"] >= ts]
    by: dict[str, dict[str, float]] = {"phase": {}, "within": {}, "innermost": {}}
    for i, (us, launch) in enumerate(idle):
        stack = stacks.get(i, [])
        names = [e["name"] for e in stack]
        phase = names[0] if names and names[0].startswith("step.") else ("(no range)" if not names else
                                                                         f"(thread {launch['tid']}) {names[0]}")
        inner = names[1] if len(names) > 1 and names[0].startswith("step.") else (names[0] if names else "-")
        for key, name in (("phase", phase), ("within", f"{phase} > {inner}"),
                          ("innermost", names[-1] if names else "-")):
            by[key][name[:110]] = by[key].get(name[:110], 0.0) + us / 1e3
    span = (device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]) / 1e3 if device else 0.0
    return {"idle_ms": sum(us for us, _ in idle) / 1e3, "short_ms": short / 1e3, "span_ms": span, "intervals": len(idle),
            **{key: sorted(v.items(), key=lambda kv: -kv[1])[:top] for key, v in by.items()}}


def triton_sources(names: list[str], lines: int = 70) -> dict[str, str]:
    """The generated source of each compiled (Triton) kernel among `names`, from Inductor's cache
    directory of this process (the kernel's `def` and what follows, `lines` lines from its decorator):
    to read what a slow compiled kernel does (its fused operations, layouts and indexing)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    wanted = {n for n in names if n.startswith("triton_")}
    found: dict[str, str] = {}
    for path in Path(cache_dir()).rglob("*.py"):
        if not wanted - set(found):
            break
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for name in wanted - set(found):
            at = text.find(f"def {name}(")
            if at >= 0:
                start = text.rfind("@triton", 0, at)
                start = text.rfind("\n", 0, start if start >= 0 else at) + 1
                found[name] = "\n".join(text[start:].splitlines()[:lines])
    return found


def host_profile(trainer, loss, c, device: str, top: int = 25) -> list[str]:
    """The host's own work in one split step (cProfile, sorted by each function's own time): where
    the Python side of a backend spends the step while the device waits (a check of where a
    step is host-bound; cProfile's overhead inflates many small calls)."""
    import cProfile
    import io
    import pstats

    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    prof = cProfile.Profile()
    prof.enable()
    trainer.begin(loss)
    trainer.train_microbatches(c)
    trainer.finish()
    sync()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(top)
    stats.print_callers(r"method 'item'|method 'tolist'|_local_scalar_dense|cuda_synchronize")  # the step's host syncs
    return [line for line in buf.getvalue().splitlines() if line.strip()]


def count_ops(trainer, loss, c) -> int:
    """aten operators dispatched by one split step on the CPU (torch.profiler; each is at least one
    kernel launch on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.begin(loss)
        trainer.train_microbatches(c)
        trainer.finish()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def print_profiles(results: dict[str, dict]) -> None:
    """Device time of one profiled step per variant, by kernel category (ms and share)."""
    profiled = {n: r["profile"] for n, r in results.items() if r.get("profile")}
    if not profiled:
        return
    cats = [c for c, _ in KERNEL_CATEGORIES] + ["other"]
    print("\nprofile of one step: device ms by kernel category (share of the step's kernel time)")
    print(f"{'category':<36}" + "".join(f"{n[:26]:>28}" for n in profiled))
    for cat in cats:
        row = [p["categories"].get(cat, 0.0) for p in profiled.values()]
        if any(row):
            print(f"{cat:<36}" + "".join(f"{ms:>18.1f} ({ms / p['device_ms'] * 100:4.1f}%)"
                                         for ms, p in zip(row, profiled.values())))
    print(f"{'total kernel time':<36}" + "".join(f"{p['device_ms']:>28.1f}" for p in profiled.values()))
    for n, p in profiled.items():
        print(f"\ntop kernels, {n}:")
        for name, ms in p["top"]:
            print(f"  {ms:9.2f} ms  {name[:110]}")
        if p.get("ops"):
            print(f"top operators by their kernels' device time, {n}:")
            for name, ms in p["ops"]:
                print(f"  {ms:9.2f} ms  {name}")
        for name, src in (p.get("kernel_src") or {}).items():
            print(f"source of {name} (Inductor's cache):\n{src}\n")
        gaps = p.get("gaps")
        if gaps:
            print(f"device idle, {n}: {gaps['idle_ms']:.1f} ms in {gaps['intervals']} intervals of a "
                  f"{gaps['span_ms']:.1f} ms span (first kernel to last), charged to the code that launched "
                  "the kernel after each interval:")
            for key in ("phase", "within", "innermost"):
                print(f"  by {key}:")
                for name, ms in gaps[key]:
                    print(f"    {ms:9.2f} ms  {name}")

"""The two-GPU run of issue 8: a non-colocated RL loop with NCCL weight broadcast, and FSDP2 scaling.

On the x2 machine, in ONE device call (the wheels in .whl/ carry pydantic, fastapi, starlette,
uvicorn and opentelemetry-api, which its image lacks; `carry: [".whl"]`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:. && PYTHONUNBUFFERED=1 python3 bench/two_gpu.py --device cuda

It prints a short table and writes every number to $OUT/two_gpu.json (or --json PATH). The whole
run is time-boxed by RL_CORE_BENCH_BUDGET_S (default 420 s, so it ends well inside a 10-minute
call); a part that does not fit is reported as skipped. NVLink multicast stays off: this process
and every child run with NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
`--device cpu` runs the same code paths on a CPU (gloo, two processes, tiny shapes): a check, not a speed.

0. Device-to-device bandwidth: cuda = `copy_` of 1 GiB between cuda:0 and cuda:1 (both directions,
   plus pageable host<->device copies, the path refit's packing takes); cpu = memcpy of 256 MiB.
1. Non-colocated RL (the real controller, recipes/tiny-addition.yaml plus overrides): the fsdp2
   trainer (1 process) on GPU 0 in the controller process; generation = rl_core's native engine in
   an `rl-core serve` process on GPU 1 (`generation.backend: http`, `placement: separate`,
   `generation.http.local_server_cuda_devices: [1]`); after every RL step the weights go over NCCL
   (`trainer.weight_sync.type: broadcast`). Model on cuda: the recipe's task and tokenizer with the
   Qwen2.5-0.5B body (24 layers, hidden 896, 14/2 heads, MLP 4864; ~360 M parameters, fp32 weights,
   bf16 compute), warm-up off (rewards stay ~0: this part measures the system, not learning); on
   cpu: the recipe's tiny model. Reported from the run's metrics.jsonl: refit seconds and bytes
   (`refit/*`: export, pack incl. host->device copies, the bucket broadcasts alone, server load)
   and bytes/s against the measured bandwidth; from timeline.jsonl: the idle fraction of each side
   over the pumps' window = 1 - (union of its spans) / window, generation = `generate` spans (any
   group in flight), training = `train` spans (refit counted apart).
2. FSDP2 scaling: one training step of the split step API on the same global batch (cuda: the
   Qwen2.5-0.5B shape of bench/train_step_gpu.py, 16 x 1024 tokens, microbatch 8 per process) on
   1 process and on 2 processes (torchrun). tokens/s = batch tokens / median step time; scaling
   efficiency (strong scaling) = t1 / (2 * t2) = tokens/s(2 GPUs) / (2 * tokens/s(1 GPU)).
"""

from __future__ import annotations

import os

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)  # before torch is imported, in this process and (inherited) every child

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from train_step_gpu import PEAK_TFLOPS, SHAPE, SMOKE_SHAPE, chunk, step_flops, time_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-addition.yaml"
BUDGET_S = float(os.environ.get("RL_CORE_BENCH_BUDGET_S", "420"))
QWEN_BODY = ["model.tiny.hidden_size=896", "model.tiny.num_hidden_layers=24", "model.tiny.num_attention_heads=14",
             "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=4864", "model.tiny.rope_theta=1000000.0",
             "model.dtype=float32", "trainer.fsdp.mixed_precision=bf16", "trainer.microbatch_size=64"]
PART2 = {"cuda": dict(shape=SHAPE, batch=16, seq=1024, microbatch=8, warmup=2, steps=5),
         "cpu": dict(shape=SMOKE_SHAPE, batch=8, seq=64, microbatch=4, warmup=1, steps=3)}


def part1_overrides(device: str, steps: int, model: str, run_root: Path, extra: list[str]) -> list[str]:
    sets = [f"output_dir={run_root}", "run_name=part1", f"runtime.device={device}", f"grpo.max_num_steps={steps}",
            "model.warmup.enabled=false", "logging.tensorboard=false", "logging.progress='off'",
            "validation.val_at_start=false", "validation.val_at_end=false", "trainer.backend=fsdp2",
            "trainer.collective_timeout_s=300", "generation.backend=http", "generation.placement=separate",
            "generation.http.num_local_servers=1", "trainer.weight_sync.type=broadcast"]
    if device == "cuda":
        sets.append("generation.http.local_server_cuda_devices=[1]")
    else:
        sets += ["runtime.torch_num_threads=1", "generation.http.server_torch_num_threads=1"]
    return sets + (QWEN_BODY if model == "qwen0.5b-body" else []) + extra


# ---------------------------------------------------------------------------------------- children


def child_prepare(args) -> None:
    """Bandwidth measurements, and the HF model directory of part 2."""
    import torch

    from train_step_gpu import build_model

    out: dict = {"torch": torch.__version__, "env": {k: os.environ.get(k) for k in NO_MULTICAST}}
    if args.device == "cuda":
        out["num_gpus"] = torch.cuda.device_count()
        out["gpu"] = torch.cuda.get_device_name(0)
        out["p2p_access"] = torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1)
        n = 1 << 30
        bufs = {d: torch.empty(n, dtype=torch.uint8, device=d) for d in ("cuda:0", "cuda:1")}
        host = torch.empty(n, dtype=torch.uint8)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        for name, dst, src in (("d2d_0to1", bufs["cuda:1"], bufs["cuda:0"]),
                               ("d2d_1to0", bufs["cuda:0"], bufs["cuda:1"]), ("h2d_pageable", bufs["cuda:0"], host),
                               ("h2d_pinned", bufs["cuda:0"], pinned), ("d2h_pageable", host, bufs["cuda:0"])):
            out[name + "_gb_s"] = _copy_rate(dst, src, lambda: [torch.cuda.synchronize(i) for i in (0, 1)])
        out["d2d_gb_s"] = out["d2d_0to1_gb_s"]
        out["bytes"] = n
        del bufs
        torch.cuda.empty_cache()
    else:
        n = 256 << 20
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        out["d2d_gb_s"] = out["memcpy_gb_s"] = _copy_rate(a, b, lambda: None)
        out["bytes"] = n
    build_model(Path(args.model_dir), PART2[args.device]["shape"], "cuda:0" if args.device == "cuda" else "cpu")
    Path(args.json).write_text(json.dumps(out))


def _copy_rate(dst, src, sync, reps: int = 8) -> float:
    for _ in range(2):
        dst.copy_(src)
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    return reps * src.numel() * src.element_size() / (time.perf_counter() - t) / 1e9


def child_part1(args) -> None:
    """The controller run: recipe + overrides, the launch path's parts, no checkpoints (a bench)."""
    from rl_core.config import run_dir, write_resolved
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import ensure_policy, run_controller, setup_process
    from rl_core.train import start_trainer_group

    cfg = load_recipe(RECIPE, json.loads(args.overrides))
    rd = run_dir(cfg)
    write_resolved(cfg, rd)
    setup_process(cfg)
    if start_trainer_group(cfg):
        return
    t0 = time.monotonic()
    policy = ensure_policy(cfg, rd / "init_policy")
    init_s = time.monotonic() - t0
    summary = run_controller(cfg, rd, policy_dir=policy, val_at_start=False, val_at_end=False)
    Path(args.json).write_text(json.dumps({"summary": summary, "init_policy_s": init_s}))


def child_part2(args) -> None:
    """One process of the fsdp2 step (under torchrun); rank 0 times the steps and writes the JSON."""
    import torch

    from rl_core.algorithms.losses import make_loss
    from rl_core.config import apply_overrides, validate_dict
    from rl_core.train import close_trainer, make_trainer, start_trainer_group

    p = PART2[args.device]
    sets = ["trainer.backend=fsdp2", f"runtime.device={args.device}", f"trainer.microbatch_size={p['microbatch']}"]
    if args.device == "cuda":
        sets += ["model.dtype=float32", "trainer.fsdp.mixed_precision=bf16"]
    else:
        torch.set_num_threads(1)
    cfg = validate_dict(apply_overrides({}, sets))
    if start_trainer_group(cfg):
        return
    c = chunk(p["shape"]["vocab_size"], p["batch"], p["seq"])
    trainer = make_trainer(cfg, args.model_dir)
    try:
        times, metrics = time_steps(trainer, make_loss(cfg.loss), c, p["warmup"], p["steps"], args.device)
        world = trainer.dp_size
    finally:
        close_trainer(trainer)
    step_s = statistics.median(times)
    tokens = p["batch"] * p["seq"]
    flops = step_flops(p["shape"], p["batch"], p["seq"])
    Path(args.json).write_text(json.dumps({
        "world_size": world, "env": {k: os.environ.get(k) for k in NO_MULTICAST}, "step_s": step_s,
        "steps_s": times, "tokens_per_s": tokens / step_s, "tflops_per_gpu": flops / step_s / 1e12 / world,
        "mfu": flops / step_s / 1e12 / world / PEAK_TFLOPS,
        "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None}))


# ---------------------------------------------------------------------------------------- parent


class Runner:
    """Children in their own process group (killed whole at their deadline), inside the time box."""

    def __init__(self, args, tmp: Path):
        self.args, self.tmp, self.t0 = args, tmp, time.monotonic()
        self.dest: str | None = None
        self.saved_logs: set[Path] = set()
        self.env = {**os.environ, **NO_MULTICAST, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
                        [str(ROOT / "bench"), str(ROOT)] + [str(Path(p).resolve()) for p in
                                                            os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        if args.device == "cpu":
            self.env["OMP_NUM_THREADS"] = "1"

    def left(self) -> float:
        return BUDGET_S - (time.monotonic() - self.t0)

    def run(self, name: str, cmd: list[str], timeout_s: float) -> dict:
        """Run a child that writes JSON to tmp/<name>.json; {"failed"/"skipped": why} otherwise."""
        if timeout_s < 5:
            return {"skipped": f"time budget RL_CORE_BENCH_BUDGET_S={BUDGET_S:.0f}s used up"}
        log = self.tmp / f"{name}.log"
        t = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"skipped": f"did not finish within {timeout_s:.0f}s (time box)", "log": _tail(log)}
        out = self.tmp / f"{name}.json"
        if code != 0 or not out.exists():
            return {"failed": f"exit status {code}", "log": _tail(log)}
        return {**json.loads(out.read_text()), "wall_s": time.monotonic() - t}

    def save(self, result: dict, *extra_logs: Path) -> None:
        """Write the JSON so far (a killed call still leaves it) and every log beside it."""
        if not self.dest:
            return
        Path(self.dest).write_text(json.dumps(result, indent=1))
        logs = sorted(self.tmp.glob("*.log")) + [p for p in extra_logs if p.exists()]
        path = Path(self.dest).with_name(Path(self.dest).stem + "_logs.txt")
        with open(path, "a" if self.saved_logs else "w") as fh:
            for log in logs:
                if log not in self.saved_logs:
                    self.saved_logs.add(log)
                    fh.write(f"===== {log.name}\n{log.read_text(errors='replace')[-2_000_000:]}\n")

    def child(self, kind: str, *extra: str, name: str | None = None) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--device", self.args.device,
                "--json", str(self.tmp / f"{name or kind}.json"), *extra]


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=None, help="RL steps of part 1 (default: cuda 10, cpu 3)")
    ap.add_argument("--part1-model", choices=["qwen0.5b-body", "recipe"], default=None,
                    help="part 1's policy shape (default: cuda qwen0.5b-body, cpu recipe)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="extra recipe override (part 1)")
    ap.add_argument("--parts", default="1,2", help="which parts to run: 1, 2 or 1,2")
    ap.add_argument("--json", default=None, help="where to write all results (default $OUT/two_gpu.json)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        {"prepare": child_prepare, "part1": child_part1, "part2": child_part2}[args.child](args)
        return 0
    steps = args.steps or (10 if args.device == "cuda" else 3)
    model = args.part1_model or ("qwen0.5b-body" if args.device == "cuda" else "recipe")
    parts = {s.strip() for s in args.parts.split(",")}
    result: dict = {"device": args.device, "budget_s": BUDGET_S, "env": NO_MULTICAST}
    dest = args.json or (os.path.join(os.environ["OUT"], "two_gpu.json") if os.environ.get("OUT") else None)
    with tempfile.TemporaryDirectory(prefix="rl_core_two_gpu_") as tmp_name:
        tmp = Path(tmp_name)
        r = Runner(args, tmp)
        r.dest = dest
        prep = r.run("prepare", r.child("prepare", "--model-dir", str(tmp / "part2_model")), min(180, r.left()))
        result["bandwidth"] = prep
        if "failed" in prep or "skipped" in prep:
            result["error"] = f"the bandwidth/model preparation did not finish: {prep}"
        elif args.device == "cuda" and prep.get("num_gpus", 0) < 2:
            result["error"] = f"needs 2 GPUs, found {prep.get('num_gpus')}"
        else:
            if "1" in parts:
                sets = part1_overrides(args.device, steps, model, tmp / "runs", args.set)
                share = r.left() * (0.55 if "2" in parts else 1.0) if args.device == "cuda" else r.left()
                run = r.run("part1", r.child("part1", "--overrides", json.dumps(sets)), share)
                result["part1"] = part1_numbers(run, tmp / "runs" / "part1", steps, model, sets, prep)
                r.save(result, tmp / "runs" / "part1" / "servers" / "server0.log")
            if "2" in parts:
                result["part2"] = part2(r, tmp / "part2_model")
        result["wall_s"] = time.monotonic() - r.t0
        r.save(result)
    print_table(result)
    if dest:
        print(f"wrote {dest} (and the children's logs beside it)")
    failed = "error" in result or any("failed" in (result.get(k) or {}) for k in ("bandwidth", "part1"))
    return 1 if failed or any("failed" in v for v in (result.get("part2") or {}).get("runs", {}).values()) else 0


def part2(r: Runner, model_dir: Path) -> dict:
    """The fsdp2 step on 1 and on 2 processes (torchrun both), same global batch."""
    p = PART2[r.args.device]
    runs = {}
    for world in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port())] + r.child("part2", "--model-dir", str(model_dir),
                                                                          name=f"part2_w{world}")[1:]
        runs[f"world{world}"] = r.run(f"part2_w{world}", cmd, r.left() / (2 if world == 1 else 1) - 3)
    out = {"shape": p["shape"], "batch": p["batch"], "seq": p["seq"], "microbatch_per_process": p["microbatch"],
           "tokens_per_step": p["batch"] * p["seq"], "runs": runs,
           "definition": "strong scaling on one global batch: efficiency = t1 / (2 * t2) "
                         "= tokens/s(2 processes) / (2 * tokens/s(1 process)); t = median step seconds"}
    t1, t2 = runs["world1"].get("step_s"), runs["world2"].get("step_s")
    if t1 and t2:
        out.update(speedup=t1 / t2, scaling_efficiency=t1 / (2 * t2))
    return out


def _union(spans: list, lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted((max(s.start, lo), min(s.end, hi)) for s in spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def idle_fractions(timeline_path: Path) -> dict:
    """Idle fraction of each side over the pumps' window (first generation to last refit)."""
    from rl_core.controller.events import Timeline, overlap_seconds

    spans = [s for s in Timeline.read(timeline_path) if not s.kind.startswith("setup_")]  # setup: other clock
    gen = [s for s in spans if s.kind == "generate"]
    train = [s for s in spans if s.kind == "train"]
    refit = [s for s in spans if s.kind == "refit"]
    lo = min(s.start for s in gen + train)
    hi = max(s.end for s in gen + train + refit)
    window = hi - lo
    return {"window_s": window, "generation_busy_s": _union(gen, lo, hi), "train_busy_s": _union(train, lo, hi),
            "refit_busy_s": _union(refit, lo, hi),
            "generation_idle_frac": 1 - _union(gen, lo, hi) / window,
            "train_idle_frac": 1 - _union(train, lo, hi) / window,
            "trainer_side_idle_frac": 1 - _union(train + refit, lo, hi) / window,
            "overlap_frac": overlap_seconds(gen, train) / window}


def part1_numbers(run: dict, run_dir: Path, steps: int, model: str, sets: list[str], prep: dict) -> dict:
    out = {k: v for k, v in run.items() if k in ("failed", "skipped", "log", "wall_s", "init_policy_s", "summary")}
    out.update(model=model, rl_steps_asked=steps, overrides=sets)
    from rl_core.metrics.logger import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    if not rows:
        return out
    report = run_dir / "init_policy" / "init_report.json"
    if report.exists():
        out["num_parameters"] = json.loads(report.read_text()).get("num_parameters")
    keys = ("bytes", "seconds", "export_s", "update_s", "sync_header_s", "sync_pack_s", "sync_broadcast_s",
            "sync_recv_s", "sync_load_s", "sync_deliver_s", "sync_group_init_s")
    per_step = [{"step": r["step"], **{k: r.get(f"refit/{k}") for k in keys},
                 **{k: r.get(f"timing/{k}") for k in ("gc_s", "gc_max_pause_s", "gc_full_collections")}}
                for r in rows]
    out["refit_per_step"] = per_step
    out["refit_every_step"] = (len(rows) == steps and [r["step"] for r in rows] == list(range(1, steps + 1))
                               and all((r.get("refit/bytes") or 0) > 0 for r in rows)
                               and rows[-1].get("generation/weight_updates") == steps
                               and rows[-1].get("generation/weight_version") == steps)
    steady = per_step[1:] or per_step  # the first refit also forms the group
    med = {k: statistics.median(s[k] or 0.0 for s in steady) for k in keys}
    d2d = prep.get("d2d_gb_s") or 0.0
    gbs = lambda sec: med["bytes"] / sec / 1e9 if sec else 0.0  # noqa: E731
    out["refit"] = {"median_over_steps": [s["step"] for s in steady], **med,
                    "update_gb_s": gbs(med["update_s"]), "broadcast_gb_s": gbs(med["sync_broadcast_s"]),
                    "d2d_gb_s": d2d, "update_frac_of_d2d": gbs(med["update_s"]) / d2d if d2d else None,
                    "broadcast_frac_of_d2d": gbs(med["sync_broadcast_s"]) / d2d if d2d else None}
    if (run_dir / "timeline.jsonl").exists():
        out["idle"] = idle_fractions(run_dir / "timeline.jsonl")
        busy = rows[-1].get("generation/servers_busy_s")
        if busy is not None:
            out["idle"]["engine_busy_s"] = busy
    return out


def print_table(res: dict) -> None:
    bw = res.get("bandwidth", {})
    print(f"\ntwo-GPU run ({res['device']}), time box {res['budget_s']:.0f}s, wall {res.get('wall_s', 0):.0f}s")
    if "h2d_pageable_gb_s" in bw:
        print(f"device-to-device copy cuda:0->cuda:1 {bw['d2d_gb_s']:.1f} GB/s (1->0 {bw['d2d_1to0_gb_s']:.1f}, peer "
              f"access {bw['p2p_access']}); host->device pageable {bw['h2d_pageable_gb_s']:.1f}, pinned "
              f"{bw['h2d_pinned_gb_s']:.1f}; device->host pageable {bw['d2h_pageable_gb_s']:.1f}")
    elif "d2d_gb_s" in bw:
        print(f"CPU memcpy (the D2D reference on CPU): {bw['d2d_gb_s']:.1f} GB/s")
    if "error" in res:
        print("ERROR:", res["error"])
    p1 = res.get("part1")
    if p1:
        print(f"part 1: fsdp2 trainer + rl-core serve (native engine) in separate processes, broadcast refit, "
              f"{p1['model']} ({p1.get('num_parameters') or '?'} params)")
        if "refit" in p1:
            f = p1["refit"]
            frac = lambda x: f"{x:.3f} of D2D" if x is not None else "-"  # noqa: E731
            print(f"  refit every step: {p1['refit_every_step']}; median {f['bytes'] / 1e6:.1f} MB: update "
                  f"{f['update_s']:.3f}s = {f['update_gb_s']:.2f} GB/s ({frac(f['update_frac_of_d2d'])}); "
                  f"broadcast alone {f['sync_broadcast_s']:.4f}s = {f['broadcast_gb_s']:.2f} GB/s "
                  f"({frac(f['broadcast_frac_of_d2d'])})")
            print(f"  parts: export {f['export_s']:.3f}s, pack {f['sync_pack_s']:.3f}s, "
                  f"header {f['sync_header_s']:.3f}s,"
                  f" server recv {f['sync_recv_s']:.3f}s + load {f['sync_load_s']:.3f}s")
        if "idle" in p1:
            i = p1["idle"]
            print(f"  idle fraction over {i['window_s']:.1f}s: generation {i['generation_idle_frac']:.2f}, training "
                  f"{i['train_idle_frac']:.2f} (with refit {i['trainer_side_idle_frac']:.2f}); both busy "
                  f"{i['overlap_frac']:.2f}")
        steps = p1.get("refit_per_step") or []
        if steps:
            slow = max(steps, key=lambda r: r["seconds"] or 0.0)
            gc_max = max((r["gc_max_pause_s"] or 0.0) for r in steps)
            print(f"  slowest refit {slow['seconds']:.3f}s (step {slow['step']}); controller GC: longest pause "
                  f"{gc_max:.3f}s, full collections {sum(r['gc_full_collections'] or 0 for r in steps):.0f}")
        for k in ("failed", "skipped"):
            if k in p1:
                print(f"  {k.upper()}: {p1[k]}\n{p1.get('log', '')[-1500:]}")
    p2 = res.get("part2")
    if p2:
        print(f"part 2: fsdp2 step, {p2['batch']} x {p2['seq']} tokens, "
              f"microbatch {p2['microbatch_per_process']}/process")
        print(f"  {'processes':<10}{'step s':>9}{'tokens/s':>11}{'TFLOP/s/GPU':>13}  note")
        for name, run in p2["runs"].items():
            if "step_s" in run:
                print(f"  {run['world_size']:<10}{run['step_s']:>9.3f}{run['tokens_per_s']:>11.0f}"
                      f"{run['tflops_per_gpu']:>13.1f}  loss {run['loss']:.4f}")
            else:
                why = run.get("skipped") or run.get("failed")
                print(f"  {name:<10}{'-':>9}{'-':>11}{'-':>13}  {why}\n{run.get('log', '')[-1500:]}")
        if "scaling_efficiency" in p2:
            print(f"  scaling efficiency t1 / (2 t2) = {p2['scaling_efficiency']:.3f} (speed-up {p2['speedup']:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())

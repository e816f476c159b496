"""Helpers of the trainer-backend tests: tiny HF models on disk, and `check_step` runs in
subprocesses (1 process, or N processes under torchrun) whose results are compared."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.net import free_port  # noqa: F401  (re-exported: the tests that import it from here)

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96


def tiny_hf_dir(out: Path, arch: str = "qwen2", tied: bool = False, seed: int = 0) -> Path:
    """A random-init Qwen2/Llama (GQA 4 heads / 2 kv heads, 2 layers, vocab 96) saved as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=64, initializer_range=0.2,
                  tie_word_embeddings=tied)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random q/k/v biases, so that a wrong bias layout shows
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(out)
    return out


def run_check(model_dir: Path, out_dir: Path, backend: str, nproc: int = 1, *sets: str, steps: int = 2,
              num_samples: int = 12, mask_every: int = 0, timeout_s: float = 240) -> tuple[dict, dict[str, torch.Tensor]]:
    """Run `rl_core.train.check_step` (under torchrun when nproc > 1); returns (result, weights)."""
    from safetensors.torch import load_file

    tag = f"{backend}-{nproc}-{abs(hash(sets)) % 10**8}-{steps}-{mask_every}"
    out, weights = out_dir / f"{tag}.json", out_dir / f"{tag}.safetensors"
    args = ["-m", "rl_core.train.check_step", str(model_dir), "--backend", backend, "--out", str(out),
            "--save-weights", str(weights), "--steps", str(steps), "--num-samples", str(num_samples),
            "--mask-every", str(mask_every)]
    for s in sets:
        args += ["--set", s]
    if nproc == 1 and backend == "torch":  # no process group: run in this process (saves the start-up)
        from rl_core.train.check_step import main

        threads = torch.get_num_threads()
        try:
            assert main(args[2:]) == 0
        finally:
            torch.set_num_threads(threads)
        return json.loads(out.read_text()), load_file(str(weights))
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    else:
        cmd = [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NUM_TASKS"):
        env.pop(k, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), load_file(str(weights))


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_same_step(ref: dict, got: dict, rel: float) -> None:
    """Per-step loss and gradient norm within `rel` (relative; absolute for values near 0)."""
    assert len(ref["steps"]) == len(got["steps"])
    for i, (r, g) in enumerate(zip(ref["steps"], got["steps"])):
        assert r["num_tokens"] == g["num_tokens"]
        for key in ("loss", "grad_norm"):
            tol = rel * max(1.0, abs(r[key]))
            assert abs(r[key] - g[key]) <= tol, f"step {i} {key}: {r[key]} vs {g[key]} (tolerance {tol:g})"


def assert_same_flops(ref: dict, got: dict) -> None:
    """Every step reports the same model FLOPs (`flops/total`, `flops/train`): all ranks' passes counted once."""
    for i, (r, g) in enumerate(zip(ref["steps"], got["steps"])):
        for key in ("flops_total", "flops_train"):
            assert r[key] and g[key] == pytest.approx(r[key], rel=1e-9), f"step {i} {key}: {r[key]} vs {g[key]}"


class Collective:
    """Rank 0's side of a collective that only ends when its peer's process is gone (as gloo's does)."""

    def _spmd_noop(self) -> None:
        pass

    def _spmd_wait(self, pid: int) -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError("Connection closed by peer") from None
            if open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z":
                raise RuntimeError("Connection closed by peer")
            time.sleep(0.05)


CHANNEL_WORKER = """
import sys
from datetime import timedelta
import torch.distributed as dist
from rl_core.train.spmd import CommandChannel

class Target:  # every command's body does nothing on the worker
    def __getattr__(self, name):
        return lambda *args, **kwargs: None

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=timedelta(seconds=60))
CommandChannel(1, 2, store=store).serve(lambda **kwargs: Target())
"""


@contextlib.contextmanager
def channel_worker():
    """Rank 0's TCP store and a real worker process serving `CommandChannel` commands on it
    (rank 1 of 2, every command a no-op); the worker is killed at the end if still there."""
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    worker = subprocess.Popen([sys.executable, "-c", CHANNEL_WORKER, str(port)], cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        yield store, worker
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def train_as_ranks(out: Path, name: str, args: list[str], fault: str | None = None, nranks: int = 2,
                   timeout_s: float = 900) -> tuple[int, str, float]:
    """`rl-core train RECIPE-ARGS` as `nranks` processes on this host, each told its rank as torchrun tells
    it (RANK, WORLD_SIZE, MASTER_*) but with no agent that ends rank 0 when another rank dies (as Slurm
    and submitit start tasks). `fault` (RL_CORE_TRAINER_FAULT) goes to rank 1 only. Returns rank 0's
    exit code, its output and the wall seconds until it exited."""
    cmd = [sys.executable, "-m", "rl_core.launch.cli", "train", *args, f"output_dir={out}", f"run_name={name}"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    base.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", WORLD_SIZE=str(nranks),
                LOCAL_WORLD_SIZE=str(nranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    t0 = time.monotonic()
    procs = []
    for rank in range(nranks):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        if fault and rank == 1:
            env["RL_CORE_TRAINER_FAULT"] = fault
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        text, _ = procs[0].communicate(timeout=timeout_s)
        wall = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return procs[0].returncode, text, wall

"""Local `rl-core serve` processes that an `HttpBackend` starts, watches and stops.

Owns: the command line of a local server (bound to 127.0.0.1 on a port the OS picks, so
nothing can race for it; a random per-backend token passed through the environment, never
on the command line; `--managed` with a fresh random control secret per launch, also
through the environment, which the server removes from its own environment once read),
launching it with its output in a log file, waiting for its ready
file (written by the server once it accepts connections; an early exit raises with the
log's tail), and stopping it by PID (SIGTERM, then SIGKILL after a grace period).

Does not own: talking HTTP to the servers (backend.py) or what a server does
(rl_core.serve, rl_core.launch.serve).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rl_core.errors import EngineOptionsError
from rl_core.generation.native.options import EngineOptions

TOKEN_ENV = "RL_CORE_LOCAL_SERVER_TOKEN"
CONTROL_SECRET_ENV = "RL_CORE_LOCAL_SERVER_CONTROL_SECRET"


@dataclass
class EngineArgs:
    """A local server: its native engine (`EngineOptions`, passed on as `rl-core serve` flags),
    and its process (intra-op threads, extra flags, the GPU it sees).

    The server takes its end ids and `decode` from its tokenizer, its weight version from
    `LocalServer`, and its step budget from its own default: options that set those are refused."""

    options: EngineOptions = field(default_factory=EngineOptions)
    torch_num_threads: int | None = None
    extra: Sequence[str] = field(default_factory=tuple)
    cuda_devices: Sequence[int] = ()  # server i sees only GPU cuda_devices[i] (CUDA_VISIBLE_DEVICES); empty: all
    lockstep: bool = False  # `rl-core serve --lockstep` (reproducible runs)

    def __post_init__(self) -> None:
        defaults = EngineOptions()
        for name in ("eos_token_ids", "decode", "max_step_tokens", "weight_version"):
            if getattr(self.options, name) != getattr(defaults, name):
                raise EngineOptionsError(name, getattr(self.options, name),
                                         f"its default for a local server ({getattr(defaults, name)!r}; the server "
                                         "takes it from its tokenizer, its launch or its own default)",
                                         f"leave {name} unset in the options of a local server.")

    def flags(self) -> list[str]:
        o = self.options
        dtype = o.dtype if isinstance(o.dtype, str) else str(o.dtype).removeprefix("torch.")
        out = ["--device", str(o.device), "--dtype", dtype, "--max-batch-size", str(o.max_batch_size),
               "--kv-cache-dtype", o.kv_cache_dtype, "--kv-scale-margin", str(o.kv_scale_margin),
               "--decode-path", o.decode_path, "--seed", str(o.seed)]
        for flag, value in (("--max-seq-len", o.max_seq_len), ("--max-num-kv-tokens", o.max_num_kv_tokens),
                            ("--torch-num-threads", self.torch_num_threads)):
            if value is not None:
                out += [flag, str(value)]
        if o.decode_compile:
            out.append("--decode-compile")
        if o.overlap_steps:
            out.append("--overlap-steps")
        if o.decode_attention != "torch":
            out += ["--decode-attention", o.decode_attention]
        if o.decode_mlp != "torch":
            out += ["--decode-mlp", o.decode_mlp]
        if self.lockstep:
            out.append("--lockstep")
        return out + list(self.extra)


class LocalServer:
    """One `rl-core serve` child process on this machine (bound to 127.0.0.1)."""

    bind_host = "127.0.0.1"
    remote = False  # True: on another node (reached by its node's name; see slurm_servers.py)

    def __init__(self, index: int, model_dir: str | Path, engine: EngineArgs, token: str, log_dir: str | Path,
                 model_name: str, weight_version: int = 0):
        self.index = index
        self.model_dir = str(model_dir)
        self.engine = engine
        self.token = token
        self.log_dir = Path(log_dir)
        self.model_name = model_name
        self.weight_version = weight_version
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.launches = 0
        self.control_secret: str | None = None  # new at every launch (the /rl/* routes' X-RL-Core-Secret)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"server{self.index}.log"

    @property
    def ready_path(self) -> Path:
        return self.log_dir / f"server{self.index}.ready.json"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "rl_core.launch.cli", "serve", self.model_dir, "--host", self.bind_host,
                "--port", "0", "--ready-file", str(self.ready_path), "--api-key-env", TOKEN_ENV,
                "--managed", "--control-secret-env", CONTROL_SECRET_ENV,
                "--served-model-name", self.model_name, "--weight-version", str(self.weight_version),
                *self.engine.flags()]

    def environment(self) -> dict[str, str]:
        """The process's environment: this one's, plus the token and a fresh control secret
        (never on the command line), and the GPU of `engine.cuda_devices`."""
        env = dict(os.environ)
        env[TOKEN_ENV] = self.token
        self.control_secret = secrets.token_urlsafe(32)
        env[CONTROL_SECRET_ENV] = self.control_secret
        if self.engine.cuda_devices:  # an index among this process's visible GPUs
            visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            index = self.engine.cuda_devices[self.index]
            env["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
        return env

    def launch(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for it to serve)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_path.unlink(missing_ok=True)
        env = self.environment()
        with open(self.log_path, "a") as log:
            log.write(f"--- launch {self.launches + 1}: {' '.join(self.command())}\n")
            log.flush()
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.launches += 1
        self.url = None

    def wait_ready(self, timeout_s: float) -> str:
        """Block until the ready file appears; returns the base URL."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_path.exists():
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"local generation server {self.index} exited (status {code}) before serving; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"local generation server {self.index} did not serve within {timeout_s:.0f}s "
                                   f"(generation.http.startup_timeout_s); see {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)
        info = json.loads(self.ready_path.read_text())
        self.url = self.url_of(info)
        return self.url

    def url_of(self, ready: dict) -> str:
        """The base URL of the server that wrote the ready file `ready` ({host, port, ...})."""
        return f"http://127.0.0.1:{ready['port']}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM by PID, SIGKILL after `grace_s`; waits for the exit."""
        if self.proc is not None:
            stop_process(self.proc, grace_s)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process by its PID, SIGKILL if it has not exited after `grace_s`; waits for the exit."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

"""Helpers of the serving tests: a tiny HF model directory (byte-level BPE tokenizer with a
ChatML chat template), `rl-core serve` run as a real subprocess on a free port, stopped
by its PID, and the in-process engine's results that the servers' answers are checked against."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_core.generation import EngineOptions, NativeEngine
from rl_core.generation.http.servers import stop_process
from rl_core.model.tokenizer import GENERIC_CORPUS, train_bpe, wrap_tokenizer
from tests.helpers.engine_models import run

ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = "RL_CORE_TEST_TOKEN"
CONTROL_ENV = "RL_CORE_TEST_CONTROL_SECRET"
SECRET = "test-control-secret-0123456789"  # for servers started with managed=True
CONTROL = {"X-RL-Core-Secret": SECRET}  # the header of the /rl/* control routes


def make_tokenizer():
    return wrap_tokenizer(train_bpe(list(GENERIC_CORPUS) * 2, 300), model_max_length=512)


def make_model(tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    """A random Qwen2 (hidden 64, 2 layers, GQA 4/2 heads, 512 positions); init std 0.3 so that
    greedy outputs vary from prompt to prompt and from seed to seed."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.3, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    return Qwen2ForCausalLM(cfg).eval()


def make_model_dir(path: Path, seed: int = 0) -> Path:
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def engine_results(model_dir: Path, requests, max_batch_size: int, state_dict=None) -> dict:
    """The requests through an in-process engine over `model_dir` (with `state_dict` loaded as
    version 1 first), by request id: what a server started with the same settings answers."""
    engine = NativeEngine.from_pretrained(model_dir, EngineOptions(max_batch_size=max_batch_size))
    if state_dict is not None:
        engine.update_weights(1, state_dict)
    return run(engine, requests)


def serve_command(model_dir: Path, ready_file: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "rl_core.launch.cli", "serve", str(model_dir), "--port", "0",
            "--ready-file", str(ready_file), "--torch-num-threads", "1", "--api-key-env", TOKEN_ENV, *args]


@contextlib.contextmanager
def running_server(model_dir: Path, workdir: Path, *args: str, token: str | None = None, managed: bool = False,
                   timeout_s: float = 120.0):
    """Start `rl-core serve` (port 0), wait for its ready file, yield (url, process); stop it by PID.
    `managed`: with --managed and the control secret SECRET (send the header CONTROL)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"ready-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, CONTROL_ENV)}
    if token is not None:
        env[TOKEN_ENV] = token
    if managed:
        env[CONTROL_ENV] = SECRET
        args = (*args, "--managed", "--control-secret-env", CONTROL_ENV)
    log = open(workdir / f"{ready.stem}.log", "w")
    proc = subprocess.Popen(serve_command(model_dir, ready, *args), env=env, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {(workdir / (ready.stem + '.log')).read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid
        yield info["url"], proc  # http://127.0.0.1:<port>, or http://[::1]:<port> for --host ::1
    finally:
        stop_process(proc)
        log.close()


"""`rl-core serve MODEL_DIR`: the native engine behind an OpenAI-compatible HTTP server.

Owns: the command's options, the checks made before anything expensive (the model
directory, the token rule, binding the port), building the engine from an HF directory,
and running uvicorn on the socket bound here (so `--port 0` picks a free port with no
race, and `--ready-file` tells a parent process where the server listens once it accepts
connections).

Token rule: bound to a loopback address (127.0.0.1, ::1, localhost; the default) the
server needs no token; bound to any other address it refuses to start without one. The
token is read from the environment variable named by `--api-key-env` (default
`RL_CORE_API_KEY`) or from `--api-key-file`, never from the command line (other users
can read command lines). When a token is set, every route but `/health` requires
`Authorization: Bearer <token>`.

Does not own: the routes (rl_core.serve.app) or the engine (rl_core.generation).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import socket
from pathlib import Path

from rl_core.errors import UserError

DEFAULT_API_KEY_ENV = "RL_CORE_API_KEY"


class ServeError(UserError):
    """A `rl-core serve` option that cannot be used (printed without a traceback)."""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="HF model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback addresses need a token)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port; see --ready-file)")
    p.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV,
                   help="environment variable holding the bearer token (default %(default)s)")
    p.add_argument("--api-key-file", help="file holding the bearer token (instead of the environment)")
    p.add_argument("--served-model-name", help="model id in the API (default: the directory name)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="sequences decoded together (KV cache slots); default: as many as fit in "
                        "--kv-cache-memory-fraction of the memory available at start, at most 256")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.3,
                   help="share of the available memory (GPU free memory on CUDA, host memory on CPU) the KV cache "
                        "may take when --max-batch-size is not given (default %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=None, help="prompt + completion tokens per sequence")
    p.add_argument("--max-num-kv-tokens", type=int, default=None, help="KV token budget across running sequences")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                   help="fp8_e4m3: FP8 KV cache, scales recalibrated at every weight update")
    p.add_argument("--kv-scale-margin", type=float, default=2.0, help="FP8 scale headroom over the calibration max")
    p.add_argument("--decode-path", choices=["auto", "eager", "static", "graph"], default="auto")
    p.add_argument("--decode-compile", action="store_true",
                   help="compile the static/graph decode step's layers with torch.compile")
    p.add_argument("--overlap-steps", action="store_true",
                   help="launch each plain decode step before the previous step's tokens are read back")
    p.add_argument("--seed", type=int, default=0, help="seed of requests sent without one")
    p.add_argument("--weight-version", type=int, default=0, help="weight version of MODEL_DIR's weights")
    p.add_argument("--torch-num-threads", type=int, default=None, help="intra-op CPU threads")
    p.add_argument("--ready-file", help="write {host, port, url, pid} here (atomically) once serving")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: treat as reachable from outside
        return False


def read_token(args) -> str | None:
    if args.api_key_file:
        path = Path(args.api_key_file)
        if not path.is_file():
            raise ServeError(f"--api-key-file {path} does not exist; expected a file holding the token. "
                             "Fix: write the token to that file, or use --api-key-env.")
        token = path.read_text().strip()
        if not token:
            raise ServeError(f"--api-key-file {path} is empty; expected the token. Fix: write a token into it.")
        return token
    token = os.environ.get(args.api_key_env, "").strip()
    return token or None


def check_token_rule(host: str, token: str | None, api_key_env: str) -> None:
    if token is None and not is_loopback(host):
        raise ServeError(
            f"--host {host} is not a loopback address and no token is set; expected a token whenever the server is "
            f"reachable from other machines. Fix: set the environment variable {api_key_env} (or --api-key-file) "
            "to a secret token, or bind --host 127.0.0.1.")


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ServeError(f"MODEL_DIR {path} is not an HF model directory; expected config.json and *.safetensors "
                         "(and a tokenizer) in it. Fix: pass a directory saved with save_pretrained.")
    return path


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"--host {host} --port {port} cannot be bound ({exc.strerror}); expected a free port on a "
                         "local address. Fix: choose another --port (0 = any free port) or a local --host.") from None
    return sock


def plan_kv_cache(args, config: dict, device: str, dtype: str) -> str:
    """Sets `args.max_batch_size` (KV-cache slots) from the memory available when it was not given;
    an explicit one that cannot fit, or a cache that cannot hold one sequence, is a ServeError."""
    from rl_core.generation.engine import DEFAULT_MAX_SEQ_LEN_CAP
    from rl_core.generation.kv_sizing import KVSizingError, available_memory, plan_kv_slots
    from rl_core.generation.model import ModelSpec

    if not 0 < args.kv_cache_memory_fraction <= 1:
        raise ServeError(f"--kv-cache-memory-fraction is {args.kv_cache_memory_fraction}; expected a number in (0, 1]. "
                         "Fix: pass e.g. --kv-cache-memory-fraction 0.3.")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ServeError(f"--max-batch-size is {args.max_batch_size}; expected an integer >= 1. Fix: pass a positive "
                         "number, or leave it out to size the KV cache from memory.")
    try:
        spec = ModelSpec.from_config(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ServeError(f"{Path(args.model_dir) / 'config.json'} cannot be used: {exc}. Fix: serve a directory "
                         "saved with save_pretrained of a supported architecture.") from None
    max_seq_len = args.max_seq_len or min(spec.max_position_embeddings, DEFAULT_MAX_SEQ_LEN_CAP)  # as the engine
    try:
        plan = plan_kv_slots(spec, max_seq_len, dtype, args.kv_cache_dtype, available_memory(device),
                             args.max_batch_size, args.kv_cache_memory_fraction)
    except KVSizingError as exc:
        raise ServeError(str(exc)) from None
    args.max_batch_size = plan.slots
    return plan.describe(max_seq_len)


def build_app(args, token: str | None):
    """Tokenizer, engine, backend and app (the expensive part)."""
    import torch
    from transformers import AutoTokenizer

    from rl_core.generation.backend import NativeBackend
    from rl_core.generation.engine import NativeEngine
    from rl_core.generation.model import read_config
    from rl_core.serve.app import ServerSettings, create_app

    if args.torch_num_threads:
        torch.set_num_threads(args.torch_num_threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ServeError("--device cuda: no CUDA device is visible; expected a GPU. Fix: use --device cpu or auto.")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    config = read_config(args.model_dir)
    raw = config.get("eos_token_id")
    eos = set(raw if isinstance(raw, list) else [] if raw is None else [raw])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    kv = plan_kv_cache(args, config, device, dtype)
    print(f"[serve] {kv}", flush=True)
    try:
        engine = NativeEngine.from_pretrained(
            args.model_dir, device=device, dtype=dtype, max_batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len, eos_token_ids=sorted(eos), seed=args.seed,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), weight_version=args.weight_version,
            max_num_kv_tokens=args.max_num_kv_tokens, kv_cache_dtype=args.kv_cache_dtype,
            kv_scale_margin=args.kv_scale_margin, decode_path=args.decode_path,
            decode_compile=args.decode_compile, overlap_steps=args.overlap_steps)
    except ValueError as exc:
        raise ServeError(f"cannot build the engine: {exc}") from None
    name = args.served_model_name or Path(args.model_dir).resolve().name
    settings = ServerSettings(model_name=name, api_key=token, max_model_len=engine.max_seq_len,
                              vocab_size=engine.spec.vocab_size)
    return create_app(NativeBackend(engine), tokenizer, settings)


async def _serve(server, sock: socket.socket, ready_file: str | None) -> None:
    from rl_core.fsutil import atomic_write_json

    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started and ready_file:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        atomic_write_json(ready_file, {"host": host, "port": port, "url": f"http://{shown}:{port}", "pid": os.getpid()})
    await task


def cmd_serve(args) -> int:
    import uvicorn

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_model_dir(args.model_dir)
    token = read_token(args)
    check_token_rule(args.host, token, args.api_key_env)
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails in milliseconds
    app = build_app(args, token)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("info", "debug"),
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    print(f"rl-core serve: {args.model_dir} on http://{host}:{port} "
          f"({'token required' if token else 'no token: loopback only'})", flush=True)
    asyncio.run(_serve(server, sock, args.ready_file))
    return 0

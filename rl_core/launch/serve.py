"""`rl-core serve MODEL_DIR`: the native engine behind an OpenAI-compatible HTTP server.

Owns: the command's options, the checks made before anything expensive (port range,
positive sizes, the model directory's config.json and safetensors files, tokenizer files,
the token rule and the control-secret rule of `--managed`; each a one-paragraph
`ServeError`, exit 2), building the engine from an HF directory, and running uvicorn on
the socket bound here (so `--port 0` picks a free port with no race, and `--ready-file`
tells a parent process where the server listens once it accepts connections). Tokens and
secrets are read from the environment or a file, never from the command line.

Does not own: the routes (rl_core.serve.app) or the engine (rl_core.generation).

See docs/generation.md, "`rl-core serve`" (options, token rule) and "Serving and
security" (managed mode, start-up checks).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import socket
import stat
from pathlib import Path

from rl_core.errors import UserError
from rl_core.generation.native.kv_sizing import DEFAULT_SLOTS
from rl_core.server_contract import (  # noqa: F401  (re-exported: part of the command's surface)
    CONTROL_SECRET_HEADER,
    DEFAULT_CONTROL_SECRET_ENV,
    check_safetensors_file,
)

# idle keep-alive connections live this long on the server: well above the clients' expiry
# (rl_core's HTTP backend drops them after 2 s), so a client never sends on a closing socket
SERVER_KEEPALIVE_S = 30

DEFAULT_API_KEY_ENV = "RL_CORE_API_KEY"
MIN_SECRET_CHARS = 16
DEFAULT_MAX_CHOICES = 512
MAX_ENGINE_SEED = 2**64 - 1  # torch's generator seed (as grpo.seed)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


class ServeError(UserError):
    """A `rl-core serve` option that cannot be used (printed without a traceback)."""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="HF model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback addresses need a token)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port; see --ready-file)")
    p.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV,
                   help="environment variable holding the bearer token (default %(default)s)")
    p.add_argument("--api-key-file", help="file holding the bearer token (instead of the environment)")
    p.add_argument("--managed", action="store_true",
                   help="managed rollout server: enable the /rl/* control routes (weight loading and broadcast, "
                        "abort, KV invalidation); each call then needs the header X-RL-Core-Secret")
    p.add_argument("--control-secret-env", default=DEFAULT_CONTROL_SECRET_ENV,
                   help="with --managed: environment variable holding the control secret (default %(default)s; "
                        "removed from the environment once read)")
    p.add_argument("--control-secret-file",
                   help="with --managed: file (mode 0600) holding the control secret, instead of the environment")
    p.add_argument("--max-choices-per-request", type=int, default=DEFAULT_MAX_CHOICES,
                   help="cap on prompts x n of one request (default %(default)s); more is refused with HTTP 400")
    p.add_argument("--served-model-name", help="model id in the API (default: the directory name)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help=f"sequences decoded together (KV cache slots of --max-seq-len tokens each); default "
                        f"{DEFAULT_SLOTS}, so the cache is what the model needs at its context length for that batch")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="instead of a batch size: as many slots as fit in this share of the memory available at start "
                        "(GPU free memory on CUDA, host memory on CPU), at most 256")
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
    p.add_argument("--decode-attention", choices=["torch", "fused"], default="torch",
                   help="fused: RoPE, cache write and attention of the static/graph decode step in one Triton "
                        "kernel (CUDA)")
    p.add_argument("--decode-mlp", choices=["torch", "fused"], default="torch",
                   help="fused: the gate/up projection and SiLU gate of the static/graph decode step in one Triton "
                        "kernel (CUDA; needs --decode-attention fused)")
    p.add_argument("--seed", type=int, default=0, help="seed of requests sent without one")
    p.add_argument("--lockstep", action="store_true",
                   help="engine steps follow the event loop, not thread timing: the choices of one request join "
                        "the same step, so a request alone on the server gets the same numbers in every run "
                        "(async_rl.reproducible)")
    p.add_argument("--weight-version", type=int, default=0, help="weight version of MODEL_DIR's weights")
    p.add_argument("--torch-num-threads", type=int, default=None, help="intra-op CPU threads")
    p.add_argument("--ready-file", help="write {host, port, url, pid, hostname} here (atomically) once serving")
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


def read_control_secret(args) -> str | None:
    """The control secret of a --managed server (None otherwise); see the module doc."""
    if not args.managed:
        if args.control_secret_file:
            raise ServeError(f"--control-secret-file {args.control_secret_file} was given without --managed; the "
                             "control secret guards the /rl/* routes, which only a managed server has. Fix: add "
                             "--managed, or leave --control-secret-file out.")
        return None
    if args.control_secret_file:
        path = Path(args.control_secret_file)
        try:
            info = path.stat()
            secret = path.read_text().strip() if stat.S_ISREG(info.st_mode) else None
        except (OSError, UnicodeDecodeError) as exc:
            raise ServeError(f"--control-secret-file {path} cannot be read ({exc}); expected a file holding the "
                             "secret. Fix: write the secret to that file (mode 0600).") from None
        if secret is None:
            raise ServeError(f"--control-secret-file {path} is not a regular file; expected a file holding the "
                             "secret. Fix: write the secret to a file (mode 0600).")
        if info.st_mode & 0o077:
            raise ServeError(f"--control-secret-file {path} has mode {stat.S_IMODE(info.st_mode):04o}; expected a "
                             f"file only its owner can read (0600). Fix: chmod 600 {path}.")
        source = f"--control-secret-file {path}"
    else:
        secret = os.environ.pop(args.control_secret_env, "").strip()  # not inherited by anything started later
        source = f"the environment variable {args.control_secret_env}"
    if len(secret) < MIN_SECRET_CHARS:
        raise ServeError(f"--managed needs a control secret of at least {MIN_SECRET_CHARS} characters; "
                         f"{source} holds {len(secret)} characters. Fix: set it to a random per-launch secret, e.g. "
                         "python -c 'import secrets; print(secrets.token_urlsafe(32))' (never on the command line).")
    return secret


def check_numbers(args) -> None:
    """The numeric flags, before anything is built."""
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port got {args.port}; expected a TCP port in 0..65535 (0 = any free port). "
                         "Fix: pass e.g. --port 8000 or --port 0.")
    positive = (("--max-seq-len", args.max_seq_len), ("--max-batch-size", args.max_batch_size),
                ("--max-num-kv-tokens", args.max_num_kv_tokens), ("--torch-num-threads", args.torch_num_threads),
                ("--max-choices-per-request", args.max_choices_per_request))
    for flag, value in positive:
        if value is not None and value < 1:
            raise ServeError(f"{flag} got {value}; expected a positive integer. Fix: pass a value >= 1, or leave "
                             f"{flag} out for its default.")
    if args.weight_version < 0:
        raise ServeError(f"--weight-version got {args.weight_version}; expected an integer >= 0. Fix: pass the "
                         "weight version of MODEL_DIR's weights (0 for an initial policy).")
    if not 0 <= args.seed <= MAX_ENGINE_SEED:
        raise ServeError(f"--seed got {args.seed}; expected an integer in 0..2^64 - 1 (the engine's random generator "
                         "takes 64 bits). Fix: pass a smaller seed, e.g. --seed 0.")
    if not args.kv_scale_margin > 0:
        raise ServeError(f"--kv-scale-margin got {args.kv_scale_margin}; expected a number > 0. Fix: leave it at "
                         "its default 2.0.")


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ServeError(f"MODEL_DIR {path} is not an HF model directory; expected config.json and *.safetensors "
                         "(and a tokenizer) in it. Fix: pass a directory saved with save_pretrained.")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ServeError(f"{path / 'config.json'} is not valid JSON ({type(exc).__name__}: {str(exc)[:100]}); "
                         "expected the model's HF config. Fix: restore the file (save_pretrained writes it).") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        got = type(config).__name__ if not isinstance(config, dict) else f"model_type {config.get('model_type')!r}"
        raise ServeError(f"{path / 'config.json'} is not an HF model config (got {got}); expected a JSON object "
                         "with a model_type. Fix: restore the file (save_pretrained writes it).")
    for file in sorted(path.glob("*.safetensors")):
        try:
            check_safetensors_file(file)
        except (OSError, ValueError) as exc:
            raise ServeError(f"MODEL_DIR weights: {exc}; expected complete safetensors files. Fix: copy or save "
                             "the model again.") from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ServeError(f"MODEL_DIR {path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); the "
                         "server would encode every text prompt to zero tokens. Fix: save the tokenizer into it "
                         "(tokenizer.save_pretrained(MODEL_DIR)).")
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
    """Sets `args.max_batch_size` (KV-cache slots) when it was not given (`DEFAULT_SLOTS`, or from
    --kv-cache-memory-fraction); a cache that cannot fit the memory available is a ServeError."""
    from rl_core.generation.native.engine import DEFAULT_MAX_SEQ_LEN_CAP
    from rl_core.generation.native.kv_sizing import KVSizingError, available_memory, plan_kv_slots
    from rl_core.generation.native.model import ModelSpec

    fraction = args.kv_cache_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise ServeError(f"--kv-cache-memory-fraction is {args.kv_cache_memory_fraction}; expected a number in (0, 1]. "
                         "Fix: pass e.g. --kv-cache-memory-fraction 0.3.")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise ServeError(f"--max-batch-size is {args.max_batch_size}; expected an integer >= 1. Fix: pass a positive "
                         f"number, or leave it out for the default ({DEFAULT_SLOTS}).")
    try:
        spec = ModelSpec.from_config(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ServeError(f"{Path(args.model_dir) / 'config.json'} cannot be used: {exc}. Fix: serve a directory "
                         "saved with save_pretrained of a supported architecture.") from None
    max_seq_len = args.max_seq_len or min(spec.max_position_embeddings, DEFAULT_MAX_SEQ_LEN_CAP)  # as the engine
    try:
        plan = plan_kv_slots(spec, max_seq_len, dtype, args.kv_cache_dtype, available_memory(device),
                             args.max_batch_size, fraction)
    except KVSizingError as exc:
        raise ServeError(str(exc)) from None
    args.max_batch_size = plan.slots
    return plan.describe(max_seq_len)


def build_app(args, token: str | None, control_secret: str | None = None):
    """Tokenizer, engine, backend and app (the expensive part)."""
    import torch
    from transformers import AutoTokenizer

    from rl_core.generation.native.backend import NativeBackend
    from rl_core.errors import EngineOptionsError
    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.model import read_config
    from rl_core.generation.native.options import EngineOptions, flag_error
    from rl_core.serve.app import ServerSettings, create_app

    if args.torch_num_threads:
        torch.set_num_threads(args.torch_num_threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ServeError("--device cuda: no CUDA device is visible; expected a GPU. Fix: use --device cpu or auto.")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        raise ServeError(f"the tokenizer of MODEL_DIR {args.model_dir} does not load ({type(exc).__name__}: "
                         f"{str(exc)[:200]}); expected HF tokenizer files. Fix: save the tokenizer into it.") from None
    if len(tokenizer) == 0 or not tokenizer("a b", add_special_tokens=False)["input_ids"]:
        raise ServeError(f"the tokenizer of MODEL_DIR {args.model_dir} encodes text to zero tokens; expected a "
                         "working tokenizer. Fix: save the model's tokenizer into MODEL_DIR.")
    config = read_config(args.model_dir)
    raw = config.get("eos_token_id")
    eos = set(raw if isinstance(raw, list) else [] if raw is None else [raw])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    kv = plan_kv_cache(args, config, device, dtype)
    print(f"[serve] {kv}", flush=True)
    options = EngineOptions.from_serve_args(args, device=device, dtype=dtype, eos_token_ids=sorted(eos),
                                            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    try:
        engine = NativeEngine.from_pretrained(args.model_dir, options)
    except EngineOptionsError as exc:  # the flags against this model and device
        raise flag_error(exc) from None
    except (ValueError, KeyError, TypeError) as exc:  # a config.json the engine cannot use
        raise ServeError(f"cannot build the engine from {args.model_dir}: {type(exc).__name__}: {str(exc)[:300]}. "
                         "Fix: check config.json and the weights (an HF directory of a supported model).") from None
    name = args.served_model_name or Path(args.model_dir).resolve().name
    settings = ServerSettings(model_name=name, api_key=token, max_model_len=engine.max_seq_len,
                              vocab_size=engine.spec.vocab_size, managed=bool(args.managed),
                              control_secret=control_secret, max_choices=args.max_choices_per_request)
    return create_app(NativeBackend(engine, lockstep=bool(getattr(args, "lockstep", False))), tokenizer, settings)


def http_url(host: str, port: int) -> str:
    """The URL of a server bound to `host`: an IPv6 address in brackets (RFC 3986), `http://[::1]:8000`."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(server, sock: socket.socket, ready_file: str | None) -> None:
    from rl_core.fsutil import atomic_write_json

    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started and ready_file:
        host, port = sock.getsockname()[:2]
        atomic_write_json(ready_file, {"host": host, "port": port, "url": http_url(host, port), "pid": os.getpid(),
                                       "hostname": socket.gethostname()})
    await task


def cmd_serve(args) -> int:
    import uvicorn

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_numbers(args)
    check_model_dir(args.model_dir)
    token = read_token(args)
    check_token_rule(args.host, token, args.api_key_env)
    control_secret = read_control_secret(args)
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails in milliseconds
    app = build_app(args, token, control_secret)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("info", "debug"),
                            timeout_graceful_shutdown=5, timeout_keep_alive=SERVER_KEEPALIVE_S)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    print(f"rl-core serve: {args.model_dir} on {http_url(host, port)} "
          f"({'token required' if token else 'no token: loopback only'}; "
          f"{'managed: /rl/* control routes on, secret required' if args.managed else '/rl/* control routes off'})",
          flush=True)
    asyncio.run(_serve(server, sock, args.ready_file))
    return 0

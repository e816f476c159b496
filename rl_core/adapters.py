"""LoRA adapters on the wire and on disk: what the trainers, checkpoints and generation backends share.

Owns: the refit format of adapters (`<module>.lora_A` [r, in] and `<module>.lora_B` [out, r]
under the HF module names, the scale alpha / r folded into B, so the weight `<module>.weight`
becomes W + B @ A; checked by `adapter_pairs`); PEFT's adapter directory read into that format
(`read_adapter_dir`) and written from it for servers that load adapters from files
(`write_peft_dir`, vLLM); the base model's identity beside a saved adapter (`base_model.json`:
path, model type, sha256 of its weight files: `write_base_identity`, `resolve_base`); merging
an adapter directory into a plain HF directory (`merge_adapter_dir`). Imports no PEFT.

Does not own: training adapters (rl_core.train.lora) or applying them in an engine
(rl_core.generation.native.lora, rl_core.generation.vllm). Read more: docs/lora.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from rl_core.errors import CheckpointError

LORA_A, LORA_B = ".lora_A", ".lora_B"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_IDENTITY = "base_model.json"
BASE_FORMAT = "rl_core.lora-base/1"
PEFT_PREFIX = "base_model.model."  # PEFT's saved names: base_model.model.<module>.lora_A.weight


# --------------------------------------------------------------------------- the refit format


def is_adapter_state(names: Iterable[str]) -> bool:
    """Whether a state dict's names are adapters (refit format) rather than weights."""
    return any(n.endswith(LORA_A) or n.endswith(LORA_B) for n in names)


def adapter_pairs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A [r, in], B [out, r])} of adapters in the refit format, checked: every name is a
    `.lora_A` or `.lora_B`, each module has both, and their ranks agree (ValueError otherwise)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        suffix = LORA_A if name.endswith(LORA_A) else LORA_B if name.endswith(LORA_B) else None
        if suffix is None:
            raise ValueError(f"weight {name!r} in an adapter update: an adapter update holds only `<module>.lora_A` "
                             "and `<module>.lora_B` tensors (send full weights in an update of their own)")
        pairs.setdefault(name[:-len(suffix)], {})[suffix] = t
    out = {}
    for module, ab in pairs.items():
        a, b = ab.get(LORA_A), ab.get(LORA_B)
        if a is None or b is None:
            raise ValueError(f"adapter of {module!r} has {sorted(ab)} only; expected both lora_A and lora_B")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter of {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                             "expected [r, in_features] and [out_features, r]")
        out[module] = (a, b)
    return out


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """base + B @ A, computed in float32 and cast back to base's dtype and device."""
    delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
    return (base.float() + delta).to(base.dtype)


# --------------------------------------------------------------------------- PEFT's directory


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether `path` holds a PEFT adapter (a LoRA policy) rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def peft_scale(config: Mapping) -> float:
    """The scale of a PEFT LoRA adapter's B @ A: lora_alpha / r (/ sqrt(r) with rsLoRA)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter peft_type {config.get('peft_type')!r}; rl_core reads LoRA adapters only")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("adapter with rank_pattern/alpha_pattern: rl_core reads adapters of one rank and alpha")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_adapter_dir(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A PEFT adapter directory's tensors in the refit format (scale folded into B), on CPU."""
    from safetensors.torch import load_file

    d = Path(path)
    config = json.loads((d / ADAPTER_CONFIG).read_text())
    scale = peft_scale(config)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(str(d / ADAPTER_WEIGHTS)).items():
        for peft_suffix, suffix in ((".lora_A.weight", LORA_A), (".lora_B.weight", LORA_B)):
            if name.startswith(PEFT_PREFIX) and name.endswith(peft_suffix):
                module = name[len(PEFT_PREFIX):-len(peft_suffix)]
                out[module + suffix] = t if suffix == LORA_A else t * scale
                break
        else:
            raise ValueError(f"{d / ADAPTER_WEIGHTS} holds {name!r}; rl_core reads LoRA A/B matrices of linear "
                             "layers only (no modules_to_save, biases or embedding adapters)")
    adapter_pairs(out)
    return out


def write_peft_dir(out: str | os.PathLike, state: Mapping[str, torch.Tensor], base: str) -> Path:
    """Adapters in the refit format as a PEFT directory (lora_alpha = r: the scale is in B) that
    a server loads (vLLM); `base` is recorded as base_model_name_or_path. Written atomically."""
    from safetensors.torch import save_file

    from rl_core.fsutil import atomic_dir

    pairs = adapter_pairs(state)
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise ValueError(f"adapters of ranks {sorted(ranks)}; a PEFT directory holds one rank")
    r = ranks.pop()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": r, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "base_model_name_or_path": base,
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in pairs}), "inference_mode": True}
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.detach().to("cpu").contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.detach().to("cpu").contiguous()
    with atomic_dir(out, "adapter") as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return Path(out)


# --------------------------------------------------------------------------- the base model's identity

_FINGERPRINTS: dict[tuple, dict] = {}


def weight_files(model_dir: Path) -> list[Path]:
    """The files that define an HF directory's model: config.json and its *.safetensors."""
    return [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]


def base_fingerprint(model_dir: str | os.PathLike) -> dict:
    """{"sha256": digest over the files, "files": {name: sha256}} of an HF directory's config.json
    and weights; cached per file sizes and modification times (hashing reads every byte once)."""
    d = Path(model_dir).resolve()
    files = weight_files(d)
    key = (str(d), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _FINGERPRINTS:
        from rl_core.fsutil import sha256_file

        each = {f.name: sha256_file(f) for f in files}
        whole = hashlib.sha256("".join(f"{n}:{h}\n" for n, h in each.items()).encode()).hexdigest()
        _FINGERPRINTS[key] = {"sha256": whole, "files": each}
    return _FINGERPRINTS[key]


def write_base_identity(adapter_dir: str | os.PathLike, base_dir: str | os.PathLike) -> None:
    """`base_model.json` beside an adapter: the base's path (absolute and relative to the
    adapter), its model type and architectures, and its fingerprint (sha256 of its files)."""
    base = Path(base_dir).resolve()
    config = json.loads((base / "config.json").read_text())
    ident = {"format": BASE_FORMAT, "path": str(base), "relative_path": os.path.relpath(base, Path(adapter_dir).resolve()),
             "model_type": config.get("model_type"), "architectures": config.get("architectures"),
             **base_fingerprint(base)}
    (Path(adapter_dir) / BASE_IDENTITY).write_text(json.dumps(ident, indent=1))


def resolve_base(adapter_dir: str | os.PathLike, verify: bool = True) -> Path:
    """The base model directory of a saved adapter (`base_model.json`: its path relative to the
    adapter first, then the absolute one), checked against the recorded sha256 when `verify`;
    a `CheckpointError` naming the file, the path and the fix otherwise."""
    d = Path(adapter_dir)
    file = d / BASE_IDENTITY
    try:
        ident = json.loads(file.read_text())
        if ident.get("format") != BASE_FORMAT:
            raise ValueError(f"format {ident.get('format')!r}")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"The LoRA adapter in {d} has no readable {BASE_IDENTITY} ({exc}); expected the "
                              f"{BASE_FORMAT} record rl_core writes beside every adapter it saves. Fix: resume from "
                              "another checkpoint, or point at the merged policy directory instead.") from None
    found = []
    for cand in dict.fromkeys([(d.resolve() / ident["relative_path"]).resolve(), Path(ident["path"])]):
        if (cand / "config.json").is_file():
            if not verify or base_fingerprint(cand)["sha256"] == ident["sha256"]:
                return cand
            found.append(f"{cand} has other weights (sha256 {base_fingerprint(cand)['sha256'][:12]})")
    why = "; ".join(found) or f"neither {ident['path']} nor {ident['relative_path']} (relative to {d}) exists"
    raise CheckpointError(
        f"The LoRA adapter in {d} was trained on the base model {ident['path']} (sha256 {ident['sha256'][:12]}, "
        f"recorded in {file}): {why}. Fix: restore that base model directory (the run's init_policy) unchanged, "
        "or start a new run from the base you have.")


def merge_adapter_dir(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A plain HF directory of the base model with the adapter merged into its weights (same
    files and names as the base's, its config and generation config), written into `out_dir`
    (which the caller creates and fills with anything else, e.g. the tokenizer)."""
    from safetensors.torch import load_file, save_file

    base = resolve_base(adapter_dir)
    pairs = adapter_pairs(read_adapter_dir(adapter_dir))
    todo = {f"{m}.weight": ab for m, ab in pairs.items()}
    out = Path(out_dir)
    for f in sorted(base.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in todo.keys() & tensors.keys():
            tensors[name] = merged_weight(tensors[name], *todo.pop(name))
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    if todo:
        raise ValueError(f"adapter of {sorted(todo)[:3]} has no weight in the base model {base}")
    for f in base.iterdir():
        if f.suffix == ".json" and f.name not in (ADAPTER_CONFIG, BASE_IDENTITY):
            shutil.copyfile(f, out / f.name)
    return out

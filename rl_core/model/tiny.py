"""The tiny random-init policy and the HF directory format every model is stored in.

Owns: `build_tiny_model` (a transformers causal LM, Qwen2, Llama or Mixtral by
`model.tiny.architecture`, shaped by `TinyModelConfig`, with the tokenizer's vocabulary and
eos/pad/bos ids, fp32, seeded under a forked torch RNG; no bos token: `bos_token_id` is the
eos id only so code expecting one finds it); `save_hf_dir` (a normal HF directory written
atomically: a temporary directory beside the target, renamed onto it, an existing target
swapped out only after the new one is in place and only if rl_core wrote it, its marker file:
`rl_core.fsutil`); and `load_hf_dir` (model + tokenizer back, offline).

Does not own: the tokenizer's training (`tokenizer.py`), warm-up (`warmup.py`), or the
recipe-level orchestration (`init_policy.py`).

Read more: docs/model.md, "The model".
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          MixtralConfig, PreTrainedModel, PretrainedConfig, Qwen2Config)

from rl_core.fsutil import check_replaceable, normalize_file_modes, write_marker

_CONFIG_CLASSES = {"qwen2": Qwen2Config, "llama": LlamaConfig, "mixtral": MixtralConfig}


def tiny_model_config(tiny_cfg: Any, tokenizer: Any) -> PretrainedConfig:
    """The transformers config of the tiny model for this tokenizer."""
    cls = _CONFIG_CLASSES.get(tiny_cfg.architecture)
    if cls is None:
        raise ValueError(f"model.tiny.architecture must be one of {sorted(_CONFIG_CLASSES)}, "
                         f"got {tiny_cfg.architecture!r}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token; the tiny model needs one to end completions")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    extra: dict[str, Any] = {}
    if tiny_cfg.architecture == "mixtral":
        # sliding_window None: full causal attention (the native engine has no sliding window)
        extra = dict(num_local_experts=tiny_cfg.num_experts, num_experts_per_tok=tiny_cfg.num_experts_per_tok,
                     sliding_window=None, router_jitter_noise=0.0, output_router_logits=False)
    return cls(
        vocab_size=len(tokenizer),
        hidden_size=tiny_cfg.hidden_size,
        num_hidden_layers=tiny_cfg.num_hidden_layers,
        num_attention_heads=tiny_cfg.num_attention_heads,
        num_key_value_heads=tiny_cfg.num_key_value_heads,
        intermediate_size=tiny_cfg.intermediate_size,
        max_position_embeddings=tiny_cfg.max_position_embeddings,
        tie_word_embeddings=tiny_cfg.tie_word_embeddings,
        rope_theta=tiny_cfg.rope_theta,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=bos,
        dtype="float32",
        **extra,
    )


def build_tiny_model(tiny_cfg: Any, tokenizer: Any, seed: int) -> PreTrainedModel:
    """A random-init fp32 causal LM shaped by `tiny_cfg`; the same seed gives the same weights."""
    config = tiny_model_config(tiny_cfg, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = make_generation_config(tokenizer)
    return model


def make_generation_config(tokenizer: Any) -> GenerationConfig:
    """Greedy-by-default generation settings that stop at the tokenizer's eos token."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    return GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=bos, do_sample=False)


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --------------------------------------------------------------------------- atomic directories


def write_dir_atomically(out_dir: str | Path, fill: Callable[[Path], None], what: str = "policy") -> Path:
    """Call `fill(tmp)` on a fresh temporary directory beside `out_dir`, then move it onto `out_dir`.

    The new directory carries rl_core's marker file (`rl_core.fsutil.MARKER`) and its files
    the ordinary mode (0644 under umask 022). An existing `out_dir` is replaced only if
    rl_core wrote it (marker) or it is empty; anything else (a user's directory, a file)
    raises `OutputPathError` before `fill` runs. A replaced directory is renamed aside first
    and deleted once the new one is in place. If `fill` raises, the temporary directory is
    removed and `out_dir` is left untouched.
    """
    out = Path(out_dir)
    check_replaceable(out, what)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.with_name(f".{out.name}.tmp-{tag}")
    tmp.mkdir()
    try:
        write_marker(tmp, what)
        fill(tmp)
        normalize_file_modes(tmp)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        try:
            check_replaceable(out, what)  # still ours (nothing swapped in while fill ran)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = out.with_name(f".{out.name}.old-{tag}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_hf_dir(model: PreTrainedModel, tokenizer: Any, out_dir: str | Path,
                extra_json: dict[str, Any] | None = None) -> Path:
    """Write model + tokenizer as a normal HF directory, atomically.

    `extra_json` maps file names to JSON-able objects written into the same directory
    (e.g. `init_report.json`), so they appear together with the weights or not at all.
    """

    def fill(tmp: Path) -> None:
        if model.generation_config is None or model.generation_config.eos_token_id is None:
            model.generation_config = make_generation_config(tokenizer)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, obj in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    return write_dir_atomically(out_dir, fill)


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    """Model and tokenizer from an HF directory on disk (never touches the network)."""
    p = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    return model, tokenizer

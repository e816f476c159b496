"""The initial policy of a run: one HF directory that trainer and generation both load.

Owns `init_policy(cfg, out_dir)`, the step before RL: for `model.source: tiny` the tokenizer
trained on the training text, the model from `model.tiny` seeded with `grpo.seed` and the
supervised warm-up; for `smollm2` the HF directory `rl_core.model.gguf.smollm2_hf_dir`
converts; for `hf` a copy of `model.path` (config, safetensors weights and index, generation
config, tokenizer files; other weight formats left behind), verified by loading it. `out_dir`
appears atomically with `init_report.json` (also returned). The same recipe gives the same
weights byte for byte on the same machine and thread count. Before anything is built, the
longest prompt plus `generation.max_tokens` (and the reference answer) must fit the model.

Does not own: the recipe, the torch threads or the process (the launcher), the mechanics
(`tokenizer.py`, `tiny.py`, `warmup.py`). Read more: docs/model.md, "The initial policy".
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from rl_core.data.dataset import Fields, load_task_data
from rl_core.envs import make_env
from rl_core.errors import RecipeError
from rl_core.model.tiny import build_tiny_model, load_hf_dir, num_parameters, save_hf_dir, write_dir_atomically
from rl_core.model.tokenizer import build_tokenizer
from rl_core.model.warmup import warmup

INIT_REPORT = "init_report.json"

# Files of an HF model directory that `source: hf` copies (weights only as safetensors).
_HF_FILES = (
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)


def init_policy(cfg: Any, out_dir: str | Path, log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Build (tiny) or copy (hf) the initial policy into `out_dir`; returns the init report."""
    if cfg.model.source == "tiny" and cfg.model.warmup.reuse_from:
        src = reused_policy_dir(cfg)
        return _init_hf(cfg, Path(out_dir), log, src, source="tiny", field="model.warmup.reuse_from",
                        carry=json.loads((src / INIT_REPORT).read_text()))
    if cfg.model.source == "tiny":
        return _init_tiny(cfg, Path(out_dir), log)
    if cfg.model.source == "hf":
        return _init_hf(cfg, Path(out_dir), log, Path(cfg.model.path))
    if cfg.model.source == "smollm2":
        from rl_core.model.gguf import smollm2_hf_dir

        t0 = time.perf_counter()
        src = smollm2_hf_dir("float32")  # converted once per machine, then reused from the cache
        if log is not None:
            log(f"init_policy: SmolLM2-135M-Instruct at {src} ({time.perf_counter() - t0:.1f}s)")
        return _init_hf(cfg, Path(out_dir), log, src, source="smollm2")
    raise RecipeError.single("model.source", cfg.model.source, "'tiny', 'hf' or 'smollm2'",
                             "set model.source to tiny, hf or smollm2.")


# --------------------------------------------------------------------------- tiny


def _init_tiny(cfg: Any, out_dir: Path, log: Callable[[str], None] | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    tiny, seed = cfg.model.tiny, cfg.grpo.seed
    device = warmup_device(cfg.model.warmup.device) if cfg.model.warmup.enabled else "cpu"
    train, val = load_task_data(cfg.data.train_file, cfg.data.val_file, fields=Fields.of(cfg.data))
    tokenizer = build_tokenizer(train, tiny.tokenizer_vocab_size, model_max_length=tiny.max_position_embeddings)
    env = make_env(cfg.env, tokenizer)
    longest = check_lengths(env, train + val, cfg.generation.max_tokens, tiny.max_position_embeddings)
    model = build_tiny_model(tiny, tokenizer, seed=seed)
    if log is not None:
        log(f"init_policy: tiny {tiny.architecture} model, {num_parameters(model):,} parameters, "
            f"vocabulary {len(tokenizer)}, seed {seed}")

    if cfg.model.warmup.enabled:
        stats = warmup(model, env, train, val, cfg.model.warmup, seed=seed, log=log, device=device)
        if device != "cpu":
            stats["device"] = device
    else:
        stats = {"enabled": False}

    report = {
        "source": "tiny",
        "architecture": tiny.architecture,
        "tiny": tiny.model_dump(mode="json"),  # the shape it was built for (checked when it is reused)
        "num_parameters": num_parameters(model),
        "vocab_size": len(tokenizer),
        "seed": seed,
        "env": env.name,
        "train_file": str(cfg.data.train_file),
        "val_file": str(cfg.data.val_file),
        "num_train": len(train),
        "num_val": len(val),
        "longest_prompt_tokens": longest,
        "warmup": stats,
    }
    report["seconds"] = time.perf_counter() - t0
    save_hf_dir(model, tokenizer, out_dir, extra_json={INIT_REPORT: report})
    if log is not None:
        log(f"init_policy: wrote {out_dir} in {report['seconds']:.1f}s")
    return report


def warmup_device(setting: str) -> str:
    """`model.warmup.device` resolved: `auto` is CUDA when available; `cuda` without a GPU
    raises a `RecipeError`."""
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise RecipeError.single("model.warmup.device", "cuda", "a machine with a CUDA device",
                                 "set model.warmup.device: auto (or cpu) on this machine.")
    return setting


def check_lengths(env: Any, examples: list[dict[str, Any]], max_new_tokens: int, max_positions: int) -> int:
    """Raise a `RecipeError` if a prompt plus `max_new_tokens` (or plus its reference answer)
    does not fit in `max_positions`; returns the longest prompt in tokens."""
    longest, longest_full = 0, 0
    for ex in examples:
        n = len(env.prompt_ids(ex))
        longest = max(longest, n)
        longest_full = max(longest_full, n + len(env.reference_completion_ids(ex)))
    need = max(longest + max_new_tokens, longest_full)
    if need > max_positions:
        raise RecipeError.single(
            "model.tiny.max_position_embeddings", max_positions,
            f"at least {need} (longest prompt {longest} tokens + generation.max_tokens {max_new_tokens}, "
            f"and prompt + reference answer {longest_full})",
            f"raise model.tiny.max_position_embeddings to {need} or more, or lower generation.max_tokens.")
    return longest


def reused_policy_dir(cfg: Any) -> Path:
    """The `init_policy` directory that `model.warmup.reuse_from` names, checked against the
    recipe (built by `source: tiny`, same shape, tokenizer trained on the same file); raises
    a `RecipeError` naming the field otherwise. Reads two small JSON files, builds nothing."""
    name = cfg.model.warmup.reuse_from
    field = "model.warmup.reuse_from"
    cand = Path(name)
    if not (cand / INIT_REPORT).is_file():
        run_dir = Path(cfg.output_dir) / name
        cand = run_dir / "init_policy" if (run_dir / "init_policy" / INIT_REPORT).is_file() else cand / "init_policy"
    if not (cand / INIT_REPORT).is_file():
        raise RecipeError.single(
            field, name, f"a run name with a finished initial policy ({Path(cfg.output_dir) / name / 'init_policy'}) "
            "or the path of an init_policy directory (it holds init_report.json)",
            "run that recipe's initial policy first (`rl-core init-policy RECIPE --out DIR`, or any training run), "
            "or remove model.warmup.reuse_from to build and warm up a new model.")
    report = json.loads((cand / INIT_REPORT).read_text())
    problems = []
    if report.get("source") != "tiny":
        problems.append(f"it was built by model.source {report.get('source')!r}, not 'tiny'")
    if report.get("train_file") is not None and Path(report["train_file"]).resolve() != Path(cfg.data.train_file).resolve():
        problems.append(f"its tokenizer was trained on {report['train_file']}, not data.train_file "
                        f"{cfg.data.train_file}")
    want = cfg.model.tiny.model_dump(mode="json")
    problems += [f"model.tiny.{k} is {v!r} in the recipe but {report.get('tiny', {}).get(k)!r} there"
                 for k, v in want.items() if report.get("tiny", {}).get(k) != v]
    if problems:
        raise RecipeError.single(field, name, "an initial policy built for this recipe's model and training data",
                                 f"{'; '.join(problems)}. Set the recipe to match it, or remove "
                                 "model.warmup.reuse_from to build a new one.")
    return cand


# --------------------------------------------------------------------------- hf


def _init_hf(cfg: Any, out_dir: Path, log: Callable[[str], None] | None, src: Path,
             source: str = "hf", field: str = "model.path", carry: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy the HF directory `src`; `carry` (a reused warm-up's report) keeps its fields, the
    copy's own (`path`, `files`, `seconds`, ...) on top and `reused_from` added."""
    t0 = time.perf_counter()
    weights = sorted(src.glob("*.safetensors")) if src.is_dir() else []
    if not (src / "config.json").is_file() or not weights:
        raise RecipeError.single(
            field, str(src), "an HF model directory holding config.json and *.safetensors weights",
            "point model.path at such a directory (save_pretrained writes one), or use model.source: tiny.")
    files = [src / name for name in _HF_FILES if (src / name).is_file()] + weights
    report: dict[str, Any] = dict(carry or {})
    if carry is not None:
        report["reused_from"] = str(src)
    report.update({"source": source, "path": str(src), "files": sorted(f.name for f in files)})

    def fill(tmp: Path) -> None:
        for f in files:
            shutil.copy2(f, tmp / f.name)
        try:
            model, tokenizer = load_hf_dir(tmp)
        except Exception as exc:  # any failure to load means the directory is not usable
            raise RecipeError.single(
                field, str(src), "a directory that AutoModelForCausalLM and AutoTokenizer load offline",
                f"fix the model directory (loading the copy failed: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
        if tokenizer.eos_token_id is None:
            raise RecipeError.single(field, str(src), "a tokenizer with an eos token",
                                     "set eos_token in the tokenizer_config.json of the model directory.")
        env = make_env(cfg.env, tokenizer)
        report.update({
            "architecture": model.config.model_type,
            "num_parameters": num_parameters(model),
            "vocab_size": len(tokenizer),
            "env": env.name,
            "seconds": time.perf_counter() - t0,
        })
        (tmp / INIT_REPORT).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")

    write_dir_atomically(out_dir, fill)
    if log is not None:
        log(f"init_policy: copied {src} ({report['num_parameters']:,} parameters) to {out_dir}")
    return report


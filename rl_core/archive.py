"""The rollout archive: an epoch's trained rollouts in one HDF5 file, and reading it back.

Owns: `compile_spool` (the JSON spool an epoch leaves, `rollouts.spool/step_NNNNNN.json`
written by `rl_core.rollout.spool`, -> `rollouts.h5`, written atomically, with its checksum
manifest `rollouts.h5.manifest.json`: SHA-256 per file, verified before h5py opens it); the
HDF5 layout (`format` attribute `rl_core.rollouts/1`: `/steps`, `/groups`, `/samples` and its
per-token vlen columns) and `RolloutArchive`, which reads it; `rl-core inspect`
(`inspect_main`): summary statistics and a few samples, decoded with the tokenizer of the
epoch's checkpoint when one is found next to the archive.

Does not own: writing the spool (the controller), choosing what is trained, the report.

Read more: docs/workflow.md, "The rollout archive" (every dataset and column).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from rl_core.errors import DataError

FORMAT = "rl_core.rollouts/1"
_VI32 = h5py.vlen_dtype(np.dtype("int32"))
_VF32 = h5py.vlen_dtype(np.dtype("float32"))
_STR = h5py.string_dtype()


def _spool_files(spool_dir: Path) -> list[Path]:
    files = sorted(spool_dir.glob("step_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    if not files:
        raise DataError(f"Rollout spool {spool_dir} holds no step_*.json records (expected one per trained RL "
                        f"step). Fix: rerun the epoch's train_epoch job, which writes them.")
    return files


def _ragged(group, name: str, rows: list[np.ndarray], dtype) -> "h5py.Dataset":
    """A variable-length dataset of `rows`, written in one call (a write per row costs ~20x more)."""
    data = np.empty(len(rows), dtype=object)
    data[:] = rows if rows else []
    return group.create_dataset(name, (len(rows),), dtype=dtype, data=data if rows else None)


def compile_spool(spool_dir: str | os.PathLike, out_path: str | os.PathLike,
                  attrs: dict[str, Any] | None = None) -> dict[str, int]:
    """Compile every step record of `spool_dir` into the HDF5 archive `out_path` (atomic)."""
    steps: dict[str, list] = {k: [] for k in ("step", "weight_version", "group_start", "group_count")}
    groups: dict[str, list] = {k: [] for k in ("step", "group_id", "prompt_index", "epoch", "target_step",
                                               "start_version", "end_version", "staleness", "sample_start",
                                               "sample_count")}
    samples: dict[str, list] = {k: [] for k in ("step", "group", "prompt_ids", "completion_ids", "gen_logprobs",
                                                "token_versions", "reward", "advantage", "finish_reason",
                                                "start_version", "end_version", "env_mask", "completion_mask",
                                                "turn_starts", "turn_versions", "segments")}
    components: dict[str, list[float]] = {}
    correct: list = []  # per sample: the environment's verdict (None in spools written before it was recorded)
    routes: list[list[list[int]]] = []  # per sample, per position: layers x k expert ids
    for path in _spool_files(Path(spool_dir)):
        rec = json.loads(path.read_text())
        steps["step"].append(rec["step"])
        steps["weight_version"].append(rec["weight_version"])
        steps["group_start"].append(len(groups["step"]))
        steps["group_count"].append(len(rec["groups"]))
        for g in rec["groups"]:
            gi = len(groups["step"])
            groups["step"].append(rec["step"])
            for k in ("group_id", "prompt_index", "epoch", "start_version", "end_version", "staleness"):
                groups[k].append(g[k])
            groups["target_step"].append(-1 if g.get("target_step") is None else g["target_step"])
            groups["sample_start"].append(len(samples["step"]))
            groups["sample_count"].append(len(g["samples"]))
            for s in g["samples"]:
                n = len(samples["step"])
                samples["step"].append(rec["step"])
                samples["group"].append(gi)
                for k in ("prompt_ids", "completion_ids", "gen_logprobs", "reward", "advantage", "finish_reason",
                          "start_version", "end_version", "env_mask"):
                    samples[k].append(s[k])
                samples["token_versions"].append(s.get("token_versions") or [])
                samples["completion_mask"].append(s.get("completion_mask") or [])
                samples["turn_starts"].append(s.get("turn_starts") or [])
                samples["turn_versions"].append(s.get("turn_versions") or [])
                samples["segments"].append(int(s.get("segments") or 1))
                routes.append(s.get("routed_experts") or [])
                correct.append(s.get("correct"))
                for name, value in (s.get("rewards") or {}).items():
                    col = components.setdefault(name, [math.nan] * n)
                    col.append(float(value))
                for col in components.values():
                    if len(col) == n:  # this sample lacks that component
                        col.append(math.nan)

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["source"] = str(spool_dir)
            for k, v in (attrs or {}).items():
                f.attrs[k] = v
            st, gr, sa = f.create_group("steps"), f.create_group("groups"), f.create_group("samples")
            for k, v in steps.items():
                st.create_dataset(k, data=np.asarray(v, dtype=np.int64))
            for k, v in groups.items():
                if k == "group_id":
                    gr.create_dataset(k, data=np.asarray(v, dtype=object), dtype=_STR)
                else:
                    gr.create_dataset(k, data=np.asarray(v, dtype=np.int64))
            n = len(samples["step"])
            for k, dtype in (("prompt_ids", _VI32), ("completion_ids", _VI32), ("token_versions", _VI32),
                             ("gen_logprobs", _VF32), ("completion_mask", _VI32), ("turn_starts", _VI32),
                             ("turn_versions", _VI32)):
                inner = np.float32 if dtype is _VF32 else np.int32
                _ragged(sa, k, [np.asarray(row, dtype=inner) for row in samples[k]], dtype)
            for k in ("step", "group", "start_version", "end_version", "segments"):
                sa.create_dataset(k, data=np.asarray(samples[k], dtype=np.int64))
            for k in ("reward", "advantage"):
                sa.create_dataset(k, data=np.asarray(samples[k], dtype=np.float32))
            sa.create_dataset("env_mask", data=np.asarray(samples["env_mask"], dtype=bool))
            sa.create_dataset("finish_reason", data=np.asarray(samples["finish_reason"], dtype=object), dtype=_STR)
            sa.create_dataset("prompt_len", data=np.asarray([len(x) for x in samples["prompt_ids"]], dtype=np.int32))
            sa.create_dataset("completion_len",
                              data=np.asarray([len(x) for x in samples["completion_ids"]], dtype=np.int32))
            widths = {len(pos) for r in routes for pos in r}
            if len(widths) > 1:
                raise DataError(f"Rollout spool {spool_dir}: routed_experts rows have different widths {sorted(widths)} "
                                "(expected layers x k ids at every position of every sample). Fix: rerun the epoch.")
            if widths:
                ds = _ragged(sa, "routed_experts", [np.asarray(r, dtype=np.int32).reshape(-1) for r in routes], _VI32)
                ds.attrs["width"] = widths.pop()
            if n and None not in correct:
                sa.create_dataset("correct", data=np.asarray(correct, dtype=bool))
            rw = sa.create_group("rewards")
            for name, col in components.items():
                rw.create_dataset(name, data=np.asarray(col, dtype=np.float32))
            f.attrs["num_steps"] = len(steps["step"])
            f.attrs["num_groups"] = len(groups["step"])
            f.attrs["num_samples"] = n
        write_manifest(out, tmp)  # the checksum of the bytes about to become `out`, then the rename
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"num_steps": len(steps["step"]), "num_groups": len(groups["step"]), "num_samples": len(samples["step"])}


MANIFEST_FORMAT = "rl_core.archive-manifest/1"
_CHUNK = 1 << 20


def manifest_path(archive: str | os.PathLike) -> Path:
    """The checksum manifest beside an archive: `<archive>.manifest.json`."""
    p = Path(archive)
    return p.with_name(p.name + ".manifest.json")


def _sha256(path: Path) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def write_manifest(archive: str | os.PathLike, written: str | os.PathLike | None = None) -> Path:
    """Write `archive`'s manifest (atomically): the SHA-256 and size of each file it covers,
    hashed from `written` (the temporary file about to be renamed to `archive`) when given."""
    from rl_core.fsutil import atomic_write_text

    digest, size = _sha256(Path(written or archive))
    out = manifest_path(archive)
    atomic_write_text(out, json.dumps({"format": MANIFEST_FORMAT, "files": {Path(archive).name: {
        "sha256": digest, "bytes": size}}}, indent=1) + "\n")
    return out


def verify_archive(archive: str | os.PathLike) -> bool:
    """Check `archive` against its manifest before anything parses it: False when it has none
    (an archive written before checksums), True when the bytes match, else a DataError naming
    the file (a damaged HDF5 file is never opened: h5py can hang on one)."""
    p, m = Path(archive), manifest_path(archive)
    if not m.is_file():
        return False
    fix = ("Fix: rebuild it from the epoch's spool (rerun the archive_rollouts rule, e.g. delete the file and rerun "
           "snakemake; or rerun `rl-core train`, which writes it at the end).")
    try:
        want = json.loads(m.read_text())["files"][p.name]
        digest, size = str(want["sha256"]), int(want["bytes"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"Rollout archive manifest {m} is unreadable ({type(exc).__name__}: {exc}); expected "
                        f"{MANIFEST_FORMAT} JSON naming {p.name}. {fix}") from None
    got, n = _sha256(p)
    if n != size or got != digest:
        raise DataError(f"Rollout archive {p} is damaged: {n:,} bytes (SHA-256 {got[:16]}...), but its manifest "
                        f"{m.name} records {size:,} bytes (SHA-256 {digest[:16]}...). {fix}")
    return True


def _stats(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "max": float(x.max())}


class RolloutArchive:
    """Read access to a `rollouts.h5` file (use as a context manager)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"Rollout archive {self.path} does not exist. Fix: pass results/<run>/epoch_<k>/rollouts.h5 "
                            f"of a trained epoch (the workflow's archive_rollouts rule writes it).")
        self.verified = verify_archive(self.path)  # before h5py reads a byte
        try:
            self.f = h5py.File(self.path, "r")
        except OSError as exc:
            raise DataError(f"Rollout archive {self.path} cannot be opened as HDF5 ({exc}); it is truncated or not "
                            f"an archive. Fix: rebuild it from the epoch's spool (rerun archive_rollouts).") from None
        if self.f.attrs.get("format") != FORMAT:
            fmt = self.f.attrs.get("format")
            self.f.close()
            raise DataError(f"{self.path} is not an rl_core rollout archive (format attribute {fmt!r}, expected "
                            f"{FORMAT!r}). Fix: pass a rollouts.h5 written by rl_core.")

    def __enter__(self) -> "RolloutArchive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.f.close()

    @property
    def num_samples(self) -> int:
        return int(self.f.attrs["num_samples"])

    def column(self, name: str) -> np.ndarray:
        """A whole column: `samples/<name>`, `groups/<name>` or `steps/<name>` (e.g. 'groups/staleness')."""
        return self.f[name][...]

    def sample(self, i: int) -> dict[str, Any]:
        s, g = self.f["samples"], self.f["groups"]
        gi = int(s["group"][i])
        out = {k: s[k][i].tolist() for k in ("prompt_ids", "completion_ids", "gen_logprobs", "token_versions")}
        for k in ("step", "start_version", "end_version"):
            out[k] = int(s[k][i])
        out.update(reward=float(s["reward"][i]), advantage=float(s["advantage"][i]),
                   env_mask=bool(s["env_mask"][i]), finish_reason=s["finish_reason"].asstr()[i],
                   rewards={k: float(v[i]) for k, v in s["rewards"].items()},
                   group_id=g["group_id"].asstr()[gi], prompt_index=int(g["prompt_index"][gi]),
                   staleness=int(g["staleness"][gi]))
        for k in ("completion_mask", "turn_starts", "turn_versions"):  # absent in archives of older runs
            if k in s:
                out[k] = s[k][i].tolist()
        out["segments"] = int(s["segments"][i]) if "segments" in s else 1
        if "correct" in s:
            out["correct"] = bool(s["correct"][i])
        if "routed_experts" in s:  # [positions][layers x k]
            flat, width = s["routed_experts"][i], int(s["routed_experts"].attrs["width"])
            out["routed_experts"] = flat.reshape(-1, width).tolist()
        return out

    def summary(self) -> dict[str, Any]:
        s, g, st = self.f["samples"], self.f["groups"], self.f["steps"]
        reward = s["reward"][...]
        comps = {k: float(np.nanmean(v[...])) if np.isfinite(v[...]).any() else math.nan
                 for k, v in s["rewards"].items()}
        if "correct" in s:  # the environment's verdict per sample
            correct = s["correct"][...].astype(np.float32)
        else:  # an archive from before it was recorded
            correct = s["rewards"]["correct"][...] if "correct" in s["rewards"] else (reward > 0).astype(np.float32)
        steps = st["step"][...]
        stale = g["staleness"][...]
        return {
            "path": str(self.path),
            "attrs": {k: (v.item() if hasattr(v, "item") else v) for k, v in self.f.attrs.items()},
            "num_steps": int(steps.size), "num_groups": int(stale.size), "num_samples": int(reward.size),
            "steps": [int(steps.min()), int(steps.max())] if steps.size else None,
            "weight_versions": ([int(s["start_version"][...].min()), int(s["end_version"][...].max())]
                                if reward.size else None),
            "reward": _stats(reward),
            "accuracy": float(np.nanmean(correct)) if reward.size else math.nan,
            "reward_components": comps,
            "advantage": _stats(s["advantage"][...]),
            "staleness": {**_stats(stale), "histogram": {int(k): int(v) for k, v in sorted(Counter(stale.tolist()).items())}},
            "completion_len": _stats(s["completion_len"][...].astype(np.float64)),
            "finish_reasons": dict(Counter(s["finish_reason"].asstr()[...].tolist())),
            "env_masked": int(s["env_mask"][...].sum()),
            "multi_turn_samples": (int(sum(len(x) > 1 for x in s["turn_starts"][...])) if "turn_starts" in s else 0),
            "segment_breaks": int((s["segments"][...] - 1).sum()) if "segments" in s else 0,
            "spanning_refit": int((s["end_version"][...] != s["start_version"][...]).sum()),
        }


# --------------------------------------------------------------------------- rl-core inspect


def find_tokenizer(archive: Path) -> Path | None:
    """The tokenizer directory next to an epoch's archive (its checkpoint's model, else the run's
    init policy) or next to the archive `rl-core train` writes in the run directory (the final,
    else the initial policy)."""
    here = archive.parent
    for cand in (here / "checkpoint" / "model", here.parent / "init_policy", here / "final_policy",
                 here / "init_policy"):
        if (cand / "tokenizer_config.json").is_file() or (cand / "tokenizer.json").is_file():
            return cand
    return None


def _fmt(stats: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in stats.items())


def _check_tokenizer_dir(tok_dir: Path) -> None:
    from rl_core.errors import ArgumentError

    if not tok_dir.is_dir() or not any((tok_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ArgumentError("--tokenizer", str(tok_dir), "an HF directory holding tokenizer.json or "
                            "tokenizer_config.json (e.g. results/<run>/epoch_<k>/checkpoint/model)",
                            "point --tokenizer at such a directory, or leave it out to use the epoch's checkpoint.",
                            "inspect")


def inspect_main(path: str, tokenizer_dir: str | None = None, num_samples: int = 5, step: int | None = None,
                 as_json: bool = False) -> str:
    """The text `rl-core inspect` prints. Options are checked before the archive is read, and a
    damaged archive (missing datasets, unreadable rows) is a `DataError` naming the file."""
    from rl_core.errors import ArgumentError

    p = Path(path)
    if num_samples < 0:
        raise ArgumentError("--num-samples", num_samples, "0 or more samples to print",
                            "pass e.g. --num-samples 5 (0 prints only the statistics).", "inspect")
    if tokenizer_dir:
        _check_tokenizer_dir(Path(tokenizer_dir))
    with RolloutArchive(p) as ar:
        verified = ar.verified
        try:
            summ = ar.summary()
            if as_json:
                return json.dumps(summ, indent=2)
            steps = ar.column("samples/step")
            if step is not None and not (steps == step).any():
                have = sorted({int(x) for x in np.unique(steps)})
                span = f"steps {have[0]}..{have[-1]}" if have else "no steps"
                raise ArgumentError("--step", step, f"an RL step recorded in {p} ({span})",
                                    f"pass one of those steps, or leave --step out to see all.", "inspect")
            rows = np.flatnonzero(steps == step) if step is not None else np.arange(steps.size)
            picked = [ar.sample(int(i)) for i in rows[:num_samples]]
        except (KeyError, OSError, ValueError, IndexError, TypeError) as exc:
            raise DataError(f"Rollout archive {p} is damaged: reading it failed ({type(exc).__name__}: {exc}). Fix: "
                            f"rebuild it from the epoch's spool (rerun the archive_rollouts rule, e.g. delete the "
                            f"file and rerun snakemake).") from None
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else find_tokenizer(p)
    decode = None
    if tok_dir is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load names the directory
            how = "--tokenizer" if tokenizer_dir else "found next to the archive"
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise DataError(f"Tokenizer directory {tok_dir} ({how}) cannot be loaded ({type(exc).__name__}: {first}). "
                            f"Fix: pass --tokenizer with a working HF tokenizer directory (e.g. the epoch's "
                            f"checkpoint/model).") from None
        decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    a = summ["attrs"]
    check = "checksum verified" if verified else f"unverified: no {manifest_path(p).name} (written before checksums)"
    lines = [f"{p}: run {a.get('run', '?')}, epoch {a.get('epoch', '?')} ({check})",
             f"  {summ['num_steps']} steps {summ['steps']}, {summ['num_groups']} groups, {summ['num_samples']} samples;"
             f" weight versions {summ['weight_versions']}",
             f"  reward       {_fmt(summ['reward'])}",
             f"  accuracy     {summ['accuracy']:.4f}",
             f"  components   " + "  ".join(f"{k} {v:.4g}" for k, v in summ["reward_components"].items()),
             f"  advantage    {_fmt(summ['advantage'])}",
             f"  staleness    {_fmt({k: v for k, v in summ['staleness'].items() if k != 'histogram'})}  "
             f"histogram {summ['staleness']['histogram']}",
             f"  completion   {_fmt(summ['completion_len'])} tokens; finish {summ['finish_reasons']}",
             f"  env-masked {summ['env_masked']} samples; {summ['spanning_refit']} samples span a refit; "
             f"{summ['multi_turn_samples']} multi-turn samples, {summ['segment_breaks']} segment breaks"]
    where = f"step {step}" if step is not None else "the archive"
    lines.append(f"samples (first {len(picked)} of {where}"
                 + (f", decoded with {tok_dir})" if decode else "; token ids: no tokenizer found, pass --tokenizer)"))
    for s in picked:
        if decode:
            prompt, completion = repr(decode(s["prompt_ids"])), repr(decode(s["completion_ids"]))
        else:
            prompt, completion = str(s["prompt_ids"]), str(s["completion_ids"])
        lines.append(f"  [step {s['step']} {s['group_id']}] {prompt} -> {completion}  reward {s['reward']:.3g} "
                     f"adv {s['advantage']:+.3f} v{s['start_version']}->v{s['end_version']} stale {s['staleness']} "
                     f"{s['finish_reason']}{' MASKED' if s['env_mask'] else ''}")
        if len(s.get("turn_starts") or []) > 1:
            mask = s.get("completion_mask") or []
            lines.append(f"    turns {len(s['turn_starts'])} starting at completion tokens {s['turn_starts']}, versions "
                         f"{s['turn_versions']}; {mask.count(0)} observation tokens masked out of the loss"
                         + (f"; {s['segments']} segments (the last trained)" if s.get("segments", 1) > 1 else ""))
        if s.get("routed_experts"):
            r = s["routed_experts"]
            lines.append(f"    routed experts: {len(r)} positions x {len(r[0])} ids (layers x k); first {r[0]}")
    return "\n".join(lines) + "\n"

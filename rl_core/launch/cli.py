"""The `rl-core` command line.

Owns: subcommands, their arguments and help, and the user-facing error contract: a
`UserError` (bad recipe, missing file, corrupt checkpoint) prints one paragraph and exits
with status 2, no traceback. Heavy modules (torch, transformers) are imported inside the
subcommands that need them, so `rl-core validate` stays fast and builds nothing.

Does not own: what the subcommands do (rl_core.launch.*, rl_core.model, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_core.errors import UserError


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.max_num_steps=300")


def cmd_validate(args) -> int:
    from rl_core.config import load_recipe, run_dir, write_resolved
    from rl_core.config.loader import check_output_dir

    if args.out:  # before the recipe's own checks: a bad --out is named as such
        check_output_dir(args.out, "--out")
    cfg = load_recipe(args.recipe, args.overrides)
    out = Path(args.out) if args.out else run_dir(cfg)
    path = write_resolved(cfg, out, field="--out" if args.out else "output_dir")
    print(f"recipe OK: {args.recipe} -> {path}")
    return 0


def cmd_docs(args) -> int:
    from rl_core.config.docs import render_docs

    sys.stdout.write(render_docs(args.format))
    return 0


def cmd_make_data(args) -> int:
    from rl_core.data.addition import check_make_data_args, make_addition_data

    check_make_data_args(args.out, args.num_val, seed=args.seed, force=args.force)  # before anything is written
    make_addition_data(args.out, num_val=args.num_val, seed=args.seed)
    print(f"wrote {args.out}/train.jsonl and {args.out}/val.jsonl")
    return 0


def _check_init_policy_out(out: Path, force: bool, explicit: bool) -> bool:
    """Whether `out` is to be (re)built. Never deletes or overwrites a user's path: an existing
    non-empty directory is rebuilt only with --force and only if rl_core wrote it (its marker);
    a complete policy rl_core wrote is reused without --force (after the recipe shape check)."""
    from rl_core.errors import OutputPathError
    from rl_core.fsutil import MARKER, check_replaceable, has_marker
    from rl_core.launch.train import policy_is_complete

    named = f"--out {out}" if explicit else f"the run's initial policy directory {out}"
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputPathError(f"{named[0].upper()}{named[1:]} exists and is not a directory; rl_core never deletes or "
                              f"overwrites a file it did not write. Fix: choose another --out, or move {out} away.")
    if not out.exists() or not any(out.iterdir()):
        return True
    if force:
        check_replaceable(out, "initial policy directory", "--out" if explicit else None)
        return True
    if policy_is_complete(out) and has_marker(out):
        return False
    foreign = "" if has_marker(out) else f" and was not written by rl_core (it has no {MARKER} marker file)"
    raise OutputPathError(
        f"{named[0].upper()}{named[1:]} exists, is not empty{foreign}; rl_core does not replace it unasked. Fix: "
        f"choose another --out, or pass --force to rebuild it (only a directory rl_core wrote is ever replaced), "
        f"or move {out} away yourself.")


def cmd_init_policy(args) -> int:
    from rl_core.config import load_recipe, run_dir, write_resolved
    from rl_core.launch.train import ensure_policy

    cfg = load_recipe(args.recipe, args.overrides)
    rd = run_dir(cfg)
    out = Path(args.out) if args.out else rd / "init_policy"
    build = _check_init_policy_out(out, args.force, bool(args.out))  # before anything is written
    if build:
        from rl_core.model.init_policy import init_policy

        write_resolved(cfg, rd)
        init_policy(cfg, out)  # replaces only an empty directory or one rl_core wrote
        print(f"policy ready: {out}")
    else:
        ensure_policy(cfg, out, args.recipe)  # checks its shape against the recipe
        write_resolved(cfg, rd)
        print(f"policy ready: {out} (already built for this recipe; reused, --force rebuilds it)")
    return 0


def cmd_train(args) -> int:
    from rl_core.config import load_recipe
    from rl_core.launch.train import train_from_recipe

    cfg = load_recipe(args.recipe, args.overrides)
    summary = train_from_recipe(cfg, resume_from=args.resume_from, recipe=args.recipe)
    if not summary:  # a worker rank of a multi-process trainer: rank 0 reports
        return 0
    vs, ve = summary.get("val_start"), summary.get("val_end")
    print(json.dumps({k: summary[k] for k in ("run_name", "rl_steps", "wall_s", "max_staleness")}, indent=None))
    if vs and ve:
        print(f"held-out accuracy: {vs['accuracy']:.3f} before RL -> {ve['accuracy']:.3f} after "
              f"{summary['rl_steps']} RL steps ({(ve['accuracy'] - vs['accuracy']) * 100:+.1f} points)")
    return 0


def cmd_inspect(args) -> int:
    from rl_core.archive import inspect_main

    sys.stdout.write(inspect_main(args.path, args.tokenizer, args.num_samples, args.step, args.json))  # checks its args first
    return 0


def cmd_serve(args) -> int:
    from rl_core.launch.serve import cmd_serve as serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl-core", description="Asynchronous RL post-training for language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a recipe, write its resolved config, build nothing")
    _recipe_args(p)
    p.add_argument("--out", help="directory for resolved_config.json (default: <output_dir>/<run_name>)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("docs", help="print every recipe field with its type, default and meaning")
    p.add_argument("--format", choices=["text", "markdown"], default="text")
    p.set_defaults(func=cmd_docs)

    p = sub.add_parser("make-data", help="generate a toy task's data files")
    p.add_argument("task", choices=["addition"])
    p.add_argument("--out", default="data/addition")
    p.add_argument("--num-val", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true",
                   help="overwrite train.jsonl / val.jsonl in --out even when they hold other data")
    p.set_defaults(func=cmd_make_data)

    p = sub.add_parser("init-policy", help="build (and warm up) or import the initial policy")
    _recipe_args(p)
    p.add_argument("--out", help="output HF directory (default: <run dir>/init_policy); an existing non-empty one "
                                 "is refused unless --force (a policy already built for this recipe is reused)")
    p.add_argument("--force", action="store_true",
                   help="rebuild and replace an existing --out, but only a directory rl_core wrote (it carries the "
                        ".rl_core-output marker file); a user's directory or a file is never replaced")
    p.set_defaults(func=cmd_init_policy)

    p = sub.add_parser("train", help="run RL end to end in this process (init policy if needed, train, validate)")
    _recipe_args(p)
    p.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="continue from this step checkpoint (e.g. results/<run>/steps/step_000008) instead of the "
                        "newest intact one; checked before anything is built; the run's newer step checkpoints are "
                        "moved to <run dir>/set_aside_checkpoints/")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("inspect", help="summary statistics and samples of an epoch's rollout archive (rollouts.h5)")
    p.add_argument("path", help="results/<run>/epoch_<k>/rollouts.h5")
    p.add_argument("--tokenizer", help="HF directory to decode tokens (default: the epoch's checkpoint/model)")
    p.add_argument("--num-samples", type=int, default=5, help="samples to print (default 5)")
    p.add_argument("--step", type=int, help="only samples of this RL step")
    p.add_argument("--json", action="store_true", help="print the summary statistics as JSON")
    p.set_defaults(func=cmd_inspect)

    from rl_core.launch.serve import add_serve_args

    p = sub.add_parser("serve", help="serve a model with the native engine over an OpenAI-compatible HTTP API")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # overrides may also follow options (`validate R --out D a.b=1`): collect them here
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"rl-core {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

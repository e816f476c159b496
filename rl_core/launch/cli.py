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
    from rl_core.data.addition import make_addition_data

    make_addition_data(args.out, num_val=args.num_val, seed=args.seed)
    print(f"wrote {args.out}/train.jsonl and {args.out}/val.jsonl")
    return 0


def cmd_init_policy(args) -> int:
    from rl_core.config import load_recipe, run_dir, write_resolved
    from rl_core.launch.train import ensure_policy

    cfg = load_recipe(args.recipe, args.overrides)
    rd = run_dir(cfg)
    write_resolved(cfg, rd)
    out = Path(args.out) if args.out else rd / "init_policy"
    ensure_policy(cfg, out)
    print(f"policy ready: {out}")
    return 0


def cmd_train(args) -> int:
    from rl_core.config import load_recipe
    from rl_core.launch.train import train_from_recipe

    cfg = load_recipe(args.recipe, args.overrides)
    summary = train_from_recipe(cfg)
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

    sys.stdout.write(inspect_main(args.path, args.tokenizer, args.num_samples, args.step, args.json))
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
    p.set_defaults(func=cmd_make_data)

    p = sub.add_parser("init-policy", help="build (and warm up) or import the initial policy")
    _recipe_args(p)
    p.add_argument("--out", help="output HF directory (default: <run dir>/init_policy)")
    p.set_defaults(func=cmd_init_policy)

    p = sub.add_parser("train", help="run RL end to end in this process (init policy if needed, train, validate)")
    _recipe_args(p)
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

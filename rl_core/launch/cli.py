"""The `rl-core` command line.

Owns: subcommands, their arguments and help, and the user-facing error contract: a
`UserError` (bad recipe, missing file, corrupt checkpoint, a run stopped by a failing
agent or environment) prints one paragraph and exits with status 2, no traceback (a failed
`rl-core train` appends it to <run dir>/logs/train.log). Heavy modules (torch,
transformers) are imported inside the subcommands that need them, so `rl-core validate`
stays fast and builds nothing.

Does not own: what the subcommands do (rl_core.launch.*, rl_core.model, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rl_core.errors import UserError


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.max_num_steps=300")


def cmd_validate(args) -> int:
    from rl_core.config import run_dir, write_resolved
    from rl_core.config.loader import check_output_dir
    from rl_core.launch.preflight import load_recipe

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
    if args.task == "arithmetic":
        return _make_arithmetic(args)
    if args.task == "reasoning_gym":
        return _make_reasoning_gym_data(args)
    from rl_core.data.addition import check_make_data_args, make_addition_data

    for opt in ("name", "config", "num_train"):
        if getattr(args, opt) is not None:
            from rl_core.errors import ArgumentError

            raise ArgumentError(f"--{opt.replace('_', '-')}", getattr(args, opt), "no value for the addition task "
                                "(it is a reasoning_gym option)", "remove it, or run `rl-core make-data reasoning_gym`.",
                                "make-data")
    out = args.out or "data/addition"
    num_val = 1000 if args.num_val is None else args.num_val
    check_make_data_args(out, num_val, seed=args.seed, force=args.force)  # before anything is written
    make_addition_data(out, num_val=num_val, seed=args.seed)
    print(f"wrote {out}/train.jsonl and {out}/val.jsonl")
    return 0


def _make_reasoning_gym_data(args) -> int:
    from rl_core.data.reasoning_gym import TRAIN_FILE, VAL_FILE, make_reasoning_gym_data, reasoning_gym_examples
    from rl_core.data.addition import refuse_other_content, to_jsonl
    from rl_core.errors import ArgumentError

    if not args.name:
        raise ArgumentError("--name", None, "a reasoning-gym task name", "pass e.g. --name basic_arithmetic.",
                            "make-data")
    try:
        config = json.loads(args.config) if args.config else {}
    except json.JSONDecodeError as exc:
        raise ArgumentError("--config", args.config, f"a JSON object of the task's settings ({exc.msg})",
                            """pass e.g. --config '{"min_terms": 2, "max_terms": 2}'.""", "make-data") from None
    if not isinstance(config, dict):
        raise ArgumentError("--config", args.config, "a JSON object of the task's settings",
                            """pass e.g. --config '{"min_terms": 2, "max_terms": 2}'.""", "make-data")
    num_train = 2000 if args.num_train is None else args.num_train
    num_val = 200 if args.num_val is None else args.num_val
    from rl_core.config.model_sections import MAX_GENERATED_TRAIN, MAX_GENERATED_VAL

    for opt, value, most in (("--num-train", num_train, MAX_GENERATED_TRAIN), ("--num-val", num_val, MAX_GENERATED_VAL)):
        if not 1 <= value <= most:
            raise ArgumentError(opt, value, f"a number of examples in [1, {most:,}] (the set is generated in memory)",
                                f"pass e.g. {opt} 200.", "make-data")
    out = Path(args.out or f"data/reasoning_gym/{args.name}")
    if out.exists() and not out.is_dir():
        raise ArgumentError("--out", str(out), "a directory to write train.jsonl and val.jsonl into (created if missing)",
                            f"{out} is a file; choose another --out (rl_core does not overwrite it).", "make-data")
    if not args.force and any((out / n).exists() for n in (TRAIN_FILE, VAL_FILE)):
        train, val = reasoning_gym_examples(args.name, config, num_train, num_val, args.seed)
        for name, rows in ((TRAIN_FILE, train), (VAL_FILE, val)):
            refuse_other_content(out, name, to_jsonl(rows))
    summary = make_reasoning_gym_data(out, args.name, config, num_train, num_val, args.seed)
    print(f"wrote {summary['num_train']} training and {summary['num_val']} held-out examples of {args.name}: "
          f"{summary['train_file']}, {summary['val_file']}")
    return 0


def _make_arithmetic(args) -> int:
    from rl_core.data import arithmetic as ar
    from rl_core.data.addition import refuse_other_content
    from rl_core.errors import ArgumentError

    out = Path(args.out or "data/arithmetic")
    num_val = ar.DEFAULT_NUM_VAL if args.num_val is None else args.num_val
    kw = dict(num_val=num_val, seed=args.seed, min_operand=args.min_operand, max_operand=args.max_operand, ops=args.ops)
    ar.check_args(args.min_operand, args.max_operand, args.ops, num_val)  # before anything is written
    if out.exists() and not out.is_dir():
        raise ArgumentError("--out", str(out), "a directory to write train.jsonl and val.jsonl into (created if missing)",
                            f"{out} is a file; choose another --out (rl_core does not overwrite it).", "make-data")
    if not args.force:
        for name, text in ar.expected_files(**kw).items():
            refuse_other_content(out, name, text)
    summary = ar.make_arithmetic_data(out, **kw)
    print(f"wrote {summary['num_train']} training and {summary['num_val']} held-out examples: "
          f"{summary['train_file']}, {summary['val_file']}")
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
    from rl_core.config import run_dir, write_resolved
    from rl_core.launch.preflight import load_recipe
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


def log_failure(exc: BaseException, log_path: Path) -> Path:
    """Append `exc`'s full traceback to `log_path` (the console shows its one paragraph)."""
    import time
    import traceback

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as fh:
        fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {' '.join(sys.argv)}\n")
        fh.write("".join(traceback.format_exception(exc)) + "\n")
    return log_path


def cmd_train(args) -> int:
    from rl_core.config import run_dir
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import headline, train_from_recipe

    cfg = load_recipe(args.recipe, args.overrides)
    try:
        summary = train_from_recipe(cfg, resume_from=args.resume_from, recipe=args.recipe)
    except UserError as exc:
        if exc.__cause__ is not None:  # the run failed (a user's agent raised, a retry budget ran out): the trace
            exc.log_path = str(log_failure(exc, run_dir(cfg) / "logs" / "train.log"))
        raise
    if not summary:  # a worker rank of a multi-process trainer: rank 0 reports
        return 0
    print(json.dumps({k: summary[k] for k in ("run_name", "rl_steps", "wall_s", "max_staleness")}, indent=None))
    if summary.get("rollouts"):
        print(f"rollouts: {summary['rollouts']} (rl-core inspect {summary['rollouts']})")
    if (line := headline(summary)) is not None:
        print(line)
    return 0


def cmd_inspect(args) -> int:
    from rl_core.archive import inspect_main

    sys.stdout.write(inspect_main(args.path, args.tokenizer, args.num_samples, args.step, args.json))  # checks its args first
    return 0


def cmd_serve(args) -> int:
    from rl_core.launch.serve import cmd_serve as serve

    return serve(args)


def cmd_completion(args) -> int:
    from rl_core.launch.completion import completion_script

    sys.stdout.write(completion_script(build_parser(), args.shell))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from rl_core import package_version

    parser = argparse.ArgumentParser(prog="rl-core", description="Asynchronous RL post-training for language models.")
    parser.add_argument("--version", action="version", version=f"rl-core {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a recipe, write its resolved config, build nothing")
    _recipe_args(p)
    p.add_argument("--out", help="directory for resolved_config.json (default: <output_dir>/<run_name>)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("docs", help="print every recipe field with its type, default and meaning")
    p.add_argument("--format", choices=["text", "markdown"], default="text")
    p.set_defaults(func=cmd_docs)

    p = sub.add_parser("make-data", help="generate a task's data files (train.jsonl, val.jsonl)")
    p.add_argument("task", choices=["addition", "arithmetic", "reasoning_gym"],
                   help="addition: the toy task; arithmetic: '3 + 4' for a pretrained chat model "
                        "(recipes/smollm2-arithmetic.yaml); reasoning_gym: a reasoning-gym task (--name, --config), "
                        "generated with seeds (the same arguments write the same files)")
    p.add_argument("--out", default=None, help="directory to write (default data/addition, or "
                                               "data/arithmetic, or data/reasoning_gym/<name>)")
    p.add_argument("--num-val", type=int, default=None, help="held-out examples (default 1000 for addition, 32 for "
                                                             "arithmetic, 200 for reasoning_gym)")
    p.add_argument("--seed", type=int, default=0, help="seed (reasoning_gym: of the training set; the held-out set uses seed + 10^9)")
    p.add_argument("--name", default=None, help="reasoning_gym: the task name (e.g. basic_arithmetic)")
    p.add_argument("--config", default=None, help="reasoning_gym: the task's settings as a JSON object (the recipe's "
                                                  "env.config must be the same)")
    p.add_argument("--num-train", type=int, default=None, help="reasoning_gym: training examples (default 2000)")
    p.add_argument("--min-operand", type=int, default=1, help="arithmetic: smallest operand (default 1)")
    p.add_argument("--max-operand", type=int, default=9, help="arithmetic: largest operand (default 9)")
    p.add_argument("--ops", default="+", help="arithmetic: operators, from + - * (default +)")
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

    p = sub.add_parser("inspect", help="summary statistics and samples of a rollout archive (rollouts.h5)")
    p.add_argument("path", help="results/<run>/epoch_<k>/rollouts.h5 (a workflow epoch) or results/<run>/rollouts.h5 "
                                "(`rl-core train`)")
    p.add_argument("--tokenizer", help="HF directory to decode tokens (default: the epoch's checkpoint/model)")
    p.add_argument("--num-samples", type=int, default=5, help="samples to print (default 5)")
    p.add_argument("--step", type=int, help="only samples of this RL step")
    p.add_argument("--json", action="store_true", help="print the summary statistics as JSON")
    p.set_defaults(func=cmd_inspect)

    from rl_core.launch.serve import add_serve_args

    p = sub.add_parser("serve", help="serve a model with the native engine over an OpenAI-compatible HTTP API")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("completion", help="print the shell completion script (bash or zsh): "
                                          "`source <(rl-core completion bash)` in ~/.bashrc")
    p.add_argument("shell", choices=["bash", "zsh"])
    p.set_defaults(func=cmd_completion)

    from rl_core.launch.new_project import add_new_args

    add_new_args(sub.add_parser("new", help="write a runnable workflow project (Snakefile, workflow/, profiles/, "
                                            "config/, recipes/, data/) into a new folder"))
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
        log = f" (full traceback: {exc.log_path})" if exc.log_path else ""
        print(f"rl-core {args.command}: {exc}{log}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

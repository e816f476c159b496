"""`rl-core new DIR`: a runnable workflow project, from the installed package alone.

Owns: finding the project files (`template_root`: rl_core/project/ in a wheel, which the
build step setup.py fills from the repository; the checkout itself in an editable install),
writing them into a new folder with the recipes' data (generated with the same commands as
`rl-core make-data`, byte-identical to the repository's data/), and the command's arguments.
Nothing is written into an existing folder that is not empty, and the project appears whole
or not at all (built in a hidden sibling, renamed into place).

Does not own: the list of project files (project_files.py), the workflow itself
(Snakefile, workflow/). README.md, "Workflow", tells what a project runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from rl_core.launch.project_files import PACKAGED_DIR, PROJECT_FILES, copy_project

GITIGNORE = "# what the workflow writes\nresults/\n.snakemake/\n"
REQUIREMENT = "workflow/envs/rl_core-requirement.txt"  # what `--sdm conda` installs outside a clone


def template_root() -> Path:
    """Where the project files are: the wheel's rl_core/project/, else the source checkout."""
    import rl_core
    from rl_core.errors import UserError

    package = Path(rl_core.__file__).resolve().parent
    for root in (package / PACKAGED_DIR, package.parent):
        if all((root / name).exists() for name in PROJECT_FILES):
            return root
    raise UserError(f"rl-core new: this installation of rl_core ({package}) carries no workflow project: neither "
                    f"{package / PACKAGED_DIR}/ nor a source checkout around it holds {', '.join(PROJECT_FILES)}. "
                    "Fix: reinstall rl_core from its wheel (built by `pip wheel`, which packages them), or run "
                    "`rl-core new` from an editable install of a clone.")


def _check_target(out: Path) -> None:
    from rl_core.errors import ArgumentError

    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ArgumentError("DIR", str(out), "a new folder (created) or an empty one",
                            f"{out} exists and is not a folder; choose another DIR (rl_core does not replace it).",
                            "new")
    if out.is_dir() and any(out.iterdir()):
        raise ArgumentError("DIR", str(out), "a new folder (created) or an empty one",
                            f"{out} is not empty; choose a new DIR (rl_core never writes into a folder it did not "
                            "create), or empty it yourself.", "new")


def new_project(out_dir: str | os.PathLike) -> dict:
    """Write the workflow project into `out_dir` (new or empty); returns what was written."""
    from importlib.metadata import PackageNotFoundError, version

    from rl_core.data.addition import make_addition_data
    from rl_core.data.arithmetic import make_arithmetic_data

    out = Path(out_dir)
    _check_target(out)  # before anything is read or written
    root = template_root()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.new{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        copy_project(root, tmp)
        make_addition_data(tmp / "data" / "addition")  # what `rl-core make-data addition` writes
        make_arithmetic_data(tmp / "data" / "arithmetic")  # `rl-core make-data arithmetic`
        try:
            pin = f"rl_core=={version('rl_core')}"
        except PackageNotFoundError:  # a checkout on sys.path, not installed
            pin = "rl_core"
        (tmp / REQUIREMENT).write_text("# rl_core for `snakemake --sdm conda` (workflow/envs/rl_core.post-deploy.sh);\n"
                                       f"# replace it with the path of the wheel you installed it from if need be\n{pin}\n")
        (tmp / ".gitignore").write_text(GITIGNORE)
        if out.is_dir():
            out.rmdir()  # empty (checked): the project takes its place
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    recipes = sorted(p.name for p in (out / "recipes").glob("*.yaml"))
    return {"dir": str(out), "from": str(root), "recipes": recipes}


def add_new_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the project folder to write (new, or empty)")
    p.set_defaults(func=cmd_new)


def cmd_new(args) -> int:
    info = new_project(args.dir)
    d = info["dir"]
    print(f"wrote a workflow project into {d}: Snakefile, workflow/, profiles/, config/config.yaml, "
          f"recipes/ ({', '.join(info['recipes'])}), data/addition, data/arithmetic\n"
          f"next:\n  cd {d}\n"
          "  snakemake --cores 2 --config recipe=recipes/tiny-addition-short.yaml run=short   # a short run\n"
          "  snakemake --cores 2                                 # the default recipe (config/config.yaml)\n"
          "  snakemake --profile profiles/slurm                  # the same on Slurm")
    return 0

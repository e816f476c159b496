#!/usr/bin/env bash
# Runs inside the new conda env, in snakemake's working directory: a clone of rl_core (it has
# pyproject.toml) or a project written by `rl-core new` (rl_core as pinned in
# workflow/envs/rl_core-requirement.txt).
set -euo pipefail
if [ -f pyproject.toml ]; then
  python -m pip install --disable-pip-version-check -c constraints.txt -e .
else
  python -m pip install --disable-pip-version-check -c constraints.txt -r workflow/envs/rl_core-requirement.txt
fi

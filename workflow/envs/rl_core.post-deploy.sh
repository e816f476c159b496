#!/usr/bin/env bash
# Runs inside the new conda env, in snakemake's working directory (the repository root).
set -euo pipefail
python -m pip install --disable-pip-version-check -r requirements.txt
python -m pip install --disable-pip-version-check --no-deps -e .

#!/usr/bin/env bash
# Runs inside the new conda env, in snakemake's working directory (the repository root).
set -euo pipefail
python -m pip install --disable-pip-version-check -c constraints.txt -e .

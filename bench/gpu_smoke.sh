#!/usr/bin/env bash
# GPU smoke check for dflash-staged: under 8 minutes on one H100/H200. Run from anywhere:
#
#   bench/gpu_smoke.sh [--out DIR] [--skip-tests]
#
# Steps (bench/gpu_smoke.py): the CUDA-marked tests; the kernel preflight + a real extract on a
# tiny hybrid target (tiny:qwen3_5, bf16: passes with flash-linear-attention + causal-conv1d,
# refuses without them); extract tokens/s vs a bare forward (goal >= 0.9x); extract + train side
# by side through the launcher for a few bf16 drafter steps; with 2+ GPUs, a TP=2 extract (NCCL) on a
# tiny MoE target with a kill -9 of the follower (skipped with one GPU). The last line is one JSON object.
#
# Which Python (DFLASH_USE_SYSTEM_TORCH):
#   1     use ${PYTHON:-python3} as it is (an offline GPU machine with torch, transformers, zarr,
#         ... preinstalled; this checkout is put on PYTHONPATH; nothing is installed)
#   0     set up / refresh .venv with bin/_env.sh (pip; needs the package index or a wheelhouse:
#         PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels, see docs/gpu.md)
#   auto  (default) .venv if it exists with a CUDA torch, else the system Python if it has a
#         CUDA torch, else as 0
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
mode="${DFLASH_USE_SYSTEM_TORCH:-auto}"
SYS_PY="${PYTHON:-python3}"
if [ "$mode" = "auto" ]; then
  if [ -x .venv/bin/python ] && cuda_torch .venv/bin/python; then mode=venv-as-is
  elif cuda_torch "$SYS_PY"; then mode=1
  else mode=0; fi
fi
case "$mode" in
  1) PY="$SYS_PY"; export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" ;;
  venv-as-is) PY="$ROOT/.venv/bin/python" ;;
  *) source "$ROOT/bin/_env.sh" || { echo '{"ok": false, "error": "bin/_env.sh could not set up .venv"}'; exit 2; }
     PY="$VENV_PY" ;;
esac
echo "[gpu_smoke] python: $PY (DFLASH_USE_SYSTEM_TORCH=${DFLASH_USE_SYSTEM_TORCH:-auto} -> $mode)" >&2
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" "$ROOT/bench/gpu_smoke.py" "$@"

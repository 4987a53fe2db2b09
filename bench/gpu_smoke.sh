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
#         CUDA torch (or a CUDA build of torch that sees no GPU: gpu_smoke.py then says why), else as 0
# Any failure before gpu_smoke.py starts still ends with one JSON line ({"ok": false, "error": ...}).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
fail() { printf '{"ok": false, "error": "%s"}\n' "$1"; exit 2; }
torch_has() { "$1" -c "import torch, sys; sys.exit(0 if $2 else 1)" >/dev/null 2>&1; }
mode="${DFLASH_USE_SYSTEM_TORCH:-auto}"
SYS_PY="${PYTHON:-python3}"
if [ "$mode" = "auto" ]; then
  if [ -x .venv/bin/python ] && torch_has .venv/bin/python "torch.cuda.is_available()"; then mode=venv-as-is
  elif torch_has "$SYS_PY" "torch.cuda.is_available()" || torch_has "$SYS_PY" "torch.version.cuda"; then mode=1
  else mode=0; fi
fi
case "$mode" in
  1) PY="$SYS_PY"; export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" ;;
  venv-as-is) PY="$ROOT/.venv/bin/python" ;;
  *) # In a subshell: _env.sh exits (set -e) on a failure, e.g. pip without network or wheelhouse.
     # One retry, not pip's five, so an offline machine fails in seconds.
     ( export PIP_RETRIES="${PIP_RETRIES:-1}"; source "$ROOT/bin/_env.sh" ) >&2  # not in ||: keeps set -e
     [ $? -eq 0 ] || fail "bin/_env.sh could not set up .venv (pip needs the package index, or a wheelhouse: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR; with a CUDA torch preinstalled use DFLASH_USE_SYSTEM_TORCH=1; see docs/gpu.md)"
     PY="$ROOT/.venv/bin/python" ;;
esac
command -v "$PY" >/dev/null 2>&1 || fail "no Python at $PY (set PYTHON)"
echo "[gpu_smoke] python: $PY (DFLASH_USE_SYSTEM_TORCH=${DFLASH_USE_SYSTEM_TORCH:-auto} -> $mode)" >&2
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" "$ROOT/bench/gpu_smoke.py" "$@"

#!/usr/bin/env bash
# GPU smoke check for dflash-staged, sized for the borrowed GPU machine (one H200, 15 minutes in all,
# at most 10 a command, nothing fetchable, 8 files back). The documented calls (docs/gpu.md):
#
#   bench/gpu_smoke.sh --budget-s 500 --out "$OUT/a"                      # call 1: does training fit, how fast
#   bench/gpu_smoke.sh --budget-s 500 --out "$OUT/b" --skip recipe_train  # call 2: the rest
#
# with `.whl` carried (bench/gpu_wheels.sh fills it on a machine with the package index).
# Which Python: ${PYTHON:-python3} (the GPU image's own, with CUDA torch), or this checkout's .venv when
# DFLASH_USE_SYSTEM_TORCH=0 and it exists. When .whl/ holds wheels they are installed first, offline:
# `pip install --no-index --no-deps --target` a temporary site directory put on PYTHONPATH (the
# image's torch stays the one used). Steps, budget, verdicts and outputs: bench/gpu_smoke.py.
# Any failure before gpu_smoke.py starts still writes OUT/gpu_smoke.json and prints one JSON line.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--out" ] && OUT="${args[$((i + 1))]:-}"
done
fail() {
  local line
  line=$(printf '{"ok": false, "status": "failed", "error": "%s", "steps": {}}' "$1")
  [ -n "$OUT" ] && mkdir -p "$OUT" && echo "$line" > "$OUT/gpu_smoke.json"
  echo "$line"
  exit 2
}
if [ "${DFLASH_USE_SYSTEM_TORCH:-1}" = "0" ] && [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY="${PYTHON:-python3}"
fi
command -v "$PY" >/dev/null 2>&1 || fail "no Python at $PY (set PYTHON)"
SITE=""
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  SITE="${DFLASH_SMOKE_SITE:-${TMPDIR:-/tmp}/dflash-smoke-site}"
  rm -rf "$SITE"
  echo "[gpu_smoke] installing $(ls "$ROOT"/.whl/*.whl | wc -l) carried wheels from .whl/ into $SITE (offline)" >&2
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$ROOT"/.whl/*.whl >&2 \
    || fail "pip could not install the carried wheels in .whl/ (one version of each, cp312 or pure Python: bench/gpu_wheels.sh)"
fi
export PYTHONPATH="${SITE:+$SITE:}$ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "[gpu_smoke] python: $PY; PYTHONPATH=$PYTHONPATH" >&2
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" "$ROOT/bench/gpu_smoke.py" "$@"

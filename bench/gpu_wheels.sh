#!/usr/bin/env bash
# Download, on a machine with the package index, exactly the wheels the GPU machine's image lacks, into
# .whl/ (ignored by git; it travels with `run(carry=[".whl"])`), for bench/gpu_smoke.sh to install there
# with `pip install --no-index --no-deps --target` (no index is reachable from the GPU machine).
#
#   bench/gpu_wheels.sh [DIR]            # default DIR: .whl in the repository root
#
# The image (docs/gpu.md) has Python 3.12, torch 2.11 + CUDA 13, transformers, triton, accelerate,
# numpy, pyarrow, hypothesis, pytest, xxhash, safetensors, tokenizers, click, tqdm, einops, pyyaml,
# packaging, typing-extensions; it lacks the store's zarr and its codecs, and the hybrid targets' fast
# kernels. One version each (two versions of a package stop the whole install), cp312 manylinux x86-64
# or pure Python, --no-deps (every dependency is named here or is in the image). causal-conv1d is
# optional and has no wheel on the index (it builds from source): it is not carried.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
WHEELS=(
  "zarr==3.1.6"                     # the shard store
  "numcodecs==0.16.6"               # zarr's codecs (cp312 manylinux)
  "donfig==0.8.1.post1"             # zarr's config
  "google-crc32c==1.9.0"            # zarr's checksums (cp312 manylinux)
  "flash-linear-attention==0.6.0"   # the hybrid targets' linear-attention kernels (fla, pure Python + Triton)
  "fla-core==0.6.0"                 # fla.ops, the kernels themselves (pure Python + Triton)
)
mkdir -p "$DIR"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$DIR" "${WHEELS[@]}"
n=$(ls "$DIR"/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "gpu_wheels: $n wheels in $DIR, expected ${#WHEELS[@]} (one each)" >&2; exit 1; }
echo "gpu_wheels: $n wheels, $(du -sh "$DIR" | cut -f1) in $DIR:"
ls -1 "$DIR"

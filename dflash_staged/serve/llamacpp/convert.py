"""GGUF files for llama.cpp, written by llama.cpp's own converter (never a rewrite of it).

Contract:

* :func:`convert` runs the pinned tree's ``convert_hf_to_gguf.py`` (:mod:`.build`) with this Python
  (it needs torch, numpy, transformers and sentencepiece, which the project installs) on a Hugging Face
  directory: a target, or a drafter with ``--target-model-dir`` (the converter takes the tokenizer, and
  for DSpark a shared head's shape, from the target). The converter registers ``DFlashDraftModel`` and
  ``DFlash2DraftModel`` (class ``DFlashModel``) and ``Qwen3DSparkModel`` (``DSparkModel``), and writes
  the tapped layers as ``target_layer_ids + 1``: llama.cpp captures a layer's *input*, the output of the
  layer before.
* **Atomic.** The converter writes a temporary sibling, which is fsynced and renamed; the directory is
  fsynced. A failed conversion leaves no file and raises one line ending with the converter's last
  message (its full output is in ``<out>.log``).
* **Cached.** Next to the file, ``<out>.source.json`` records the converted directory's files (name and
  an XXH3-128 digest of the content) and the outtype: :func:`convert` skips a conversion whose record
  matches. Keyed by content, never by size and time: a checkpoint saved again within the same second
  (the same size, the same whole-second mtime) is converted again.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import xxhash

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import fsync_dir, fsync_path, temp_sibling
from dflash_staged.serve.llamacpp.build import SOURCE, PinnedSource, ensure_source

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def content_digest(path: Path) -> str:
    """XXH3-128 of the file's bytes (about 10 GB/s from the page cache: a second for an 8B target's
    weights, beside minutes of conversion); taken once per process for a file unchanged since (the same
    inode, size and nanosecond change time, which every write sets and no one can set back: a target
    converted, then named as a drafter's target)."""
    st = path.stat()
    return _digest(str(path.resolve()), st.st_ino, st.st_size, st.st_ctime_ns)


@functools.lru_cache(maxsize=256)
def _digest(path: str, ino: int, size: int, ctime_ns: int) -> str:
    h, buf = xxhash.xxh3_128(), bytearray(1 << 22)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _record(model_dir: Path, outtype: str, target_dir: Path | None) -> dict:
    def files(d: Path) -> list:
        return sorted(
            [p.name, content_digest(p)]
            for p in d.iterdir()
            if p.is_file() and (p.suffix in (".json", ".safetensors", ".model", ".txt", ".jinja"))
        )

    rec = {"model": str(model_dir.resolve()), "files": files(model_dir), "outtype": outtype}
    if target_dir is not None:
        rec.update(target=str(target_dir.resolve()), target_files=files(target_dir))
    return rec


def convert(
    model_dir: str | Path,
    out: str | Path,
    outtype: str = "f32",
    target_dir: str | Path | None = None,
    source: PinnedSource = SOURCE,
    quiet: bool = False,
) -> Path:
    """``model_dir`` (an HF directory) as the GGUF file ``out``; see the module docstring."""
    model_dir, out = Path(model_dir), Path(out)
    target_dir = Path(target_dir) if target_dir is not None else None
    if outtype not in OUTTYPES:
        raise DflashError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    for d, what in ((model_dir, "model"), (target_dir, "target")):
        if d is not None and not (d / "config.json").is_file():
            raise DflashError(f"{d}: no config.json; the {what} must be a Hugging Face model directory")
    stamp = out.with_name(out.name + ".source.json")
    rec = _record(model_dir, outtype, target_dir)
    try:
        if out.is_file() and json.loads(stamp.read_text()) == rec:
            return out
    except (OSError, ValueError):
        pass
    src = ensure_source(source, quiet)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, log = temp_sibling(out), out.with_name(out.name + ".log")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype]
    cmd += ["--outfile", str(tmp)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(src)])}
    env.setdefault("HF_HUB_OFFLINE", "1")
    if not quiet:
        print(f"llama.cpp: converting {model_dir} to {out} ({outtype})", file=sys.stderr, flush=True)
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log.write_text(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        if r.returncode != 0 or not tmp.is_file():
            last = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
            raise DflashError(
                f"llama.cpp's converter refused {model_dir} ({last[-1] if last else 'no output'}); "
                f"its output is in {log}"
            )
        fsync_path(tmp)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        tmp.unlink(missing_ok=True)
    stamp.write_text(json.dumps(rec))
    return out

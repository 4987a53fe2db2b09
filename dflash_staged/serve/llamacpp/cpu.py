"""The CPU a native llama.cpp build is made for, and what a crash of its server means.

Contract:

* **A build's CPU.** llama.cpp is built with ``-DGGML_NATIVE=ON`` (``-march=native``): the binary may use
  every instruction set the building host has. :func:`record` is what a build keeps of its host
  (``CPU.json`` in the build directory, :mod:`.build`): the CPU's model name, its instruction-set flags
  (:func:`isa_flags`: ``/proc/cpuinfo``'s flags that name an instruction-set extension) and their
  :func:`signature` (10 hex digits). A build runs on every host whose flags include its own; the cache
  keeps one build per signature, so a home directory shared by hosts of several CPU types holds one build
  for each and never hands one of them a binary with instructions it lacks (:func:`lacks` says which).
  Where ``/proc/cpuinfo`` is not there (not Linux), the flags are empty and the signature is the machine
  type's.
* **Printed commands.** :func:`printed_no_repack`: whether a ``llama-server`` line for a user to run
  carries ``--no-repack`` (llama.cpp's AMX repacking crashes on some hosts: llama.cpp #20824, closed
  unfixed; seen on a 2-core Xeon with the planted tiny target at q8_0).
* :func:`signal_name`: a process's negative return code as the signal's name (``-11`` -> ``SIGSEGV``).
"""

from __future__ import annotations

import hashlib
import platform
import re
import signal
from functools import lru_cache
from pathlib import Path

# /proc/cpuinfo flags naming an instruction-set extension a compiler may emit with -march=native
_ISA = re.compile(
    r"^(sse\w*|ssse3|pni|avx\w*|amx\w*|fma\w*|f16c|bmi\d|popcnt|movbe|aes|vaes|v?pclmulqdq|gfni|sha_ni|adx|"
    r"abm|lzcnt|rdrand|rdseed|cx16|xsave\w*|clflushopt|clwb|serialize|movdir\w*|waitpkg|cldemote|prefetchw|"
    r"x86_64_v\d|sve\w*|asimd\w*|i8mm|bf16|dotprod|fphp|sm4|sha\d|svei8mm|svebf16)$"
)


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _field(text: str, *names: str) -> str:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return ""


@lru_cache(maxsize=1)
def isa_flags() -> tuple[str, ...]:
    """This host's instruction-set flags, sorted (x86 ``flags``, ARM ``Features``)."""
    flags = _field(_cpuinfo(), "flags", "Features").split()
    return tuple(sorted({f for f in flags if _ISA.match(f)}))


@lru_cache(maxsize=1)
def model() -> str:
    """The CPU's model name, else the machine type."""
    return _field(_cpuinfo(), "model name", "Model name", "Hardware") or platform.machine() or "unknown CPU"


def signature(flags: tuple[str, ...] | None = None) -> str:
    """10 hex digits naming an instruction-set combination (this host's by default)."""
    flags = isa_flags() if flags is None else flags
    text = " ".join(sorted(flags)) or platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def record() -> dict:
    """What a build keeps of the host it was made on (its ``CPU.json``)."""
    isa = list(isa_flags())
    return {"model": model(), "machine": platform.machine(), "isa": isa, "signature": signature()}


def lacks(built_for: dict) -> list[str]:
    """The instruction sets of ``built_for`` (a :func:`record`) that this host does not have."""
    return sorted(set(built_for.get("isa") or ()) - set(isa_flags()))


def signal_name(returncode: int | None) -> str | None:
    """``SIGSEGV`` for a return code of -11; None for a normal exit."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def printed_no_repack(outtype: str, machine: str | None = None) -> bool:
    """Whether a ``llama-server`` command printed for another host to run should carry ``--no-repack``:
    on x86, llama.cpp repacks the weights of this project's outtypes other than f32 only into its AMX
    buffer (q8_0; f16 and bf16 through its AMX float kernels), which crashes on some AMX hosts; on a host
    without AMX the flag changes nothing. Elsewhere (ARM) the repacking is a speed-up and kept."""
    machine = (machine or platform.machine()).lower()
    return outtype != "f32" and machine in ("x86_64", "amd64", "x64")

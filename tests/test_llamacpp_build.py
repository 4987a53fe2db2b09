"""The llama.cpp source and build cache (dflash_staged/serve/llamacpp/build.py), without the network."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from dflash_staged.errors import DflashError
from dflash_staged.serve.llamacpp import build as b


def _sdist(tmp_path, files: dict[str, str]) -> tuple[b.PinnedSource, bytes]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    src = b.PinnedSource("fake-pkg", "1.0", hashlib.sha256(raw).hexdigest(), "vendor/llama.cpp")
    return src, raw


def test_the_vendored_tree_is_extracted_once_from_a_verified_sdist(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    src, raw = _sdist(
        tmp_path,
        {
            "fake_pkg-1.0/vendor/llama.cpp/convert_hf_to_gguf.py": "# converter\n",
            "fake_pkg-1.0/vendor/llama.cpp/gguf-py/gguf/__init__.py": "",
            "fake_pkg-1.0/llama_cpp/__init__.py": "# the bindings: not extracted\n",
        },
    )
    (b.home(src) / "dl").mkdir(parents=True)
    (b.home(src) / "dl" / src.sdist).write_bytes(raw)
    out = b.ensure_source(src, quiet=True)
    assert out == tmp_path / "cache" / "llama.cpp" / "1.0" / "src"
    assert (out / "convert_hf_to_gguf.py").read_text() == "# converter\n"
    assert (out / "gguf-py" / "gguf" / "__init__.py").is_file() and not (out / "llama_cpp").exists()
    assert [p.name for p in b.home(src).iterdir() if p.name.startswith("tmp")] == []  # no temporary left
    (b.home(src) / "dl" / src.sdist).unlink()
    assert b.ensure_source(src, quiet=True) == out  # extracted: nothing is downloaded again
    assert not b.is_built("cpu", src)


def test_missing_build_tools_are_one_line_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(b.shutil, "which", lambda name: None)
    with pytest.raises(DflashError, match="apt install cmake"):
        b.check_tools("cpu")
    monkeypatch.setattr(b.shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    with pytest.raises(DflashError, match="C\\+\\+ compiler"):
        b.check_tools("cpu")
    monkeypatch.setattr(b.shutil, "which", lambda name: None if name == "nvcc" else f"/usr/bin/{name}")
    b.check_tools("cpu")
    with pytest.raises(DflashError, match="nvcc"):
        b.check_tools("cuda")
    with pytest.raises(DflashError, match="--kind"):
        b.build("rocm")


def test_a_build_records_its_cpu_and_builds_for_another_cpu_are_never_used(tmp_path, monkeypatch, capsys):
    """A native build is kept per instruction-set signature with the CPU it was made for; a host finding only
    builds made for other CPUs (a home shared across nodes) says so in one line, naming what it lacks, and
    builds its own beside them instead of running a binary that may die of SIGILL."""
    import json

    from dflash_staged.serve.llamacpp import cpu

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    src = b.PinnedSource("fake-pkg", "1.0", "0" * 64, "vendor/llama.cpp")
    tree = b.source_dir(src)
    tree.mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("")
    other = b.home(src) / "build-cpu-0123456789"  # made on a host with an instruction this one lacks
    (other / "bin").mkdir(parents=True)
    (other / "bin" / "llama-server").write_text("")
    (other / "DONE").write_text("")
    (other / "CPU.json").write_text(json.dumps({"model": "Xeon of the future", "isa": ["avx2", "avx10_9"]}))
    legacy = b.home(src) / "build-cpu"  # an older dflash's build: no CPU record
    (legacy / "bin").mkdir(parents=True)
    (legacy / "bin" / "llama-server").write_text("")
    (legacy / "DONE").write_text("")
    assert not b.is_built("cpu", src)

    def fake_cmake(cmd, log, quiet, what):  # the build itself, without compiling
        if what == "build":
            (b.bin_dir("cpu", src)).mkdir(parents=True, exist_ok=True)
            (b.bin_dir("cpu", src) / "llama-server").write_text("")

    monkeypatch.setattr(b, "_run_logged", fake_cmake)
    monkeypatch.setattr(b, "check_tools", lambda kind: None)
    out = b.build("cpu", src)
    said = capsys.readouterr().err
    assert out == b.home(src) / f"build-cpu-{cpu.signature()}" / "bin" and b.is_built("cpu", src)
    assert "build-cpu-0123456789 for Xeon of the future (this host lacks avx10_9)" in said
    assert "build-cpu (no CPU record" in said and f"building one for this CPU ({cpu.model()})" in said
    assert b.built_for(out.parent) == cpu.record()
    assert b.build("cpu", src) == out and "other CPUs" not in capsys.readouterr().err  # built: reused

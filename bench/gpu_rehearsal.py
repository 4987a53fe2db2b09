"""What the CPU rehearsal of the GPU smoke (``tests/test_gpu_smoke.py``) needs to stand in for the GPU
machine without downloading anything:

* :func:`copy_worktree`: a fresh clone made from this checkout plus its uncommitted files, as the
  device tool sends it (tracked and untracked files git does not ignore);
* :func:`repack_wheels`: wheels of installed distributions (zarr and its codecs here), rebuilt from
  the files their ``RECORD`` lists, as ``bench/gpu_wheels.sh`` would download them for the GPU's Python;
* :func:`image_python`: a Python that sees only the GPU image's packages: a virtual environment of this
  interpreter whose one path entry holds links to this environment's packages, less those the image
  lacks (and this project's editable install).
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path


def copy_worktree(src: Path, dst: Path) -> None:
    """Copy the files git lists in ``src`` (tracked, and untracked but not ignored) over ``dst``."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=src,
        capture_output=True,
        check=True,
    ).stdout
    for rel in filter(None, out.decode().split("\0")):
        s, d = src / rel, dst / rel
        if s.is_file():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)
        elif d.exists() and not s.exists():  # deleted in the working tree
            d.unlink()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack_wheels(dest: Path, names: list[str]) -> list[Path]:
    """One wheel per installed distribution in ``names``, into ``dest``; their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        dist = metadata.distribution(name)
        files = [f for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in str(f)]
        info = next(f for f in files if str(f).endswith(".dist-info/WHEEL"))
        tag = next(
            line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("Tag:")
        )
        dist_name = dist.metadata["Name"].replace("-", "_")
        path = dest / f"{dist_name}-{dist.version}-{tag}.whl"
        record_name = str(info).rsplit("/", 1)[0] + "/RECORD"
        lines = []
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for f in files:
                if str(f) == record_name:
                    continue
                data = Path(f.locate()).read_bytes()
                z.writestr(str(f), data)
                lines.append(_record_line(str(f), data))
            z.writestr(record_name, "\n".join(lines + [f"{record_name},,"]) + "\n")
        out.append(path)
    return out


def image_python(root: Path, exclude: set[str]) -> Path:
    """A Python whose packages are this environment's less the distributions (or top-level modules)
    in ``exclude``; its interpreter's path."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    links = root / "image-site"
    links.mkdir()
    owners = metadata.packages_distributions()
    drop = {n.lower().replace("-", "_") for n in exclude}
    for entry in site.iterdir():
        top = entry.name.split(".")[0].split("-")[0]
        key = top.lower().replace("-", "_")
        if entry.suffix == ".pth" or entry.name.startswith("__editable__") or key in drop:
            continue
        if entry.name.endswith((".dist-info", ".egg-info")) and key in drop:
            continue
        if owners.get(top) and all(d.lower().replace("-", "_") in drop for d in owners[top]):
            continue
        (links / entry.name).symlink_to(entry)
    py = root / "bin" / "python"
    target = next((root / "lib").glob("python3*/site-packages"))
    (target / "image.pth").write_text(str(links) + "\n")
    return py

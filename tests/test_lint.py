"""The code's style: ``ruff check`` and ``ruff format --check`` pass over the whole tree (the rules
and the 110-character line length are ``[tool.ruff]`` in pyproject.toml; ruff is a dev dependency)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
    if "No module named ruff" in r.stderr:
        pytest.fail("ruff is not installed: pip install -e '.[dev]' (bin/test does)")
    return r


def test_ruff_check():
    r = ruff("check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format():
    r = ruff("format", "--check", "--no-cache", ".")
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout + r.stderr

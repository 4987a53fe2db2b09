"""bench/gpu_smoke.sh and bench/gpu_smoke.py, the GPU smoke check, run here on the CPU (``--device cpu``,
small shapes) so a broken step is found before a GPU is lent; and the verdicts that only a GPU machine
would otherwise reach (kernels installed but refused, a test file that cannot be collected, no accelerate,
no network for the venv). The TP step on ``cpu,cpu`` is ``test_tp_extract.py``'s slow test."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env

ROOT = Path(__file__).resolve().parents[1]
SMOKE_PY, SMOKE_SH = ROOT / "bench" / "gpu_smoke.py", ROOT / "bench" / "gpu_smoke.sh"


def smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SMOKE_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_smoke_steps_pass_on_cpu(tmp_path):
    """gpu_smoke.sh (system-Python mode, this interpreter) runs every one-device step end to end."""
    e = dict(env(), DFLASH_USE_SYSTEM_TORCH="1", PYTHON=sys.executable)
    steps = "cuda_tests,hybrid_extract,extract_throughput,train_e2e,recipe_train"
    cmd = ["bash", str(SMOKE_SH), "--device", "cpu", "--only", steps, "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=300)
    summary = last_json(r.stdout)
    s = summary["steps"]
    assert r.returncode == 0 and summary["ok"], json.dumps(s, indent=1)[-3000:]
    assert set(s) == set(steps.split(","))
    assert json.loads((tmp_path / "gpu_smoke.json").read_text())["ok"]
    # only the files with CUDA tests are collected; on a CPU every CUDA test is skipped
    assert "test_store.py" in s["cuda_tests"]["files"] and "test_lint.py" not in s["cuda_tests"]["files"]
    assert s["cuda_tests"]["tests"] == s["cuda_tests"]["skipped"] > 0
    assert s["hybrid_extract"]["store_dtype"] == "float32" and s["hybrid_extract"]["shards"] > 0
    assert s["extract_throughput"]["capture_tok_s"] > 0
    assert s["train_e2e"]["steps"] >= 1
    for run in (s["recipe_train"]["plain"], s["recipe_train"]["checkpointing"]):
        # 8 sequences of 64 tokens, 32 anchors each x block 16 = 512 rows each: two a microbatch
        assert run["row_budget"] == 1024 and run["microbatches"] == 4 and run["tokens_per_s"] > 0
    assert (
        s["recipe_train"]["checkpointing"]["estimated_peak_gib"]
        < s["recipe_train"]["plain"]["estimated_peak_gib"]
    )


def test_test_files_with_missing_imports_are_left_out_and_named(tmp_path):
    gs = smoke_module()
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "test_a.py").write_text(
        "import pytest\nimport helpers\n\n@pytest.mark.cuda\ndef test(): pass\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import os\nfrom no_such_pkg_xyz.sub import x\n\n@pytest.mark.cuda\ndef test(): pass\n"
    )
    (tmp_path / "test_c.py").write_text("import no_such_pkg_xyz\n\ndef test(): pass\n")  # no CUDA test
    (tmp_path / "test_d.py").write_text(
        "try:\n    import no_such_pkg_xyz\nexcept ImportError:\n    pass\n@pytest.mark.cuda\ndef t(): pass\n"
    )
    run, left_out = gs.cuda_test_files(tmp_path)
    assert [f.name for f in run] == ["test_a.py", "test_d.py"]
    assert left_out == {"test_b.py": ["no_such_pkg_xyz"]}


def test_the_real_cuda_test_files_import_what_is_installed_here():
    run, left_out = smoke_module().cuda_test_files(ROOT / "tests")
    assert not left_out and {"test_store.py", "test_target.py"} <= {f.name for f in run}


def test_hybrid_verdicts():
    v = smoke_module().hybrid_verdict
    none, fla = {"fla": False, "causal_conv1d": False}, {"fla": True, "causal_conv1d": False}
    conv = {"fla": False, "causal_conv1d": True}
    assert v("cuda:0", fla, None)[0] == "fast"
    assert v("cuda:0", none, "refused: missing")[0] == "slow"
    assert v("cuda:0", conv, "refused: fla missing")[0] == "slow"  # causal-conv1d alone is optional
    assert v("cuda:0", fla, "refused: fla.ops missing") == (
        "fail",
        "flash-linear-attention (fla) is installed but the preflight refuses it: refused: fla.ops missing",
    )
    assert v("cpu", none, None)[0] == "fast"


def test_hybrid_step_fails_when_installed_kernels_are_refused(tmp_path):
    """flash-linear-attention 0.6.0 installed without fla-core: ``fla`` imports, ``fla.ops`` does not.
    The preflight refuses; the step must fail (it used to count the refusal as a pass)."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    code = (
        "import importlib.util, json, pathlib\n"
        f"spec = importlib.util.spec_from_file_location('gs', {str(SMOKE_PY)!r})\n"
        "gs = importlib.util.module_from_spec(spec); spec.loader.exec_module(gs)\n"
        f"print(json.dumps(gs.step_hybrid_extract(pathlib.Path({str(tmp_path)!r}), 'cuda:0')))\n"
    )
    e = dict(env(), PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120
    )
    res = last_json(r.stdout)
    assert res["ok"] is False and res["preflight"] == "refused", res
    assert res["kernels_installed"]["fla"] and "(fla) is installed but the preflight refuses" in res["error"]
    assert "flash-linear-attention" in res["error"] and not (tmp_path / "hybrid").exists()  # no extract ran


def test_tp_step_says_when_accelerate_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # what an uninstalled package looks like
    res = smoke_module().step_tp_extract(tmp_path, "cpu")
    assert res["ok"] is False and "accelerate is not installed" in res["error"]
    assert not (tmp_path / "tp").exists()


def test_sh_ends_with_a_json_line_when_the_venv_cannot_be_set_up(tmp_path):
    """Mode 0 with no index and an empty wheelhouse (an offline machine): the real bin/_env.sh fails;
    the script must still print its JSON error line, and soon."""
    for rel in ("bench/gpu_smoke.sh", "bin/_env.sh", "pyproject.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    (tmp_path / "wheels").mkdir()
    e = dict(
        env(),
        DFLASH_USE_SYSTEM_TORCH="0",
        PYTHON=shutil.which("python3") or sys.executable,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(tmp_path / "wheels"),
        PIP_CONFIG_FILE=os.devnull,
    )
    e.pop("PYTHONPATH", None)
    r = subprocess.run(
        ["bash", str(tmp_path / "bench" / "gpu_smoke.sh"), "--device", "cpu"],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = last_json(r.stdout)
    assert r.returncode == 2 and out["ok"] is False, r.stdout + r.stderr[-2000:]
    assert "bin/_env.sh could not set up .venv" in out["error"] and "[setup]" in r.stderr


@pytest.mark.slow
def test_whole_smoke_runs_on_cpu(tmp_path):
    """Every step, the TP one on cpu,cpu included, through gpu_smoke.py as the GPU machine runs it."""
    cmd = [sys.executable, str(SMOKE_PY), "--device", "cpu", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    summary = last_json(r.stdout)
    assert r.returncode == 0 and summary["ok"], json.dumps(summary["steps"], indent=1)[-3000:]
    assert len(summary["steps"]) == 5

"""bench/gpu_smoke.sh and bench/gpu_smoke.py, the GPU smoke check (issue 34), here on the CPU.

* Verdicts that only a GPU machine would reach: a hybrid step on the slow branch, a one-GPU TP step
  and a CUDA-test run that collected nothing are never reported ok, and a skipped required step
  keeps the summary from ``ok``; test files with missing imports are left out and named.
* The budget: a step that would not fit is skipped and named, a step that outlives its share is
  killed and its log kept, and the summary is on disk after every step.
* The rehearsal (slow): the documented GPU command from a fresh clone, against a Python that has only
  the GPU image's packages, with the wheels carried in ``.whl/`` and no index, on ``--device cpu``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import env

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SMOKE_PY, SMOKE_SH = BENCH / "gpu_smoke.py", BENCH / "gpu_smoke.sh"


def module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- verdicts
def test_test_files_with_missing_imports_are_left_out_and_named(tmp_path):
    gs = module("gpu_smoke_steps")
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
    run, left_out = module("gpu_smoke_steps").cuda_test_files(ROOT / "tests")
    assert not left_out and {"test_store.py", "test_target.py"} <= {f.name for f in run}


def test_hybrid_verdicts():
    v = module("gpu_smoke_steps").hybrid_verdict
    none, fla = {"fla": False, "causal_conv1d": False}, {"fla": True, "causal_conv1d": False}
    conv = {"fla": False, "causal_conv1d": True}
    assert v("cuda:0", fla, None)[0] == "fast"
    assert v("cuda:0", none, "refused: missing")[0] == "slow"
    assert v("cuda:0", conv, "refused: fla missing")[0] == "slow"  # causal-conv1d alone is optional
    assert v("cuda:0", fla, "refused: fla.ops missing")[0] == "fail"
    assert v("cpu", none, None)[0] == "fast"


def test_the_slow_hybrid_branch_is_skipped_not_passed(tmp_path, monkeypatch):
    """On a GPU without flash-linear-attention extract refuses and runs with --allow-slow-kernels: the
    fast kernels were not checked, so the step says skipped and the run is not ok."""
    gs, smoke = module("gpu_smoke_steps"), module("gpu_smoke")
    from dflash_staged.model.target import preflight

    def refuse(*a, **k):
        raise preflight.KernelPreflightError("the fast kernels (flash-linear-attention) are not installed")

    monkeypatch.setattr(preflight, "preflight_kernels", refuse)
    monkeypatch.setattr(gs, "kernels_installed", lambda: {"fla": False, "causal_conv1d": False})
    monkeypatch.setattr(gs, "plan", lambda *a: None)
    calls = iter([(1, "refuses: the fast kernels are missing"), (0, "wrote 3 shards")])
    monkeypatch.setattr(gs, "sh", lambda cmd, timeout, log=None: next(calls))
    res = gs.step_hybrid_extract(tmp_path, "cuda:0", 60)
    assert res["status"] == "skipped" and "not installed" in res["why"] and res["refused_as_expected"]
    summary = {"steps": {"hybrid_extract": dict(res), "recipe_train": {"status": "ok"}}}
    smoke.verdict(summary, "cuda:0", 1)
    assert summary["ok"] is False and summary["status"] == "incomplete"
    assert summary["not_ok"] == {"hybrid_extract": "skipped"}


def test_a_one_gpu_tp_step_is_skipped_and_not_required(tmp_path, monkeypatch):
    import torch

    gs, smoke = module("gpu_smoke_steps"), module("gpu_smoke")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    res = gs.step_tp_extract(tmp_path, "cuda:0", 60)
    assert res == {"status": "skipped", "why": "needs 2 GPUs; this machine shows 1"}
    assert not smoke.required("tp_extract", "cuda:0", 1) and smoke.required("tp_extract", "cuda:0", 2)
    summary = {"steps": {"tp_extract": res, "recipe_train": {"status": "ok"}}}
    smoke.verdict(summary, "cuda:0", 2)  # with two GPUs a skipped TP step is a hole in the run
    assert summary["ok"] is False


def test_an_empty_cuda_test_collection_and_a_skipped_cuda_test_fail(tmp_path, monkeypatch):
    gs = module("gpu_smoke_steps")
    xml = {
        "empty": '<testsuites><testsuite tests="0" failures="0" errors="0" skipped="0"/></testsuites>',
        "skipped": '<testsuites><testsuite tests="2" failures="0" errors="0" skipped="1">'
        '<testcase classname="t" name="test_flex"><skipped message="needs flex"/></testcase>'
        '<testcase classname="t" name="test_ok"/></testsuite></testsuites>',
    }
    for case, text in xml.items():

        def fake(cmd, timeout, log=None, text=text, case=case):
            Path(next(c for c in cmd if str(c).startswith("--junitxml="))[len("--junitxml=") :]).write_text(
                text
            )
            return (5 if case == "empty" else 0), ""

        monkeypatch.setattr(gs, "sh", fake)
        res = gs.step_cuda_tests(tmp_path / case, "cuda:0", 60)
        assert res["status"] == "failed", res
        assert ("no CUDA test was collected" if case == "empty" else "test_flex: needs flex") in res["why"]


def test_a_step_over_its_share_is_killed_its_log_kept_and_the_summary_written(tmp_path, monkeypatch):
    smoke = module("gpu_smoke")
    stub = tmp_path / "stub.py"
    stub.write_text("import sys, time\nprint('working', flush=True)\ntime.sleep(60)\n")
    monkeypatch.setattr(smoke, "__file__", str(stub))  # the child: a step that hangs
    t0 = time.time()
    res = smoke.run_step("recipe_train", "cpu", tmp_path, 2, tmp_path / "recipe_train.log")
    assert time.time() - t0 < 20
    assert res["status"] == "failed" and res["why"].startswith("timed out after 2 s")
    assert "working" in (tmp_path / "recipe_train.log").read_text()


# ---------------------------------------------------------------------------------------------- the runner
def test_steps_that_do_not_fit_are_skipped_and_named(tmp_path):
    """A budget too small for anything: every step is skipped for it, the summary is written, the run is
    not ok (and it took seconds, not the steps' time)."""
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, str(SMOKE_PY), "--device", "cpu", "--budget-s", "10", "--out", str(tmp_path / "o")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    s = last_json(r.stdout)
    assert r.returncode == 1 and s["ok"] is False and s["status"] == "incomplete", r.stdout + r.stderr
    assert time.time() - t0 < 60
    assert json.loads((tmp_path / "o" / "gpu_smoke.json").read_text()) == s
    for name, step in s["steps"].items():
        assert step["status"] == "skipped", (name, step)
        assert step["why"].startswith("budget:") or "tensor-parallel" in step["why"]


def test_the_sh_installs_nothing_broken_and_ends_with_a_json_line(tmp_path):
    """A .whl/ folder whose wheel cannot install (a cut download): one JSON line, also on disk."""
    clone = tmp_path / "c"
    (clone / "bench").mkdir(parents=True)
    (clone / ".whl").mkdir()
    for f in ("gpu_smoke.sh", "gpu_smoke.py"):
        (clone / "bench" / f).write_bytes((BENCH / f).read_bytes())
    (clone / ".whl" / "zarr-9.9.9-py3-none-any.whl").write_bytes(b"not a zip")
    r = subprocess.run(
        ["bash", str(clone / "bench" / "gpu_smoke.sh"), "--device", "cpu", "--out", str(tmp_path / "o")],
        cwd=tmp_path,
        env=dict(env(), PYTHON=sys.executable, DFLASH_SMOKE_SITE=str(tmp_path / "site")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = last_json(r.stdout)
    assert r.returncode == 2 and out["ok"] is False and "carried wheels" in out["error"], r.stdout + r.stderr
    assert json.loads((tmp_path / "o" / "gpu_smoke.json").read_text()) == out


# ---------------------------------------------------------------------------------------------- rehearsal
IMAGE_LACKS = {
    "zarr",
    "numcodecs",
    "donfig",
    "google_crc32c",
    "crc32c",
    "dflash_staged",
}  # (and the PG driver)


@pytest.mark.slow
def test_the_documented_gpu_command_rehearsed_on_cpu_from_a_fresh_clone(tmp_path):
    """The exact call of docs/gpu.md on a fresh clone, against a Python that sees only the GPU image's
    packages (this venv's, less the ones the image lacks), the missing ones carried in .whl/ as wheels
    (built here from what this venv installed: nothing is downloaded) and installed with --no-index;
    --device cpu, under a budget. Then a budget that cuts it short still leaves every finished step's
    verdict and log."""
    rehearsal = module("gpu_rehearsal")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    rehearsal.copy_worktree(ROOT, clone)  # this checkout's uncommitted changes too
    wheels = rehearsal.repack_wheels(clone / ".whl", ["zarr", "numcodecs", "donfig", "google-crc32c"])
    assert len(wheels) == 4
    image_py = rehearsal.image_python(tmp_path / "image", exclude=IMAGE_LACKS)
    e = dict(env(), PYTHON=str(image_py), DFLASH_SMOKE_SITE=str(tmp_path / "site"), PIP_NO_INDEX="1")
    e.pop("PYTHONPATH", None)
    check = subprocess.run([str(image_py), "-c", "import zarr"], env=e, capture_output=True, text=True)
    assert check.returncode != 0  # the image's Python alone cannot read the store
    runs = {"whole": 420, "cut": 75}
    for name, budget in runs.items():
        out = tmp_path / "OUT" / name
        t0 = time.time()
        r = subprocess.run(
            ["bash", "bench/gpu_smoke.sh", "--budget-s", str(budget), "--out", str(out), "--device", "cpu"],
            cwd=clone,
            env=e,
            capture_output=True,
            text=True,
            timeout=budget + 120,
        )
        took = time.time() - t0
        s = json.loads((out / "gpu_smoke.json").read_text())
        assert last_json(r.stdout) == s, r.stdout[-2000:] + r.stderr[-2000:]
        assert took < budget + 30, took  # inside its budget (and the set-up)
        assert "installing 4 carried wheels" in r.stderr
        files = sorted(p.name for p in out.iterdir())
        assert len(files) <= 8 and all(p.is_file() for p in out.iterdir()), files
        ran = [n for n, st in s["steps"].items() if "budget" not in st.get("why", "")]
        for n in ran:
            if n != "tp_extract":
                assert (out / f"{n}.log").is_file(), (n, files)
        if name == "whole":
            st = s["steps"]
            assert {st[n]["status"] for n in ("recipe_train", "train_e2e", "hybrid_extract")} == {"ok"}, st
            assert st["cuda_tests"]["status"] == "skipped" and st["tp_extract"]["status"] == "skipped"
            assert s["ok"] is False and s["status"] == "incomplete"  # a CPU run never passes for a GPU one
            variants = st["recipe_train"]
            assert {"plain", "checkpointing", "dflash2", "uneven", "target_loss"} <= set(variants)
            assert variants["uneven"]["rows_power_of_two"] is False
        else:
            assert any(st.get("why", "").startswith("budget:") for st in s["steps"].values()), s["steps"]
            assert s["steps"]["recipe_train"]["status"] == "ok"  # the first step, in the time it had
    print(
        json.dumps(
            {n: json.loads((tmp_path / "OUT" / n / "gpu_smoke.json").read_text())["seconds"] for n in runs}
        )
    )

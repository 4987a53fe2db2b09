"""GPU smoke check, run by ``bench/gpu_smoke.sh`` (which installs the carried wheels and picks the
Python). Built for the borrowed GPU machine: a fixed budget, results that survive a cut, and verdicts
that say what was and was not tested.

* **Steps**, in order of value (``bench/gpu_smoke_steps.py`` says what each checks): ``recipe_train``
  (does a real training step fit and run, how fast), ``train_e2e`` (extract and train side by side,
  bf16, flex), ``hybrid_extract`` (the fast kernels), ``extract_throughput``, ``cuda_tests``,
  ``tp_extract``. Each runs in a child process with its own time share (:data:`SHARE`): a step that
  would not finish in the time left (``--budget-s`` from the start, less :data:`RESERVE_S` for the
  summary) is skipped and named; a child that outlives its time is killed.
* **Outputs** (``--out DIR``, inside the folder that comes back): ``DIR/gpu_smoke.json``, rewritten
  as each step ends, and ``DIR/<step>.log``, each step's merged stdout and stderr streamed as it runs:
  at most 7 files, so a run cut at any point returns what it measured. Scratch (plans, stores, runs)
  goes to ``--work`` (default: a temporary directory), never under ``DIR``.
* **Verdicts**: each step is ``ok``, ``failed`` or ``skipped`` with the reason. A step is required
  unless it cannot apply here (``tp_extract`` with one GPU). The summary's ``ok`` is true only when
  every required step is ``ok``: none failed, none skipped (for the budget, or because it could
  not check what it is for, as the hybrid step without flash-linear-attention); ``status`` is
  ``ok``, ``failed`` or ``incomplete``.

The last line printed is the summary as one JSON object. Exit code 0 when ``ok``.
Usage: ``python bench/gpu_smoke.py --out DIR [--budget-s 500] [--device cuda:0] [--only a,b] [--skip a,b]``;
``--device cpu`` runs the same steps on the CPU with small shapes (CI's rehearsal:
``tests/test_gpu_smoke.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESERVE_S = 5.0  # kept back from the budget for the last summary
# (seconds a step is expected to take on one H200 cold, the most it may take) and the same on a CPU
SHARE = {
    "recipe_train": ((150, 300), (60, 240)),
    "train_e2e": ((120, 240), (60, 200)),
    "hybrid_extract": ((90, 200), (40, 150)),
    "extract_throughput": ((45, 120), (20, 90)),
    "cuda_tests": ((150, 300), (40, 150)),
    "tp_extract": ((120, 240), (60, 200)),
}
NEEDED = ("torch", "transformers", "safetensors", "zarr", "numcodecs", "xxhash", "numpy", "click", "tqdm")


def required(name: str, dev: str, gpus: int) -> bool:
    """Whether ``name`` must pass for the run to be ok (``tp_extract`` needs two GPUs)."""
    return name != "tp_extract" or (dev.startswith("cuda") and gpus >= 2)


def write_summary(out: Path, summary: dict) -> None:
    """``out/gpu_smoke.json``, replaced atomically."""
    tmp = out / ".gpu_smoke.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, out / "gpu_smoke.json")


def verdict(summary: dict, dev: str, gpus: int) -> None:
    steps = summary["steps"]
    bad = {
        n: s["status"]
        for n, s in steps.items()
        if s["status"] != "ok" and required(n, dev, gpus) and not s.get("not_required")
    }
    summary["not_ok"] = bad
    summary["ok"] = not bad
    summary["status"] = "ok" if not bad else ("failed" if "failed" in bad.values() else "incomplete")


def run_step(name: str, dev: str, work: Path, seconds: float, log: Path) -> dict:
    """One step in a child process (``--run-step``), its output streamed to ``log``; killed (its process
    group) past ``seconds``."""
    result = work / f"{name}.result.json"
    cmd = [sys.executable, __file__, "--run-step", name, "--device", dev, "--work", str(work)]
    cmd += ["--seconds", f"{seconds:.0f}", "--result", str(result)]
    t0 = time.time()
    with open(log, "w", buffering=1) as f:
        f.write(f"[gpu_smoke] step {name}: {seconds:.0f} s at most\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=seconds + 5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
    if result.is_file():
        res = json.loads(result.read_text())
    elif rc is None:
        res = {"status": "failed", "why": f"timed out after {seconds:.0f} s (killed; see {log.name})"}
    else:
        res = {"status": "failed", "why": f"the step's process exited {rc} without a result (see {log.name})"}
    if res.get("status") != "ok":
        res.setdefault("log_tail", log.read_text(errors="replace")[-800:])
    res["seconds"] = round(time.time() - t0, 1)
    return res


def child(name: str, dev: str, work: Path, seconds: float, result: Path) -> int:
    """``--run-step``: run one step here, write its result JSON."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_smoke_steps as steps

    try:
        res = steps.STEPS[name](work, dev, seconds)
    except Exception as e:  # noqa: BLE001 - reported as the step's failure
        traceback.print_exc()
        res = {"status": "failed", "why": f"{type(e).__name__}: {e}"}
    result.write_text(json.dumps(res))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="where gpu_smoke.json and the step logs go")
    ap.add_argument("--budget-s", type=float, default=500.0, help="wall-clock for every step together")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu to check this script without a GPU")
    ap.add_argument("--only", default="", help="run only these steps, e.g. --only recipe_train,train_e2e")
    ap.add_argument("--skip", default="", help="leave these steps out (reported as skipped)")
    ap.add_argument("--skip-tests", action="store_true", help="the same as --skip cuda_tests")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--run-step", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run_step:
        return child(a.run_step, a.device, a.work, a.seconds, a.result)
    t_start = time.time()
    deadline = t_start + a.budget_s
    out = (a.out or ROOT / "runs" / f"gpu_smoke-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (a.work or Path(tempfile.mkdtemp(prefix="dflash-smoke-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "ok": False,
        "status": "incomplete",
        "budget_s": a.budget_s,
        "out": str(out),
        "steps": {},
    }
    gpus, dev = 0, a.device
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        summary.update(
            status="failed", error=f"missing Python packages: {', '.join(missing)} (carry them in .whl/)"
        )
    else:
        import torch
        import transformers

        summary.update(
            torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__
        )
        summary["python"] = sys.version.split()[0]
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.startswith("cuda") and not gpus:
            summary.update(status="failed", error="torch.cuda.is_available() is False: no usable GPU")
        else:
            summary["device"] = (
                torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else "cpu"
            )
    write_summary(out, summary)
    if "error" in summary:
        print(json.dumps(summary), flush=True)
        return 2
    only = [x for x in a.only.split(",") if x]
    skip = {x for x in a.skip.split(",") if x} | ({"cuda_tests"} if a.skip_tests else set())
    cpu = not dev.startswith("cuda")
    for name in SHARE:
        if only and name not in only:
            continue
        if name in skip:
            summary["steps"][name] = {"status": "skipped", "why": "left out (--skip)", "not_required": True}
            continue
        if not required(name, dev, gpus) and not (cpu and name in only):  # --only NAME rehearses it on CPU
            why = "needs 2 GPUs" if not cpu else "a CPU run leaves the tensor-parallel step out"
            summary["steps"][name] = {"status": "skipped", "why": f"{why}; not required here"}
            write_summary(out, summary)
            continue
        expect, cap = SHARE[name][1 if cpu else 0]
        left = deadline - time.time() - RESERVE_S
        if left < expect:
            summary["steps"][name] = {
                "status": "skipped",
                "why": f"budget: {max(0.0, left):.0f} s left, the step needs about {expect} s",
            }
            write_summary(out, summary)
            continue
        print(f"[gpu_smoke] step {name} (up to {min(cap, left):.0f} s) ...", flush=True)
        res = run_step(name, dev, work, min(cap, left), out / f"{name}.log")
        summary["steps"][name] = res
        summary["seconds"] = round(time.time() - t_start, 1)
        verdict(summary, dev, gpus)
        write_summary(out, summary)
        print(
            f"[gpu_smoke] step {name}: {res['status']} ({res['seconds']} s) {res.get('why', '')}", flush=True
        )
    summary["seconds"] = round(time.time() - t_start, 1)
    verdict(summary, dev, gpus)
    write_summary(out, summary)
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The side-by-side launchers: dry-run commands of `pipeline` and `node`, and the supervisor's
signal forwarding and failure policy (with small fake child commands)."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_staged.cli import main
from dflash_staged.launch.supervise import run_side_by_side
from dflash_staged.store import bytes_per_token

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, signal, sys, time
mode = sys.argv[1]
def term(signum, frame):
    print(f"term {signum}", flush=True)
    sys.exit(128 + signum if mode == "clean" else 0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else term)
print(f"ready {os.getpid()}", flush=True)
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
if mode.startswith("run"):
    time.sleep(float(mode[3:]))
    print("done", flush=True)
    sys.exit(0)
time.sleep(120)
"""


def child(mode: str) -> list[str]:
    """A fake stage: 'sleep' (until SIGTERM, then exit 0), 'clean' (until SIGTERM, then exit 143 as dflash
    train does after its checkpoint), 'ignore' (ignores SIGTERM), 'exitN', 'runS'."""
    return [sys.executable, "-c", CHILD, mode]


def dry(*args: str, env: dict | None = None) -> list[str]:
    r = CliRunner().invoke(main, [args[0], "--dry-run", *args[1:]], env=env or {"CUDA_VISIBLE_DEVICES": None})
    assert r.exit_code == 0, r.output
    return r.output.splitlines()


def proc_line(lines: list[str], name: str) -> tuple[dict, list[str]]:
    """(env, argv) of the `[dry-run] name:` line."""
    (line,) = [x for x in lines if x.startswith(f"[dry-run] {name}: ")]
    words = shlex.split(line.split(": ", 1)[1])
    env = {}
    while words and "=" in words[0] and not words[0].startswith("/"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ---------------------------------------------------------------------------------------------- dry runs
def test_pipeline_dry_run_prints_plan_extract_train(tmp_path):
    lines = dry(
        "pipeline",
        "--config",
        "configs/tiny.toml",
        "--data",
        "d.jsonl",
        "--workdir",
        str(tmp_path / "w"),
        "--devices",
        "cpu,cpu",
        "--epochs",
        "2",
        "--window",
        "9",
        "--",
        "--max-steps",
        "3",
    )
    _, plan = proc_line(lines, "plan")
    assert plan[1:4] == ["-m", "dflash_staged", "plan"] and flag(plan, "--epochs") == "2"
    assert flag(plan, "--manifest") == str(tmp_path / "w" / "manifest")
    env, ex = proc_line(lines, "extract")
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert ex[1:4] == ["-m", "dflash_staged", "extract"]
    assert flag(ex, "--devices") == "cpu,cpu" and flag(ex, "--window") == "9"
    assert flag(ex, "--store") == str(tmp_path / "w" / "store")
    env, tr = proc_line(lines, "train")
    assert tr[1:4] == ["-m", "dflash_staged", "train"] and "torch.distributed.run" not in tr
    assert flag(tr, "--out") == str(tmp_path / "w" / "run") and flag(tr, "--max-steps") == "3"
    assert flag(tr, "--device") == "cpu"  # every extract device is a CPU: train stays on the CPU too
    assert not (tmp_path / "w").exists()  # a dry run creates nothing


def test_node_dry_run_splits_gpus_and_prints_bandwidth(tmp_path):
    lines = dry(
        "node",
        "--config",
        "configs/qwen3-8b.toml",
        "--data",
        "d.jsonl",
        "--workdir",
        str(tmp_path),
        "--extract-gpus",
        "0,1,2,3",
        "--train-gpus",
        "4,5,6,7",
        "--keep-shards",
    )
    env, ex = proc_line(lines, "extract")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert flag(ex, "--devices") == "cuda:0,cuda:1,cuda:2,cuda:3" and flag(ex, "--train-ranks") == "4"
    env, tr = proc_line(lines, "train")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) >= 300
    assert tr[1:4] == ["-m", "dflash_staged", "train"] and flag(tr, "--nproc") == "4"  # it runs torchrun
    assert "--keep-shards" in tr
    text = "\n".join(lines)
    # Qwen3-8B in FP8 (the recipe's store_dtype): K=5 x (H=4096 + 4) + 5 = 20,505 B/token (40,965 B in bf16);
    # 8000 tok/s x 4 GPUs -> 656 MB/s written, 1.31 GB/s total.
    assert bytes_per_token(5, 4096, 2) == 40_965 and "20,505 B" in text
    assert "656 MB/s written" in text and "1.31 GB/s (write + read)" in text


def test_node_gpu_ids_map_through_visible_devices_and_single_rank_skips_torchrun(tmp_path):
    args = ["node", "--config", "configs/tiny.toml", "--data", "d.jsonl", "--workdir", str(tmp_path)]
    lines = dry(*args, "--extract-gpus", "0,1", "--train-gpus", "3", env={"CUDA_VISIBLE_DEVICES": "2,3,5,7"})
    env, ex = proc_line(lines, "extract")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and flag(ex, "--devices") == "cuda:0,cuda:1"
    assert "--train-ranks" not in ex
    env, tr = proc_line(lines, "train")
    assert env["CUDA_VISIBLE_DEVICES"] == "7" and "torch.distributed.run" not in tr and "--nproc" not in tr
    for bad, msg in (
        (["--extract-gpus", "0,1", "--train-gpus", "1,2"], "in both"),
        (["--extract-gpus", "0,x", "--train-gpus", "2"], "distinct GPU indices"),
    ):
        r = CliRunner().invoke(main, args + bad + ["--dry-run"], env={"CUDA_VISIBLE_DEVICES": None})
        assert r.exit_code == 1 and msg in r.output, r.output
    r = CliRunner().invoke(
        main,
        args + ["--extract-gpus", "0", "--train-gpus", "4", "--dry-run"],
        env={"CUDA_VISIBLE_DEVICES": "2,3"},
    )
    assert r.exit_code == 1 and "shows only 2 GPU(s)" in r.output


def test_pipeline_trains_on_the_first_cuda_device_and_both_stages_number_gpus_like_nvidia_smi(tmp_path):
    args = ["pipeline", "--config", "configs/tiny.toml", "--data", "d.jsonl", "--workdir", str(tmp_path)]
    unset = {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}
    lines = dry(*args, "--devices", "cuda:1", env=unset)
    env_ex, ex = proc_line(lines, "extract")
    env_tr, tr = proc_line(lines, "train")
    assert flag(ex, "--devices") == "cuda:1" and flag(tr, "--device") == "cuda:1"  # not cuda:0
    assert env_ex["CUDA_DEVICE_ORDER"] == env_tr["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "OMP_NUM_THREADS" not in env_tr
    _, tr = proc_line(dry(*args, "--devices", "cuda:2,cuda:3", env=unset), "train")
    assert flag(tr, "--device") == "cuda:2"
    _, tr = proc_line(dry(*args, "--devices", "cuda:1", "--", "--device", "cuda:0", env=unset), "train")
    assert tr.count("--device") == 1 and flag(tr, "--device") == "cuda:0"  # the user's own wins
    env_ex, _ = proc_line(
        dry(*args, "--devices", "cuda:1", env={**unset, "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}), "extract"
    )
    assert env_ex["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"  # an explicit choice is kept


def test_node_layout_and_bin_node_number_gpus_like_nvidia_smi(tmp_path):
    from helpers import env as test_env

    args = ["--config", "configs/tiny.toml", "--data", "d.jsonl", "--workdir", str(tmp_path)]
    args += ["--extract-gpus", "0", "--train-gpus", "1", "--dry-run"]
    e = {k: v for k, v in test_env().items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    r = subprocess.run(
        [str(ROOT / "bin" / "node"), *args],
        cwd=ROOT,
        env={**e, "DFLASH_USE_SYSTEM_TORCH": "1", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for name in ("extract", "train"):
        env, _ = proc_line(lines, name)
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", (name, env)


def test_existing_manifest_is_reused_and_a_different_plan_refused(tmp_path):
    from dflash_staged.plan.command import plan_manifest

    from helpers import write_dataset

    data = write_dataset(tmp_path / "d.jsonl", n=8)
    plan_manifest("configs/tiny.toml", data, tmp_path / "w" / "manifest")
    args = [
        "pipeline",
        "--config",
        "configs/tiny.toml",
        "--data",
        str(data),
        "--workdir",
        str(tmp_path / "w"),
    ]
    lines = dry(*args)
    assert any(x.startswith("[dry-run] plan: skipped") for x in lines)
    r = CliRunner().invoke(main, args + ["--epochs", "2", "--dry-run"])
    assert r.exit_code == 1 and "epochs: 1 -> 2" in r.output and "delete" in r.output


def test_new_data_for_an_existing_workdir_is_refused(tmp_path):
    # Regression: the launcher's own "same plan?" check ignored the data, so new data trained on the old plan.
    from dflash_staged.plan.command import plan_manifest

    from helpers import write_dataset

    old, new = (
        write_dataset(tmp_path / "old.jsonl", n=8, seed=1),
        write_dataset(tmp_path / "new.jsonl", n=8, seed=2),
    )
    plan_manifest("configs/tiny.toml", old, tmp_path / "w" / "manifest")
    r = CliRunner().invoke(
        main,
        [
            "pipeline",
            "--config",
            "configs/tiny.toml",
            "--data",
            str(new),
            "--workdir",
            str(tmp_path / "w"),
            "--dry-run",
        ],
    )
    assert r.exit_code == 1, r.output
    assert "data_hash" in r.output and "already holds this plan" not in r.output and "--workdir" in r.output


# ---------------------------------------------------------------------------------------------- supervision
def run(extract: str, train: str, **kw) -> tuple[int, str]:
    out = io.StringIO()
    kw.setdefault("extract_grace_s", 0.5)
    code = run_side_by_side(
        None, child(extract), child(train), {"WHO": "x"}, {"WHO": "t"}, status_every=3600, out=out, **kw
    )
    return code, out.getvalue()


def test_both_succeed_output_is_prefixed():
    code, out = run("run0.2", "run0.5")
    assert code == 0
    assert "[extract] done" in out and "[train] done" in out and "[launch] summary: exit 0" in out


def test_train_failure_stops_extract_and_sets_the_exit_code():
    code, out = run("sleep", "exit3")
    assert code == 3
    assert f"[extract] term {int(signal.SIGTERM)}" in out and "stopping extract" in out


def test_train_success_stops_a_lingering_extract_without_failing():
    code, out = run("sleep", "run0.1")
    assert code == 0 and "[extract] term" in out


def test_extract_failure_lets_train_drain():
    code, out = run("exit2", "run1.5")
    assert code == 2
    assert "[train] done" in out and "[train] term" not in out and "train goes on" in out


def test_extract_failure_without_a_store_stops_train(tmp_path):
    code, out = run("exit2", "sleep", store=tmp_path / "never-created")
    assert code == 2 and "[train] term" in out and "no store at" in out


def test_plan_failure_starts_nothing():
    out = io.StringIO()
    code = run_side_by_side(child("exit4"), child("run0"), child("run0"), out=out)
    assert code == 4 and "[extract]" not in out.getvalue() and "plan failed" in out.getvalue()


class Launcher:
    """The supervisor in its own process (so we can signal it), with its output collected."""

    def __init__(self, extract: str, train: str):
        code = (
            "import json, sys; from dflash_staged.launch.supervise import run_side_by_side; a = "
            "json.loads(sys.argv[1]); "
            "sys.exit(run_side_by_side(None, a[0], a[1], status_every=3600))"
        )
        self.p = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps([child(extract), child(train)])],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(
            target=lambda: self.lines.extend(iter(self.p.stdout.readline, "")), daemon=True
        ).start()

    def wait_for(self, pred, timeout: float = 60.0):
        end = time.time() + timeout
        while time.time() < end:
            if pred(self.lines):
                return
            time.sleep(0.05)
        self.p.kill()
        raise AssertionError(f"timed out; output so far: {''.join(self.lines)}")

    def pids(self) -> dict[str, int]:
        self.wait_for(lambda ls: sum("] ready " in x for x in ls) == 2)
        return {x.split("]")[0][1:]: int(x.split()[-1]) for x in self.lines if "] ready " in x}


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_gone(pids, timeout: float = 30.0) -> bool:
    end = time.time() + timeout
    while time.time() < end and not all(gone(p) for p in pids):
        time.sleep(0.05)
    return all(gone(p) for p in pids)


def test_sigint_is_forwarded_to_both_children():
    ln = Launcher("sleep", "sleep")
    ln.pids()
    ln.p.send_signal(signal.SIGINT)
    assert ln.p.wait(timeout=60) == 130
    out = "".join(ln.lines)
    assert f"[extract] term {int(signal.SIGTERM)}" in out and f"[train] term {int(signal.SIGTERM)}" in out


def test_a_clean_stop_never_reads_as_a_crash():
    """Ctrl-C: train checkpoints and exits 143 (128 + SIGTERM), as it should; the summary says stopped
    cleanly and how to resume, not "exit 143"."""
    ln = Launcher("sleep", "clean")
    ln.pids()
    ln.p.send_signal(signal.SIGINT)
    assert ln.p.wait(timeout=60) == 130
    out = "".join(ln.lines)
    assert "[launch] summary: stopped cleanly (exit 130); rerun the same command to resume" in out, out
    assert "(stopped cleanly), total" in out and "exit 143" not in out, out


def test_second_signal_kills_children_that_ignore_the_first():
    ln = Launcher("ignore", "ignore")
    pids = ln.pids()
    ln.p.send_signal(signal.SIGTERM)
    ln.wait_for(lambda ls: any("stopping cleanly" in x for x in ls))
    assert not any(gone(p) for p in pids.values())  # they ignore SIGTERM
    ln.p.send_signal(signal.SIGINT)
    assert ln.p.wait(timeout=60) == 128 + signal.SIGTERM
    assert wait_gone(pids.values())


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_children_do_not_outlive_a_killed_launcher():
    ln = Launcher("sleep", "sleep")
    pids = ln.pids()
    os.kill(ln.p.pid, signal.SIGKILL)
    ln.p.wait(timeout=30)
    assert wait_gone(pids.values())


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_bin_pipeline_end_to_end_on_tiny_target(tmp_path):
    from helpers import env, write_dataset

    data = write_dataset(tmp_path / "d.jsonl", n=24)
    summary = tmp_path / "summary.json"
    r = subprocess.run(
        [
            str(ROOT / "bin" / "pipeline"),
            "--config",
            "configs/tiny.toml",
            "--data",
            str(data),
            "--workdir",
            str(tmp_path / "w"),
            "--summary-json",
            str(summary),
            "--status-every",
            "2",
        ],
        cwd=ROOT,
        env={**env(), "DFLASH_USE_SYSTEM_TORCH": "1", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )  # this interpreter as is: no venv set-up
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(summary.read_text())
    assert s["jobs"]["released"] == s["total_jobs"] > 0 and s["tokens_trained"] == s["tokens_extracted"] > 0
    assert s["peak_store_bytes"] > 0 and s["steps"] >= 1 and s["loss_last"] is not None
    assert (tmp_path / "w" / "run" / "metrics.jsonl").is_file()
    assert "[extract] " in r.stdout and "[train] " in r.stdout and "[launch] summary: exit 0" in r.stdout

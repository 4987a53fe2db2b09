"""`dflash node --split auto`: the split chooser against hand-computed cases, the option checks, and
the probe on the tiny target on CPU (a dry run, and a full run with exactly-once accounting)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_staged.cli import main
from dflash_staged.errors import DflashError
from dflash_staged.split import candidates, choose_split, table

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- the chooser
def test_one_capture_gpu_feeds_seven_trainers_like_the_specforge_benchmark():
    # 27,000 tok/s of prefill per GPU; ~7 samples/s x 550 tokens = 3,850 tok/s per trainer rank.
    # 1+7: min(27,000, 7 x 3,850 = 26,950) = 26,950; 2+6: min(54,000, 23,100) = 23,100; ...
    s = choose_split(8, 1, 27_000, 3_850)
    assert (s.extract_devices, s.train_ranks) == (1, 7)
    assert s.throughput == pytest.approx(26_950)
    assert s.extract_idle == pytest.approx(1 - 26_950 / 27_000) and s.train_idle == 0
    assert s.bottleneck == "balanced" and s.too_slow is None
    # the 4/4 split the docs used to show: min(108,000, 15,400): extract idles 86%
    four = [c for c in candidates(8, 1, 27_000, 3_850) if c.extract_devices == 4][0]
    assert four.throughput == pytest.approx(15_400) and four.extract_idle == pytest.approx(
        1 - 15_400 / 108_000
    )
    assert four.bottleneck == "train"


def test_exact_balance_is_found_and_both_sides_are_busy():
    # X = g x 1000, Y = (8 - g) x 3000: equal at g = 6 (6,000 tok/s each)
    s = choose_split(8, 1, 1_000, 3_000)
    assert (s.extract_devices, s.train_ranks, s.throughput) == (6, 2, 6_000)
    assert s.extract_idle == 0 and s.train_idle == 0 and s.bottleneck == "balanced"
    assert table(candidates(4, 1, 1_000, 3_000)) == "1+3: 1,000 | 2+2: 2,000 | 3+1: 3,000"


def test_tensor_parallel_groups_take_whole_groups():
    # tp 2, 5,000 tok/s per group, 2,000 per rank: g=1 min(5,000, 12,000); g=2 min(10,000, 8,000);
    # g=3 min(15,000, 4,000)
    cands = candidates(8, 2, 5_000, 2_000)
    assert [(c.extract_devices, c.train_ranks, c.throughput) for c in cands] == [
        (2, 6, 5_000),
        (4, 4, 8_000),
        (6, 2, 4_000),
    ]
    s = choose_split(8, 2, 5_000, 2_000)
    assert (s.extract_workers, s.extract_devices, s.train_ranks) == (2, 4, 4)
    assert s.extract_idle == pytest.approx(0.2) and s.train_idle == 0
    assert s.bottleneck == "train"  # extract waits 20% on a full window: training sets the pace
    # 7 devices, tp 2: 2+5, 4+3, 6+1 (no group is split, one device always trains)
    assert [c.extract_devices for c in candidates(7, 2, 1, 1)] == [2, 4, 6]
    assert "extract: 2 worker(s) of 2" in choose_split(8, 2, 5_000, 2_000).lines()[0]


def test_a_side_too_slow_even_with_all_but_one_gpu_is_flagged():
    s = choose_split(4, 1, 100, 1_000)  # 3 extract GPUs supply 300 < one rank's 1,000
    assert (s.extract_devices, s.train_ranks, s.throughput) == (3, 1, 300)
    assert s.too_slow == "extract" and s.train_idle == pytest.approx(0.7) and s.bottleneck == "extract"
    assert any("extract is too slow to keep even one trainer rank busy" in x for x in s.lines())
    s = choose_split(4, 1, 1_000, 100)  # 3 ranks consume 300 < one worker's 1,000
    assert (s.extract_devices, s.train_ranks, s.throughput) == (1, 3, 300)
    assert s.too_slow == "train" and s.extract_idle == pytest.approx(0.7)
    assert any("training is too slow" in x and "70%" in x for x in s.lines())
    s = choose_split(8, 4, 100, 10_000)  # tp 4: one group is the most that leaves a trainer
    assert (s.extract_devices, s.train_ranks, s.too_slow) == (4, 4, "extract")
    assert choose_split(8, 1, 1_000, 3_000).too_slow is None


def test_scaling_and_ties():
    # 4 devices, 2,000 per worker, 1,000 per rank: 1+3 and 2+2 both give 2,000 and idle 1 device's worth;
    # the tie goes to fewer extract devices
    s = choose_split(4, 1, 2_000, 1_000)
    assert (s.extract_devices, s.throughput) == (1, 2_000)
    # at 50% data-parallel efficiency: 1+3 -> min(2,000, 1,500); 2+2 -> min(4,000, 1,000); 3+1 -> 1,000
    s = choose_split(4, 1, 2_000, 1_000, scaling=0.5)
    assert (s.extract_devices, s.throughput, s.train_tok_s) == (1, 1_500, 1_500)


@pytest.mark.parametrize(
    "args, msg",
    [
        ((2, 2, 1, 1), "cannot hold one extract worker of --tp 2"),
        ((1, 1, 1, 1), "give at least 2 devices"),
        ((4, 1, 0, 1), "extract rate is 0"),
        ((4, 1, 1, -2.0), "train rate is -2.0"),
    ],
)
def test_impossible_splits_are_refused(args, msg):
    with pytest.raises(DflashError, match=re.escape(msg)):
        choose_split(*args)


# ------------------------------------------------------------------------------------------- the options
def _node(tmp_path, *args, env=None):
    base = ["node", "--config", "configs/tiny.toml", "--data", "d.jsonl", "--workdir", str(tmp_path / "w")]
    return CliRunner().invoke(main, base + list(args), env=env or {"CUDA_VISIBLE_DEVICES": None})


def test_split_options_are_checked_before_anything_runs(tmp_path):
    r = _node(tmp_path, "--split", "auto", "--extract-gpus", "0", "--devices", "cpu,cpu")
    assert r.exit_code == 2 and "--split auto chooses the extract and train GPUs" in r.output
    r = _node(tmp_path, "--train-gpus", "1")
    assert r.exit_code == 2 and "give --extract-gpus and --train-gpus, or --split auto" in r.output
    r = _node(tmp_path, "--devices", "cpu,cpu", "--extract-gpus", "0", "--train-gpus", "1")
    assert r.exit_code == 2 and "add --split auto" in r.output
    r = _node(tmp_path, "--split", "auto", "--devices", "cpu,cpu", "--tp", "2", "--dry-run")
    assert r.exit_code == 1 and "2 device(s) cannot hold one extract worker of --tp 2" in r.output
    r = _node(tmp_path, "--split", "auto", "--devices", "0,0,1")
    assert r.exit_code == 1 and "--devices '0,0,1': give distinct GPU indices" in r.output
    r = _node(tmp_path, "--split", "auto", "--devices", "0-3", env={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert r.exit_code == 1 and "shows only 2 GPU(s)" in r.output
    ck = tmp_path / "w" / "run" / "checkpoints" / "step_00000004"
    ck.mkdir(parents=True)
    r = _node(tmp_path, "--split", "auto", "--devices", "cpu,cpu")
    assert r.exit_code == 1 and "holds checkpoint step_00000004" in r.output
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["run"]  # nothing planned or probed


# ------------------------------------------------------------------------------------------- the probe
def _run_node(tmp_path, data, *args, timeout=600):
    from helpers import env

    return subprocess.run(
        [sys.executable, "-m", "dflash_staged", "node", "--config", "configs/tiny.toml", "--data", str(data)]
        + ["--workdir", str(tmp_path / "w"), "--split", "auto", *args],
        cwd=ROOT,
        env={**env(), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _split_lines(out: str) -> dict:
    m = re.search(
        r"\[split\] measured: extract ([\d,]+) tok/s per worker .* train ([\d,]+) tok/s per rank", out
    )
    c = re.search(r"\[split\] chosen: (\d+) extract \+ (\d+) train of (\d+) device", out)
    p = re.search(r"\[split\] the probe's (\d+) job\(s\)", out)
    assert m and c and p, out
    return {
        "extract": float(m[1].replace(",", "")),
        "train": float(m[2].replace(",", "")),
        "split": (int(c[1]), int(c[2]), int(c[3])),
        "probe_jobs": int(p[1]),
    }


@pytest.mark.slow
def test_split_auto_dry_run_on_cpu_measures_chooses_and_starts_nothing(tmp_path):
    from helpers import status, write_dataset

    data = write_dataset(tmp_path / "d.jsonl", n=60)
    r = _run_node(tmp_path, data, "--devices", "cpu,cpu,cpu", "--probe-jobs", "3", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    got = _split_lines(r.stdout)
    e, t, n = got["split"]
    assert n == 3 and e >= 1 and t >= 1 and e + t == 3 and got["extract"] > 0 and got["train"] > 0
    assert (e, t) == (lambda s: (s.extract_devices, s.train_ranks))(
        choose_split(3, 1, got["extract"], got["train"])
    )  # the printed choice is the chooser's for the printed rates (up to their rounding)
    assert "[split] expected: " in r.stdout and "[split] tok/s by split" in r.stdout
    (ex,) = [x for x in r.stdout.splitlines() if x.startswith("[dry-run] extract: ")]
    (tr,) = [x for x in r.stdout.splitlines() if x.startswith("[dry-run] train: ")]
    assert f"--devices {','.join(['cpu'] * e)} " in ex + " " and "--device cpu" in tr
    assert ("--nproc" in tr) == (t > 1) and f"{got['extract']:,.0f} tok/s per extract worker" in r.stdout
    s = status(tmp_path / "w" / "manifest")  # the probe's jobs are written, none consumed; no run started
    assert s["jobs"]["written"] == got["probe_jobs"] >= 3 and s["groups"]["trained"] == 0
    assert not (tmp_path / "w" / "run").exists() and "[launch] starting" not in r.stdout


@pytest.mark.slow  # 30-70 s: the default suite's 12 minutes; CI runs it (.ci/run)
def test_split_auto_full_run_on_cpu_consumes_every_job_exactly_once(tmp_path):
    """The acceptance test: probe, choose, run; the probe's jobs are trained like the others."""
    from dflash_staged.manifest import Manifest

    from helpers import write_dataset

    data = write_dataset(tmp_path / "d.jsonl", n=100)
    summary = tmp_path / "summary.json"
    r = _run_node(tmp_path, data, "--devices", "cpu,cpu", "--probe-jobs", "3", "--summary-json", str(summary))
    assert r.returncode == 0, r.stdout + r.stderr
    got = _split_lines(r.stdout)
    assert got["split"] == (1, 1, 2) and got["probe_jobs"] >= 2
    s = json.loads(summary.read_text())
    assert got["probe_jobs"] < s["total_jobs"]  # the run's own extract had jobs left to do
    assert s["jobs"]["released"] == s["total_jobs"] and s["tokens_trained"] == s["tokens_extracted"] > 0
    m = Manifest.open(tmp_path / "w" / "manifest", readonly=True)
    lines = [json.loads(x) for x in (tmp_path / "w" / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = sorted(j for x in lines for j in x["jobs"])
    assert trained == sorted(j.id for j in m.jobs())  # every job, the probe's included, exactly once
    assert "[launch] starting extract" in r.stdout and "[launch] summary: exit 0" in r.stdout


# ------------------------------------------------------------------------- the probe's edges (issue 33)
def test_splits_the_window_cannot_serve_are_no_candidates():
    rule = lambda g, r: f"--window 6 < 4 x {r} trainer rank(s)" if 4 * r > 6 else None  # noqa: E731
    s = choose_split(3, 1, 10_000, 1_000, rule=rule)  # the rates alone would choose 1 + 2
    assert (s.extract_devices, s.train_ranks) == (2, 1)
    assert choose_split(3, 1, 10_000, 1_000).train_ranks == 2
    with pytest.raises(DflashError, match=r"no split of 2 device\(s\) works: --window 6 < 4 x 1"):
        choose_split(2, 1, 1_000, 5_000, rule=lambda g, r: "--window 6 < 4 x 1 trainer rank(s)")


def test_written_by_counts_only_the_given_workers_jobs(tmp_path):
    import os

    from dflash_staged.manifest import Manifest
    from dflash_staged.procs import HOST

    from helpers import plan

    mdir = plan(tmp_path, n=12, extra="[data]\ntoken_budget = 512\n")
    with Manifest.open(mdir) as m:
        r = m.claim("w0", window=8)
        assert m.publish(r.job, 100, "xxh3_64:0")
        m.claim("w0", window=8)  # claimed, not written: not counted
        assert m.written_by(HOST, [os.getpid()]) == (1, r.job.real_tokens)
        assert m.written_by(HOST, [os.getpid() + 1]) == (0, 0)
        assert m.written_by("another-host", [os.getpid()]) == (0, 0)
        assert m.written_by(HOST, []) == (0, 0)


def test_split_auto_on_a_full_window_is_refused_at_once(tmp_path):
    """A first run whose trainer stopped before releasing anything left extract's window full: the
    probe used to wait for a first job for an hour; now it refuses at once, naming the remedy."""
    import signal
    import time

    from helpers import cli, start, write_dataset

    data = write_dataset(tmp_path / "d.jsonl", n=60)
    w = tmp_path / "w"
    code, out = cli(
        "plan", "--config", ROOT / "configs/tiny.toml", "--data", data, "--manifest", w / "manifest"
    )
    assert code == 0, out
    ex = start(
        ["extract", "--manifest", w / "manifest", "--store", w / "store", "--devices", "cpu", "--window", 4],
        tmp_path / "extract.log",
    )
    from dflash_staged.manifest import Manifest

    with Manifest.open(w / "manifest", readonly=True) as m:
        deadline = time.time() + 120
        while m.counts()["written"] < 4 and time.time() < deadline and ex.poll() is None:
            time.sleep(0.1)
        ex.send_signal(signal.SIGTERM)
        ex.wait(60)
        assert m.window()["shards"] == 4, m.counts()
    t0 = time.time()
    r = _run_node(tmp_path, data, "--devices", "cpu,cpu", "--window", "4", "--probe-jobs", "3", timeout=120)
    took = time.time() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    assert "extract's window is full (4 of 4 shards" in r.stderr and "dflash train --manifest" in r.stderr
    assert "[probe extract]" not in r.stdout and took < 60, (took, r.stdout)


def test_the_train_probe_skips_a_damaged_shard(tmp_path):
    from dflash_staged.manifest import Manifest

    from helpers import plan, run

    mdir = plan(tmp_path, n=24, extra="[data]\ntoken_budget = 512\n")
    r = run(["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu"])
    assert r.returncode == 0, r.stderr
    with Manifest.open(mdir, readonly=True) as m:
        first = sorted(m.jobs("written"), key=lambda j: (j.epoch, j.pos))[0]
    chunk = next((tmp_path / "store" / "shards" / f"e{first.epoch}" / f"j{first.id}" / "hidden").glob("c*"))
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])  # cut short, as a crash would
    from helpers import env

    p = subprocess.run(
        [sys.executable, "-m", "dflash_staged.launch.probe_train", "--manifest", str(mdir)]
        + ["--store", str(tmp_path / "store"), "--device", "cpu", "--shards", "2"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"skipping shard e{first.epoch}/j{first.id}:" in p.stdout
    result = json.loads(p.stdout.splitlines()[-1].split(" ", 1)[1])
    assert result["shards"] == 2

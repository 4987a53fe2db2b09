"""Tensor-parallel extract workers, the in-process parts: device groups, the TP preflight, the
node layout with --tp and GPU ranges. The multi-process runs (TP=2 vs TP=1, side by side with the
trainer, kill -9 of a follower) are in tests/reliability/test_tp_group.py."""

from __future__ import annotations

import pytest
import torch

from dflash_staged.errors import DflashError
from dflash_staged.extract.group import Group, split_groups
from dflash_staged.launch.disk import disk_requirements
from dflash_staged.launch.processes import parse_gpus
from dflash_staged.model.target.parallel import check_sharded, check_tp, good_tp_sizes
from dflash_staged.model.target.tiny import build_tiny_model, tiny_config

from helpers import ROOT, cli, plan


def test_split_groups_makes_consecutive_groups_and_refuses_bad_counts():
    assert split_groups(["cpu", "cpu"], 2) == [["cpu", "cpu"]]
    assert split_groups(["cpu"] * 3, 1) == [["cpu"], ["cpu"], ["cpu"]]
    cuda = [f"cuda:{i}" for i in range(8)]
    assert split_groups(cuda, 4) == [cuda[:4], cuda[4:]]
    with pytest.raises(DflashError, match=r"--tp 2 does not divide the 3 device\(s\)"):
        split_groups(["cpu"] * 3, 2)
    with pytest.raises(DflashError, match="mixes CPU and CUDA"):
        split_groups(["cpu", "cuda:0"], 2)
    with pytest.raises(DflashError, match="2 distinct GPUs"):
        split_groups(["cuda:1", "cuda:1"], 2)


def test_a_group_of_one_does_nothing():
    g = Group()
    assert g.leader and g.size == 1
    g.send(("job",))
    g.idle()
    g.stop()
    assert g.all_ok(True) is True and g.all_ok(False) is False


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_next"])
def test_tp_preflight_on_the_tiny_targets(kind):
    cfg = tiny_config(kind)  # 4 attention heads, 2 KV heads
    check_tp(cfg, 1)
    check_tp(cfg, 2)
    assert good_tp_sizes(cfg) == [1, 2]
    with pytest.raises(DflashError) as e:
        check_tp(cfg, 4, "target.model='tiny:x'")
    msg = str(e.value)
    assert "--tp 4" in msg and "4 attention heads and 2 KV heads" in msg and "Use --tp 1 or 2" in msg


def test_tp_preflight_refuses_a_model_without_a_plan_and_an_unsharded_one():
    cfg = tiny_config("qwen3")
    cfg.base_model_tp_plan = None
    with pytest.raises(DflashError, match="no tensor-parallel plan"):
        check_tp(cfg, 2)
    model = build_tiny_model("qwen3")  # loaded whole: no layer is split
    with pytest.raises(DflashError, match="splits none of its decoder layers"):
        check_sharded(model, model.model.layers, 2)


def test_extract_refuses_bad_tp_before_starting_anything(tmp_path):
    mdir = plan(tmp_path, n=8)
    store = tmp_path / "store"
    code, out = cli("extract", "--manifest", mdir, "--store", store, "--devices", "cpu,cpu,cpu", "--tp", "2")
    assert code == 1 and "--tp 2 does not divide the 3 device(s)" in out
    code, out = cli(
        "extract",
        "--manifest",
        mdir,
        "--store",
        store,
        "--devices",
        "cpu,cpu,cpu,cpu",
        "--tp",
        "4",
        "--window",
        "16",
    )
    assert code == 1 and "has 4 attention heads and 2 KV heads" in out and "Use --tp 1 or 2" in out
    assert not store.exists()
    if not torch.cuda.is_available():
        code, out = cli(
            "extract", "--manifest", mdir, "--store", store, "--devices", "cuda:0,cuda:1", "--tp", "2"
        )
        assert code == 1 and "CUDA is not available" in out


def test_gpu_lists_take_ranges():
    assert parse_gpus("0-3", "--extract-gpus") == ["0", "1", "2", "3"]
    assert parse_gpus("0-1,4,6-7", "--extract-gpus") == ["0", "1", "4", "6", "7"]
    for bad in ("3-1", "0-", "a", "0,0-1", ""):
        with pytest.raises(DflashError, match="distinct GPU indices"):
            parse_gpus(bad, "--extract-gpus")


def _dry(*args):
    from click.testing import CliRunner

    from dflash_staged.cli import main

    return CliRunner().invoke(main, [args[0], "--dry-run", *args[1:]], env={"CUDA_VISIBLE_DEVICES": None})


def test_node_layout_with_tp_groups(tmp_path):
    r = _dry(
        "node",
        "--config",
        "configs/qwen3.5-122b-a10b.toml",
        "--data",
        "d.jsonl",
        "--workdir",
        str(tmp_path),
        "--extract-gpus",
        "0-3",
        "--train-gpus",
        "4-7",
        "--tp",
        "2",
        "--target-tok-s",
        "3000",
    )
    assert r.exit_code == 0, r.output
    (ex,) = [x for x in r.output.splitlines() if x.startswith("[dry-run] extract: ")]
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in ex and " --tp 2" in ex
    assert "--devices cuda:0,cuda:1,cuda:2,cuda:3 " in ex
    (bw,) = [x for x in r.output.splitlines() if "disk bandwidth" in x]
    assert (
        "3,000 tok/s per extract worker" in bw
        and "2 worker(s) (4 extract GPUs in tensor-parallel groups of 2)" in bw
    )
    r = _dry(
        "node",
        "--config",
        "configs/tiny.toml",
        "--data",
        "d.jsonl",
        "--workdir",
        str(tmp_path),
        "--extract-gpus",
        "0-2",
        "--train-gpus",
        "4",
        "--tp",
        "2",
    )
    assert r.exit_code == 1 and "--tp 2 does not divide the 3 GPU(s) of --extract-gpus 0-2" in r.output


def test_disk_arithmetic_counts_groups_not_gpus():
    cfg = ROOT / "configs" / "qwen3.5-122b-a10b.toml"
    one, _ = disk_requirements(cfg, 4, 3000, None, None, None)
    grouped, _ = disk_requirements(cfg, 4, 3000, None, None, None, tp=2)
    assert one["extract_workers"] == 4 and grouped["extract_workers"] == 2
    assert grouped["write_Bps"] == pytest.approx(one["write_Bps"] / 2)
    assert grouped["write_Bps"] == pytest.approx(3000 * 2 * grouped["bytes_per_token"])


@pytest.mark.slow
def test_gpu_smoke_tp_step_runs_on_cpu(tmp_path):
    """bench/gpu_smoke.py's tensor-parallel step, in its --device cpu mode (gloo on cpu,cpu)."""
    import json
    import subprocess
    import sys

    from helpers import env

    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_smoke.py"),
            "--device",
            "cpu",
            "--only",
            "tp_extract",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    step = summary["steps"]["tp_extract"]
    assert r.returncode == 0 and summary["ok"], step
    assert step["restarted"] and step["written"] == step["jobs"] > 0 and step["max_abs_diff_vs_tp1"] <= 1e-5

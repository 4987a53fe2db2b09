"""`dflash plan` and `dflash status` through the command line (click's CliRunner)."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_staged.cli import main
from dflash_staged.manifest import Manifest

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")  # block 8 -> >= 16 loss tokens


def rows(n=40, seed=0, lo=20, hi=300):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(lo, hi))
        out.append({"input_ids": rng.integers(4, 2048, k).tolist(), "loss_mask": [0] * 3 + [1] * (k - 3)})
    return out


def write(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.output


def test_plan_then_status(tmp_path):
    data = write(tmp_path / "d.jsonl", rows())
    man = tmp_path / "m"
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", man, "--epochs", 2, "--seed", 5)
    assert code == 0, out
    assert f"planned {man}" in out and "samples: 40" in out and "padding waste" in out
    assert "truncated to 256" in out  # lengths up to 300 with max_len 256

    code, out = run("status", "--manifest", man, "--json")
    st = json.loads(out)
    assert code == 0 and st["epochs"] == 2 and st["extract_done"] is False
    assert set(st["jobs"]) == {"pending", "claimed", "written", "consumed", "released", "kept", "failed"}
    assert st["window"] == {"shards": 0, "bytes": 0}
    lengths = [min(len(r["input_ids"]), 256) for r in rows()]
    assert st["tokens"]["real"] == sum(lengths) and st["tokens"]["padded"] >= sum(lengths)
    assert st["padding_waste"] == pytest.approx(1 - sum(lengths) / st["tokens"]["padded"])

    code, out = run("status", "--manifest", man, "--jobs", "--json")
    jobs = json.loads(out)
    assert code == 0 and len(jobs) == st["jobs"]["pending"] == sum(st["jobs"].values())
    assert len({j["id"] for j in jobs}) == len(jobs)
    for e in (0, 1):
        seen = Counter(i for j in jobs if j["epoch"] == e for i in j["sample_ids"])
        assert sorted(seen) == list(range(40)) and set(seen.values()) == {1}
    assert all(
        j["state"] == "pending" and {"id", "epoch", "bucket", "sample_ids", "state"} <= set(j) for j in jobs
    )

    code, out = run("status", "--manifest", man)
    assert code == 0 and "pending" in out and "extracted 0/" in out


def test_replan_same_is_noop_and_different_refuses(tmp_path):
    data = write(tmp_path / "d.jsonl", rows())
    man = tmp_path / "m"
    assert run("plan", "--config", CONFIG, "--data", data, "--manifest", man)[0] == 0
    with Manifest.open(man, readonly=True) as m:
        mid = m.manifest_id
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", man)
    assert code == 0 and "nothing to do" in out
    with Manifest.open(man, readonly=True) as m:
        assert m.manifest_id == mid
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", man, "--seed", 1)
    assert code == 1 and "seed" in out and "Traceback" not in out
    write(data, rows(seed=1))
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", man)
    assert code == 1 and "data_hash" in out


def test_manifest_is_required_and_messages_are_planned(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    conv = [
        {"role": "user", "content": "what is the capital of france"},
        {"role": "assistant", "content": "paris is the answer. " * 4},
    ]
    data = write(tmp_path / "d.jsonl", [{"messages": conv}] + rows(5))
    code, out = run("plan", "--config", CONFIG, "--data", data)  # required, as for every other command
    assert code == 2 and "Missing option '--manifest'" in out and not (tmp_path / "manifests").exists(), out
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", tmp_path / "m")
    assert code == 0, out
    with Manifest.open(tmp_path / "m", readonly=True) as m:
        ids, mask = m.sample(0)
        assert m.status()["samples"] == 6 and mask.sum() >= 16 and mask[0] == 0


BAD = [
    ("{oops", "field (line): malformed JSON"),
    ('"just a string"', "field (line): expected a JSON object"),
    ({"input_ids": [4, 5] * 20}, "field loss_mask: missing field"),
    ({"text": "hi"}, "field input_ids: missing field"),
    ({"input_ids": [4, 5], "loss_mask": [1]}, "field loss_mask: has 1 values but input_ids has 2"),
    ({"input_ids": [4, 5000], "loss_mask": [1, 1]}, "field input_ids: id 5000 at position 1 is outside"),
    ({"input_ids": [4, "x"], "loss_mask": [1, 1]}, "field input_ids: expected a list of integers"),
    ({"input_ids": [4, 5], "loss_mask": [1, 7]}, "field loss_mask: value 7 is not 0 or 1"),
    ({"input_ids": [], "loss_mask": []}, "field input_ids: is empty"),
    ({"input_ids": [4, 3], "loss_mask": [1, 1]}, "mask token id 3"),
    ({"messages": [{"content": "x"}]}, "field messages[0].role: missing field"),
]


@pytest.mark.parametrize("line, what", BAD, ids=[w.split(":")[0] + str(i) for i, (_, w) in enumerate(BAD)])
def test_bad_input_clean_error_nothing_written(tmp_path, line, what):
    data = write(tmp_path / "d.jsonl", rows(3) + [line] + rows(2))
    man = tmp_path / "manifests" / "m"
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", man)
    assert code == 1
    assert out.count("\n") == 1 and out.startswith(f"error: {data}:4: ") and what in out, out
    assert "Traceback" not in out
    assert not (tmp_path / "manifests").exists()  # nothing of the manifest, not even its parent
    # --skip-bad counts it and plans the rest
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", man, "--skip-bad")
    assert code == 0 and "1 bad" in out and "samples: 5" in out, out


@pytest.mark.parametrize(
    "content, what",
    [
        (b"", "the data file is empty"),
        (b'{"input_ids": [4, 5], "loss_mask": [1, 1]}\n{"x": "\xff\xfe"}\n', "d.jsonl:2: field (line): byte"),
        (b'{"input_ids": [4, 5], "loss_mask": [1, 1]}\n', "no usable samples"),
    ],
)
def test_empty_non_utf8_and_unusable_files(tmp_path, content, what):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    man = tmp_path / "m"
    code, out = run("plan", "--config", CONFIG, "--data", data, "--manifest", man)
    assert code == 1 and out.count("\n") == 1 and what in out and "Traceback" not in out, out
    assert not man.exists() and list(tmp_path.iterdir()) == [data]


def test_missing_files_and_status_without_manifest(tmp_path):
    code, out = run(
        "plan",
        "--config",
        tmp_path / "nope.toml",
        "--data",
        tmp_path / "d.jsonl",
        "--manifest",
        tmp_path / "m",
    )
    assert code == 1 and "nope.toml" in out and "Traceback" not in out
    code, out = run("plan", "--config", CONFIG, "--data", tmp_path / "d.jsonl", "--manifest", tmp_path / "m")
    assert code == 1 and "cannot read the data file" in out and not (tmp_path / "m").exists()
    code, out = run("status", "--manifest", tmp_path / "m")
    assert code == 1 and "no manifest" in out and "Traceback" not in out

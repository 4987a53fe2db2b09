"""A newcomer's mistakes (issue 50): each gets one line naming the flag or path and the fix, a non-zero
exit, no traceback, and nothing left behind; the checks come before any expensive work."""

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import cli, plan, write_config

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def one_line(code, out, *words):
    assert code == 1, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert all(w in lines[0] for w in words), (words, out)
    return lines[0]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    d = tmp_path_factory.mktemp("planned")
    return plan(d, n=8)


@pytest.fixture
def unwritable(tmp_path):
    """A folder this process cannot create anything in: a read-only one, or, as root (who writes
    anywhere chmod allows), a place the kernel refuses (sysfs)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    for d in (Path("/sys/kernel"), Path("/sys"), Path("/proc/self")):
        try:
            (d / "dflash-probe").mkdir()
        except OSError:
            yield d
            return
        (d / "dflash-probe").rmdir()
    pytest.skip("no folder here refuses root")


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    return f


def test_train_to_an_unwritable_out_or_under_a_file(planned, tmp_path, unwritable, a_file):
    base = ("train", "--manifest", planned, "--store", tmp_path / "store")
    one_line(*cli(*base, "--out", unwritable / "run"), "--out", str(unwritable / "run"), "choose")
    one_line(*cli(*base, "--out", a_file / "run"), "--out", str(a_file), "not a folder")
    assert not (tmp_path / "store").exists()


def test_train_with_a_store_that_is_a_file_refuses_at_once(planned, tmp_path, a_file):
    out = tmp_path / "run"
    one_line(*cli("train", "--manifest", planned, "--store", a_file, "--out", out), "--store", "not a folder")
    assert not out.exists()


def test_extract_to_a_store_that_is_a_file_or_unwritable(planned, a_file, unwritable):
    line = one_line(*cli("extract", "--manifest", planned, "--store", a_file, "--devices", "cpu"), "--store")
    assert "not a folder" in line and "workers" not in line
    one_line(
        *cli("extract", "--manifest", planned, "--store", unwritable / "s", "--devices", "cpu"), "--store"
    )
    assert not (unwritable / "s").exists()


def test_plan_into_an_unwritable_manifest(tmp_path, unwritable):
    from helpers import write_dataset

    data = write_dataset(tmp_path / "d.jsonl", n=4)
    cfg = write_config(tmp_path / "c.toml")
    one_line(*cli("plan", "--config", cfg, "--data", data, "--manifest", unwritable / "m"), "--manifest")
    assert not (unwritable / "m").exists()


@NO_CUDA
@pytest.mark.parametrize(
    "dev,words", [("cuda", ["--device cuda", "CUDA is not available"]), ("gpu", ["gpu"])]
)
def test_train_and_eval_on_a_device_that_is_not_here(planned, tmp_path, dev, words):
    out = tmp_path / "run"
    args = ("train", "--manifest", planned, "--store", tmp_path / "s", "--out", out, "--device", dev)
    one_line(*cli(*args), *words)
    assert not out.exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    args = ("eval", "--drafter", tmp_path / "none", "--target", "tiny:qwen3", "--prompts", prompts)
    one_line(*cli(*args, "--device", dev), *words)


def test_set_an_unknown_key_says_so(planned, tmp_path):
    out = tmp_path / "run"
    args = ("train", "--manifest", planned, "--store", tmp_path / "s", "--out", out)
    one_line(*cli(*args, "--set", "train.bogus=1"), "--set train.bogus", "has no setting 'bogus'")
    one_line(*cli(*args, "--set", "train.lrr=1e-3"), "did you mean train.lr?")
    one_line(*cli(*args, "--set", "drafter.block_size=4"), "cannot be changed")  # exists, but fixed
    assert not out.exists()


def test_replay_without_kept_shards_refuses_before_building_anything(planned, tmp_path):
    out = tmp_path / "run"
    args = ("train", "--replay", "--manifest", planned, "--out", out)
    one_line(*cli(*args, "--store", tmp_path / "s"), "replay: no store")
    assert not out.exists()


def test_a_conversation_without_an_assistant_turn_is_named_with_its_setting(tmp_path):
    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi " * 5}, {"role": "assistant", "content": "a " * 40}]}
    data.write_text(
        json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"
    )
    code, out = cli(
        "plan", "--config", write_config(tmp_path / "c.toml"), "--data", data, "--manifest", tmp_path / "m"
    )
    assert code == 0, out
    assert "1 with < 16 loss tokens (data.min_loss_tokens)" in out, out
    assert f"e.g. {data}:2: 0 loss token(s) (no assistant turn to learn from)" in out, out


def test_extract_says_when_its_full_window_has_no_trainer_to_drain_it(tmp_path):
    import signal
    import time

    from helpers import env, start

    mdir = plan(
        tmp_path, n=24, extra="[data]\ntoken_budget = 256\n[train]\nbuffer_capacity = 1\nmin_ready = 1\n"
    )
    log = tmp_path / "extract.log"
    e = {**env(), "DFLASH_NO_TRAINER_SAY_S": "1"}
    p = start(
        ["extract", "--manifest", mdir, "--store", tmp_path / "s", "--devices", "cpu", "--window", "1"],
        log,
        e,
    )
    deadline = time.time() + 180
    while time.time() < deadline and p.poll() is None and "nothing drains it" not in log.read_text():
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=120)
    text = log.read_text()
    assert "no trainer is running on" in text and f"start `dflash train --manifest {mdir}" in text, text
    assert text.count("nothing drains it") == 1 and "Traceback" not in text


def test_eval_and_pipeline_refuse_unwritable_outputs_before_any_work(tmp_path, unwritable, a_file):
    from helpers import write_dataset

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    args = ("eval", "--drafter", tmp_path / "none", "--target", "tiny:qwen3", "--prompts", prompts)
    one_line(*cli(*args, "--out", unwritable / "eval.json"), "--out", "choose")  # before the drafter is read
    one_line(*cli(*args, "--plot", a_file / "eval.png"), "--plot", "not a folder")
    data, cfg = write_dataset(tmp_path / "d.jsonl", n=4), write_config(tmp_path / "c.toml")
    args = ("pipeline", "--config", cfg, "--data", data, "--devices", "cpu")
    one_line(*cli(*args, "--workdir", unwritable / "w"), "--workdir", "choose")
    one_line(*cli(*args, "--workdir", a_file), "--workdir", "not a folder")
    assert not (unwritable / "w").exists()


def test_server_only_flags_without_a_server_and_an_eval_out_that_is_a_folder(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = ("regenerate", "--prompts", prompts, "--target", "tiny:qwen3", "--out", tmp_path / "o.jsonl")
    one_line(*cli(*args, "--concurrency", 4), "--concurrency applies only with --server")
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.parts").exists()
    args = ("eval", "--drafter", tmp_path / "none", "--target", "tiny:qwen3", "--prompts", prompts)
    one_line(*cli(*args, "--out", tmp_path), "--out", "it is a folder")

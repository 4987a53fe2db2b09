"""dflash train: side by side with extract, drain, kill -9 + resume, replay determinism, DDP."""

import json
import shutil
import signal
import time

import pytest
import torch

from dflash_staged.manifest import Manifest
from dflash_staged.manifest.status import format_reformations
from dflash_staged.model.drafters.weights import load_drafter
from dflash_staged.train.checkpoint import latest_checkpoint, load_checkpoint

from helpers import dflash, plan, run_dflash, sample_while, start, status

EXTRA = "[data]\ntoken_budget = 512\n"


def metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def final_consumed(run):
    state = load_checkpoint(latest_checkpoint(run))
    return state, state.consumed_jobs()


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """One manifest (2 epochs) extracted to completion; tests copy it before mutating."""
    d = tmp_path_factory.mktemp("extracted")
    mdir = plan(d, n=24, epochs=2, extra=EXTRA)
    r = run_dflash(
        "extract", "--manifest", mdir, "--store", d / "store", "--devices", "cpu,cpu", "--window", "64"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def copy_of(extracted, tmp_path):
    shutil.copytree(extracted / "manifest", tmp_path / "manifest")
    shutil.copytree(extracted / "store", tmp_path / "store")
    return tmp_path / "manifest", tmp_path / "store"


@pytest.fixture(scope="module")
def kept(extracted, tmp_path_factory):
    """A live run with --keep-shards over the extracted manifest: the source of replays."""
    d = tmp_path_factory.mktemp("kept")
    mdir, store = copy_of(extracted, d)
    r = run_dflash("train", "--manifest", mdir, "--store", store, "--out", d / "live", "--keep-shards")
    assert r.returncode == 0, r.stdout + r.stderr
    return d


DFLASH2 = '[drafter]\narchitecture = "dflash2"\nis_causal = false\nselector_rank = 32\nselector_top_k = 8\n'


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_side_by_side(tmp_path, arch):
    mdir = plan(tmp_path, n=40, epochs=1, extra=EXTRA + (DFLASH2 if arch == "dflash2" else ""))
    store, run = tmp_path / "store", tmp_path / "run"
    ex = dflash("extract", "--manifest", mdir, "--store", store, "--devices", "cpu,cpu", "--window", "16")
    tr = dflash("train", "--manifest", mdir, "--store", store, "--out", run)
    m = Manifest.open(mdir, readonly=True)
    windows = sample_while([ex, tr], lambda: m.window()["shards"], period=0.05)
    out_ex, out_tr = ex.communicate()[0], tr.communicate()[0]
    assert ex.returncode == 0, out_ex
    assert tr.returncode == 0, out_tr
    assert windows and max(windows) <= 16
    st = status(mdir)
    assert st["extract_done"] and st["jobs"]["released"] == st["total_jobs"]
    b = st["balance"]  # both sides' final busy and idle seconds (dflash_staged.manifest.balance)
    assert b["extract"]["total"]["busy_s"] > 0 and b["train"]["total"]["busy_s"] > 0, b
    assert not list(store.glob("shards/e*/j*"))
    lines = metrics(run)
    assert [x["step"] for x in lines] == list(range(1, len(lines) + 1))
    _, covered = final_consumed(run)
    assert sorted(covered) == sorted(j.id for j in m.jobs())
    for x in lines:
        if x["bucket_choices"] >= 2 and len(x["jobs"]) >= 2:
            assert len(set(x["buckets"])) >= 2, x
    assert any(len(set(x["buckets"])) >= 2 for x in lines)
    cfg = json.loads((latest_checkpoint(run) / "config.json").read_text())
    if arch == "dflash2":  # the selector's metrics, and a servable DFlash2 checkpoint
        assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
        assert all(1 <= x["walk_tau"] <= 8 and len(x["topk_recall"]) == 7 for x in lines)
    else:
        assert cfg["architectures"] == ["DFlashDraftModel"] and "walk_tau" not in lines[0]


def test_drain_with_fewer_than_min_ready(tmp_path):
    # 3 samples -> few jobs, min_ready 4: extraction ends with fewer than N shards; train drains, exits 0
    mdir = plan(tmp_path, n=3, extra=EXTRA + "[train]\nmin_ready = 4\nbuffer_capacity = 4\n")
    store = tmp_path / "store"
    assert run_dflash("extract", "--manifest", mdir, "--store", store, "--devices", "cpu").returncode == 0
    m = Manifest.open(mdir, readonly=True)
    assert m.counts()["written"] < 4
    r = run_dflash("train", "--manifest", mdir, "--store", store, "--out", tmp_path / "run", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert status(mdir)["jobs"]["released"] == sum(m.counts().values())


def test_kill9_trainer_and_resume_exactly_once(extracted, tmp_path):
    mdir, store = copy_of(extracted, tmp_path)
    run = tmp_path / "run"
    tr = dflash("train", "--manifest", mdir, "--store", store, "--out", run)
    t0 = time.time()
    while time.time() - t0 < 120 and tr.poll() is None:
        ck = latest_checkpoint(run)
        if ck is not None and (run / "metrics.jsonl").exists() and len(metrics(run)) > int(ck.name[5:]):
            break  # past a checkpoint, mid-interval: consumed-but-unreleased shards exist
        time.sleep(0.02)
    tr.send_signal(signal.SIGKILL)
    tr.wait()
    m = Manifest.open(mdir, readonly=True)
    assert 0 < m.counts()["released"] < sum(m.counts().values())
    r = run_dflash("train", "--manifest", mdir, "--store", store, "--out", run)
    assert r.returncode == 0, r.stdout + r.stderr
    state, covered = final_consumed(run)
    ids = [c.job for items in state.consumed().values() for c in items]
    assert sorted(ids) == sorted(j.id for j in m.jobs())  # every job exactly once
    lines = metrics(run)
    assert [x["step"] for x in lines] == list(range(1, state["step"] + 1))
    assert sorted(j for x in lines for j in x["jobs"]) == sorted(ids)
    assert status(mdir)["jobs"]["released"] == len(ids)
    # a rerun with nothing to do appends nothing
    before = (run / "metrics.jsonl").read_text()
    assert run_dflash("train", "--manifest", mdir, "--store", store, "--out", run).returncode == 0
    assert (run / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # 30-70 s: the default suite's 12 minutes; CI runs it (.ci/run)
def test_replay_is_deterministic_and_resumes_equal(kept, tmp_path):
    # no warmup, so a schedule cut short by the interruption below would show at once
    args = ("train", "--replay", "--manifest", kept / "manifest", "--store", kept / "store")
    args += ("--set", "train.warmup_ratio=0")
    a = run_dflash(*args, "--out", tmp_path / "a")
    b = run_dflash(*args, "--out", tmp_path / "b")
    assert a.returncode == 0 and b.returncode == 0, a.stdout + a.stderr
    la, lb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert len(la) >= 4
    assert [x["loss"] for x in la] == [x["loss"] for x in lb]
    assert [x["jobs"] for x in la] == [x["jobs"] for x in lb]
    # interrupted at step 2 (--max-steps only stops) and resumed: the same draws, learning rates and
    # losses as the uninterrupted run
    c1 = run_dflash(*args, "--out", tmp_path / "c", "--max-steps", "2")
    assert c1.returncode == 0, c1.stdout + c1.stderr
    assert [x["step"] for x in metrics(tmp_path / "c")] == [1, 2]
    ck = latest_checkpoint(tmp_path / "c")
    assert f"train: stopped at --max-steps 2 at step 2, checkpoint {ck}: rerun with more" in c1.stderr
    c2 = run_dflash(*args, "--out", tmp_path / "c")
    assert c2.returncode == 0, c2.stdout + c2.stderr
    # the rerun says it resumes (and not how a fresh drafter was initialised), then that it is done
    assert f"train: resuming from step 2 (checkpoint {ck})" in c2.stderr, c2.stderr
    assert "initialised from the target" not in c2.stderr and "initialised from the target" in a.stderr
    done = (
        f"train: done: {len(la)} steps, final checkpoint {latest_checkpoint(tmp_path / 'c')}; over the last"
    )
    assert done in c2.stderr and "training tau" in c2.stderr and "dflash serve export" in c2.stderr
    lc = metrics(tmp_path / "c")
    assert [x["jobs"] for x in lc] == [x["jobs"] for x in la]
    assert [x["lr"] for x in lc] == [x["lr"] for x in la]
    assert [x["loss"] for x in lc] == [x["loss"] for x in la]
    # --total-steps sets the schedule's length: half the steps at the same lr curve stretched differently
    e = run_dflash(*args, "--out", tmp_path / "e", "--total-steps", str(2 * len(la)))
    assert e.returncode == 0, e.stdout + e.stderr
    le = metrics(tmp_path / "e")
    assert len(le) == len(la) and le[-1]["lr"] > la[-1]["lr"]
    # the kept manifest was not modified by the replays
    assert status(kept / "manifest")["jobs"]["kept"] == status(kept / "manifest")["total_jobs"]


def test_replay_order_from_and_overrides(kept, tmp_path):
    live = metrics(kept / "live")
    r = run_dflash(
        "train",
        "--replay",
        "--manifest",
        kept / "manifest",
        "--store",
        kept / "store",
        "--out",
        tmp_path / "o",
        "--order-from",
        kept / "live",
        "--set",
        "train.lr=1e-3",
        "--set",
        "drafter.block_size=4",
        "--set",
        'drafter.layer_types=["sliding_attention", "full_attention"]',
        "--set",
        "drafter.sliding_window=5",
        "--set",
        "drafter.init=target_top",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "drafter initialised from the target" in r.stderr
    assert [x["jobs"] for x in metrics(tmp_path / "o")] == [x["jobs"] for x in live]
    cfg = json.loads((latest_checkpoint(tmp_path / "o") / "config.json").read_text())
    assert cfg["block_size"] == 4  # and a drafter with a sliding layer trained, saved and loads back
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 5
    assert load_drafter(
        latest_checkpoint(tmp_path / "o"), torch.zeros(2048, 128), torch.zeros(2048, 128)
    ).dcfg.use_sliding_window
    bad = run_dflash(
        "train",
        "--replay",
        "--manifest",
        kept / "manifest",
        "--store",
        kept / "store",
        "--out",
        tmp_path / "p",
        "--set",
        "target.target_layer_ids=[1]",
    )
    assert bad.returncode == 1 and "cannot be changed" in bad.stderr and "Traceback" not in bad.stderr


def test_ctrl_c_stops_cleanly_says_where_and_the_rerun_resumes(kept, tmp_path):
    args = ("train", "--replay", "--manifest", kept / "manifest", "--store", kept / "store")
    args += ("--out", tmp_path / "r", "--passes", "200", "--set", "train.checkpoint_every=100000")
    log = tmp_path / "train.log"
    p = start(list(args), log)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if (tmp_path / "r" / "metrics.jsonl").exists() and len(metrics(tmp_path / "r")) >= 2:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=120)
    err = log.read_text()
    assert p.returncode == 130, err
    step = metrics(tmp_path / "r")[-1]["step"]
    ck = latest_checkpoint(tmp_path / "r")
    line = f"train: stopped by SIGINT at step {step}, checkpoint {ck}: rerun the same command to resume"
    assert line in err and "Traceback" not in err, err
    r = run_dflash(*args, "--max-steps", str(step + 1))
    assert f"train: resuming from step {step} (checkpoint {ck})" in r.stderr, r.stderr


def test_ddp_two_ranks_gloo(extracted, tmp_path):
    mdir, store = copy_of(extracted, tmp_path)
    run = tmp_path / "run"
    # `--nproc=2` (with "="): regression, the relaunch under torchrun crashed on this spelling
    r = run_dflash(
        "train",
        "--manifest",
        mdir,
        "--store",
        store,
        "--out",
        run,
        "--nproc=2",
        "--device",
        "cpu",
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    state, _ = final_consumed(run)
    items = [c for v in state.consumed().values() for c in v]
    m = Manifest.open(mdir, readonly=True)
    assert sorted(c.job for c in items) == sorted(j.id for j in m.jobs())
    assert {c.rank for c in items} == {0, 1}
    assert m.counts()["released"] == len(items)


@pytest.mark.slow  # the default suite's 12 minutes (issue 50); CI runs it (.ci/run)
def test_init_from_a_live_run_warm_starts_the_replay(kept, tmp_path):
    args = (
        "train",
        "--replay",
        "--manifest",
        kept / "manifest",
        "--store",
        kept / "store",
        "--max-steps",
        "1",
    )
    cold = run_dflash(*args, "--out", tmp_path / "cold")
    warm = run_dflash(*args, "--out", tmp_path / "warm", "--init-from", kept / "live")
    assert cold.returncode == 0 and warm.returncode == 0, warm.stdout + warm.stderr
    assert "drafter initialised from" in warm.stderr and str(kept / "live") in warm.stderr
    assert metrics(tmp_path / "warm")[0]["loss"] < metrics(tmp_path / "cold")[0]["loss"]
    bad = run_dflash(*args, "--out", tmp_path / "bad", "--init-from", tmp_path / "nothing")
    assert bad.returncode == 1 and "--init-from" in bad.stderr and "Traceback" not in bad.stderr


def test_a_live_run_resumes_on_more_ranks_and_a_replay_does_not(extracted, tmp_path):
    """Growing back (issue 41): a checkpoint of one rank resumes on two; the new rank starts with an empty
    buffer, the schedule refits over the jobs left, every job is trained exactly once. A replay keeps
    its ranks (its draws are a function of them)."""
    mdir, store = copy_of(extracted, tmp_path)
    run = tmp_path / "run"
    args = ("train", "--manifest", mdir, "--store", store, "--out", run, "--device", "cpu")
    r = run_dflash(*args, "--max-steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_dflash(*args, "--nproc", "2", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming the checkpoint of step 2 (1 rank(s)) on 2" in r.stderr, r.stderr[-2000:]
    state, _ = final_consumed(run)
    items = [c for v in state.consumed().values() for c in v]
    m = Manifest.open(mdir, readonly=True)
    assert sorted(c.job for c in items) == sorted(j.id for j in m.jobs())  # each once
    assert {c.rank for c in items} == {0, 1} and m.counts()["released"] == len(items)
    assert [x["step"] for x in metrics(run)] == list(range(1, state["step"] + 1))
    reform = m.reformations()
    assert [(e["step"], e["ranks"]) for e in reform] == [(2, [1, 2])], reform
    lines = format_reformations(status(mdir)["reformations"])  # what `dflash status` prints
    assert lines[0] == "trainer re-formed 1 time(s):"
    assert "resumed from step 2 on 2 rank(s) (were 1)" in lines[1], lines


def test_a_replay_resumes_only_on_as_many_ranks(kept, tmp_path):
    args = (
        "train",
        "--replay",
        "--manifest",
        kept / "manifest",
        "--store",
        kept / "store",
        "--out",
        tmp_path,
    )
    assert run_dflash(*args, "--max-steps", "1").returncode == 0
    r = run_dflash(*args, "--nproc", "2", timeout=400)
    assert r.returncode != 0 and "a replay resumes on as many ranks as it began with" in r.stderr, r.stderr[
        -2000:
    ]


def test_a_replay_trains_a_draft_vocabulary_chosen_from_the_planned_counts(kept, tmp_path):
    """The manifest keeps the loss tokens' counts, so a replay may set another draft vocabulary size: the
    trainer chooses it as plan would, masks the labels outside, and the checkpoint carries it."""
    from dflash_staged.model.drafters import vocab

    args = ("train", "--replay", "--manifest", kept / "manifest", "--store", kept / "store")
    r = run_dflash(
        *args, "--out", tmp_path / "r", "--set", "drafter.draft_vocab_size=300", "--max-steps", "3"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    want = vocab.choose(
        vocab.counts_of(Manifest.open(kept / "manifest", readonly=True).meta["loss_tokens"]), 300
    )
    assert f"train: draft vocabulary: 300 of 2,048 tokens cover {want.coverage:.2%}" in r.stderr, r.stderr
    lines = metrics(tmp_path / "r")
    assert all(0 < x["draft_vocab_oov"] < 1 for x in lines)
    ck = latest_checkpoint(tmp_path / "r")
    d = load_drafter(ck, torch.zeros(2048, 128), torch.zeros(2048, 128))
    assert d.to_target(torch.arange(300)).tolist() == want.ids.tolist()


@pytest.mark.slow  # two ranks start (about a minute); CI runs it (.ci/run)
def test_two_ranks_train_the_same_draft_vocabulary(kept, tmp_path):
    """Each rank chooses the table from the manifest's counts alone (no rank sends it): two ranks of a
    replay both say the same vocabulary, train with it, and the checkpoint carries it."""
    from dflash_staged.model.drafters import vocab

    args = ("train", "--replay", "--manifest", kept / "manifest", "--store", kept / "store")
    size, steps = ("--set", "drafter.draft_vocab_size=300"), ("--max-steps", "2")
    r = run_dflash(*args, "--out", tmp_path / "r", *size, *steps, "--nproc", "2", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    want = vocab.choose(
        vocab.counts_of(Manifest.open(kept / "manifest", readonly=True).meta["loss_tokens"]), 300
    )
    said = f"train: draft vocabulary: 300 of 2,048 tokens cover {want.coverage:.2%}"
    assert r.stderr.count(said) == 2, r.stderr[-3000:]  # each rank's own choice, the same
    lines = metrics(tmp_path / "r")
    assert [x["step"] for x in lines] == [1, 2] and all(0 < x["draft_vocab_oov"] < 1 for x in lines)
    d = load_drafter(latest_checkpoint(tmp_path / "r"), torch.zeros(2048, 128), torch.zeros(2048, 128))
    assert d.to_target(torch.arange(300)).tolist() == want.ids.tolist()

"""In-process unit tests of the trainer's parts: the buffer, the shard sources, the ledger, the
checkpoint round trip, and the loop's helpers (no subprocess, no target model)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_staged.config import TrainConfig
from dflash_staged.errors import DflashError
from dflash_staged.manifest import Manifest
from dflash_staged.store import ShardError, ShardStore, StoreMeta
from dflash_staged.train import checkpoint as ckpt
from dflash_staged.train.buffer import ShardBuffer
from dflash_staged.train.distributed import Dist
from dflash_staged.train.ledger import Consumed, Ledger
from dflash_staged.train.loop import microbatches
from dflash_staged.train.optim import Optimizer, lr_at
from dflash_staged.train.sources import LiveSource, ReplaySource

from helpers import plan

H, K = 8, 2


def publish_all(m: Manifest, store: ShardStore, limit: int | None = None) -> list[int]:
    """Play extract in this process: claim, write a synthetic shard (hidden = token id), publish."""
    done = []
    while limit is None or len(done) < limit:
        r = m.claim("w", window=10_000)
        if r.job is None:
            break
        j = r.job
        ids = torch.cat([torch.from_numpy(m.sample(s)[0].astype("int64")) for s in j.sample_ids])
        lens = [len(m.sample(s)[0]) for s in j.sample_ids]
        cu = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist())
        hidden = ids.float()[:, None, None].expand(-1, K, H).contiguous()
        staged = store.stage_shard(
            j.epoch,
            j.id,
            hidden,
            ids.int(),
            torch.ones(len(ids), dtype=torch.uint8),
            cu,
            torch.tensor(j.sample_ids),
        )
        assert m.publish(
            j, staged.info.nbytes, staged.info.checksum, commit=lambda s=staged: store.commit_staged(s)
        )
        done.append(j.id)
    return done


@pytest.fixture
def live(tmp_path):
    mdir = plan(tmp_path, n=16, epochs=2, extra="[data]\ntoken_budget = 512\n")
    m = Manifest.open(mdir)
    store = ShardStore.create_or_open(
        tmp_path / "store",
        StoreMeta(
            manifest_id=m.manifest_id, target_id="t", layer_ids=[1, 2], hidden_size=H, logical_dtype="float32"
        ),
    )
    yield m, store
    m.close()


# ---------------------------------------------------------------------------------------------- buffer
def test_buffer_reads_verifies_and_draws_deterministically(live):
    m, store = live
    publish_all(m, store)
    jobs = m.jobs("written")

    def draws(seed):
        buf = ShardBuffer(store, capacity=len(jobs))
        buf.admit(jobs)
        g = torch.Generator().manual_seed(seed)
        out = [buf.draw(set(), g).job.id for _ in range(len(jobs))]
        buf.close()
        return out

    assert draws(3) == draws(3) and sorted(draws(3)) == sorted(j.id for j in jobs) and draws(3) != draws(4)
    buf = ShardBuffer(store, capacity=4)
    assert buf.free == 4
    buf.admit(jobs[:4])
    assert len(buf) == 4 and buf.free == 0 and buf.job_ids() == [j.id for j in jobs[:4]]
    shard, wait = buf.load(buf.draw(set(), torch.Generator()))
    assert wait >= 0 and torch.equal(shard.hidden[:, 0, 0], shard.input_ids.float())
    buf.close()


def test_buffer_prefers_buckets_not_yet_in_the_step(live):
    m, store = live
    publish_all(m, store)
    jobs = m.jobs("written")
    buckets = {j.bucket for j in jobs}
    assert len(buckets) >= 2
    b0 = jobs[0].bucket
    for seed in range(20):
        buf = ShardBuffer(store, capacity=len(jobs))
        buf.admit(jobs)
        e = buf.draw({b0}, torch.Generator().manual_seed(seed))
        assert e.bucket != b0
        buf.close()


def test_a_step_of_several_jobs_waits_for_two_buckets_unless_nothing_more_can_come(live):
    from types import SimpleNamespace

    from dflash_staged.train import draw

    m, store = live
    publish_all(m, store)
    jobs = m.jobs("written")
    by_bucket = {}
    for j in jobs:
        by_bucket.setdefault(j.bucket, []).append(j)
    (a, b, *_), other = sorted(by_bucket.values(), key=len, reverse=True)[:2]  # 2+ jobs in the first
    finished = [False]
    buf = ShardBuffer(store, capacity=4)
    t = SimpleNamespace(
        buffer=buf,
        cfg=SimpleNamespace(train=TrainConfig(grad_accum=2, min_ready=2, buffer_capacity=4)),
        source=SimpleNamespace(finished=lambda: finished[0]),
    )
    ready = lambda: draw.ready(t)  # noqa: E731
    buf.admit([a])
    assert not ready()  # fewer than min_ready
    buf.admit([b])
    assert not ready()  # two shards, one bucket
    buf.admit([other[0]])
    assert ready()  # two buckets
    t.cfg.train.grad_accum = 1
    buf.entries.pop()
    assert ready()  # one job per step: one bucket is all it can mix
    t.cfg.train.grad_accum = 2
    assert not ready()
    finished[0] = True
    assert ready()  # nothing more is coming: never wait on what cannot arrive
    finished[0] = False
    assert [e.bucket for e in buf.entries] == [a.bucket] * 2
    buf.capacity = 2
    assert ready()  # a full buffer of one bucket cannot change: draw from it
    buf.close()


def test_buffer_load_raises_for_a_damaged_shard(live):
    m, store = live
    publish_all(m, store, limit=1)
    (j,) = m.jobs("written")
    chunk = next((store.shard_path(j.epoch, j.id) / "hidden").glob("c.*"))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    buf = ShardBuffer(store, capacity=1)
    buf.admit([j])
    with pytest.raises(ShardError):
        buf.load(buf.draw(set(), torch.Generator()))
    buf.close()


# ---------------------------------------------------------------------------------------------- sources
def test_live_source_admits_oldest_first_requeues_bad_shards_and_knows_when_done(live):
    m, store = live
    first = publish_all(m, store, limit=3)
    src = LiveSource(m, store, "trainer-a", 0)
    buf = ShardBuffer(store, capacity=2)
    src.fill(buf)
    assert buf.job_ids() == first[:2] and m.ready_count() == 1
    src.fill(buf)  # full: nothing more
    assert len(buf) == 2
    assert not src.finished()  # jobs are still pending
    src.bad_shard(m.job(first[0]), ShardError("damaged"))
    assert m.job(first[0]).state == "pending" and m.status()["requeued"] == {"ShardError": 1}
    publish_all(m, store)
    assert not src.finished()  # written shards remain to be admitted
    big = ShardBuffer(store, capacity=1000)
    src.fill(big)
    assert src.finished() and m.ready_count() == 0
    assert {j.taken_by for j in m.jobs("written")} == {"trainer-a"}
    buf.close(), big.close()


def test_live_source_readmits_a_checkpoints_buffer(live):
    m, store = live
    ids = publish_all(m, store, limit=4)
    src = LiveSource(m, store, "trainer-b", 1)
    buf = ShardBuffer(store, capacity=4)
    src.admit_ids(buf, [ids[2], ids[0], 999_999])  # in the checkpoint's order; unknown ids are dropped
    assert buf.job_ids() == [ids[2], ids[0]]
    assert m.job(ids[2]).taken_by == "trainer-b" and m.job(ids[2]).rank == 1
    buf.close()


def test_replay_source_needs_kept_shards_and_repeats_passes_or_a_recorded_order(live):
    m, store = live
    with pytest.raises(DflashError, match="no kept shards"):
        ReplaySource(m, store)
    ids = publish_all(m, store)
    m.consume(ids, step=1)
    m.release(ids, keep=True)
    src = ReplaySource(m, store, passes=3)
    assert len(src.sequence) == 3 * len(ids)
    buf = ShardBuffer(store, capacity=5)
    src.fill(buf)
    assert src.pos == 5 and not src.finished()
    order = {1: [ids[3], ids[1]], 2: [ids[0]]}
    src2 = ReplaySource(m, store, order=order)
    assert [f.job.id for f in src2.forced_step(0)] == [ids[3], ids[1]] and src2.order_done(2)
    with pytest.raises(DflashError, match="not kept"):
        ReplaySource(m, store, order={1: [123_456]})
    buf.close()


# ---------------------------------------------------------------------------------------------- ledger
@pytest.mark.parametrize("keep", [False, True])
def test_ledger_releases_only_what_a_checkpoint_covers(live, keep):
    m, store = live
    ids = publish_all(m, store, limit=4)
    led = Ledger(m, store, live=True, rank=0, keep_shards=keep)
    led.record(1, [Consumed(ids[0], 0, 10, 0, 5.0), Consumed(ids[1], 0, 10, 0, 5.0)])
    led.record(2, [Consumed(ids[2], 0, 10, 0, 5.0)])
    assert led.holds_unreleased(2) and m.job(ids[0]).state == "consumed"
    led.checkpoint_done(1)  # covers step 1 only
    led.poll(wait=True)  # released once the remover has deleted their files
    assert [m.job(i).state for i in ids] == ["kept" if keep else "released"] * 2 + ["consumed", "written"]
    assert store.has_shard(m.job(ids[0]).epoch, ids[0]) == keep and store.has_shard(
        m.job(ids[2]).epoch, ids[2]
    )
    assert led.covered() == {ids[0]: 1, ids[1]: 1, ids[2]: 2}


def test_ledger_releases_a_batch_only_once_its_files_are_gone(live, monkeypatch):
    """Extract's window counts consumed shards: they leave it (released) only after the remover has
    deleted their files, so the store never holds more than the window allows (issue 33, item 3)."""
    import threading

    from dflash_staged.store import cleanup

    m, store = live
    ids = publish_all(m, store, limit=3)
    gate, real = threading.Event(), cleanup._remove
    monkeypatch.setattr(cleanup, "_remove", lambda paths: (gate.wait(30), real(paths)))
    led = Ledger(m, store, live=True, rank=0, keep_shards=False)
    led.record(1, [Consumed(ids[0], 0, 10, 0, 5.0), Consumed(ids[1], 0, 10, 0, 5.0)])
    in_window = m.window()["shards"]
    led.checkpoint_done(1)
    assert not store.has_shard(m.job(ids[0]).epoch, ids[0])  # renamed away at once: no reader sees it
    led.poll()
    assert [m.job(i).state for i in ids[:2]] == ["consumed", "consumed"]  # its files are not gone yet
    assert m.window()["shards"] == in_window
    gate.set()
    led.poll(wait=True)
    assert [m.job(i).state for i in ids] == ["released", "released", "written"]
    assert m.window()["shards"] == in_window - 2
    led.close()


def test_ledger_reconcile_on_resume(live):
    m, store = live
    ids = publish_all(m, store, limit=3)
    m.consume(ids, step=1)  # a killed trainer consumed all three; its checkpoint covers only the first
    led = Ledger(m, store, live=True, rank=0, keep_shards=False)
    led.load_state_dict({"consumed": {"1": [[ids[0], 0, 10, 0, 5.0]]}, "step": 1})
    led.reconcile()
    led.poll(wait=True)
    assert [m.job(i).state for i in ids] == ["released", "written", "written"]
    assert not store.has_shard(m.job(ids[0]).epoch, ids[0]) and store.has_shard(m.job(ids[1]).epoch, ids[1])


def test_a_replay_ledger_never_writes_the_manifest(live):
    m, store = live
    ids = publish_all(m, store, limit=2)
    led = Ledger(m, store, live=False, rank=0, keep_shards=False)
    led.record(1, [Consumed(ids[0], 0, 10, 0, 5.0)])
    led.checkpoint_done(1)
    assert not led.holds_unreleased(1) and m.job(ids[0]).state == "written"


# ---------------------------------------------------------------------------------------------- checkpoints
def _params(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.nn.Parameter(torch.randn(4, 3, generator=g)),
        "b.weight": torch.nn.Parameter(torch.randn(5, generator=g)),
    }


def test_checkpoint_round_trip_restores_weights_and_optimizer(tmp_path):
    params = _params(0)
    opt = Optimizer(params, TrainConfig(lr=1e-2), Dist(torch.device("cpu")))
    for _ in range(3):
        (sum((p**2).sum() for p in params.values())).backward()
        opt.step(1e-2)
    state = ckpt.TrainerState({"step": 3, "consumed": {"1": [[7, 0, 10, 0, 5.0]]}}, {})
    state = ckpt.TrainerState(
        {**state.values, **{k: v for k, v in opt.state_dict().items() if not torch.is_tensor(v)}},
        {k: v for k, v in opt.state_dict().items() if torch.is_tensor(v)},
    )
    out = ckpt.save_checkpoint(
        tmp_path, 3, write_drafter=lambda d: (d / "config.json").write_text("{}"), state=state, keep=2
    )
    assert out.name == "step_00000003" and ckpt.latest_checkpoint(tmp_path) == out
    loaded = ckpt.load_checkpoint(out)
    assert loaded["format_version"] == ckpt.FORMAT_VERSION and loaded.consumed_jobs() == {7: 1}
    assert loaded["opt_steps"] == 3 and loaded.path == out
    params2 = _params(1)
    opt2 = Optimizer(params2, TrainConfig(lr=1e-2), Dist(torch.device("cpu")))
    opt2.load_state_dict(loaded)
    for n in params:
        assert torch.equal(params[n], params2[n])
    for p in (params, params2):  # one more identical step from identical state
        (sum((x**2).sum() for x in p.values())).backward()
    opt.step(1e-2), opt2.step(1e-2)
    for n in params:
        assert torch.equal(params[n], params2[n])


def test_checkpoints_keep_the_newest_and_refuse_another_format(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(
            tmp_path,
            step,
            write_drafter=lambda d: None,
            state=ckpt.TrainerState({"step": step}, {"x": torch.zeros(1)}),
            keep=2,
        )
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    (ckpt.checkpoints_dir(tmp_path) / ".step_00000004.tmp-1-abc").mkdir()  # a save killed midway
    ckpt.cleanup_tmp(tmp_path)
    assert sorted(p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()) == [
        "step_00000002",
        "step_00000003",
    ]
    latest = ckpt.latest_checkpoint(tmp_path)
    st = json.loads((latest / "trainer_state.json").read_text())
    (latest / "trainer_state.json").write_text(json.dumps({**st, "format_version": 99}))
    with pytest.raises(ckpt.CheckpointError, match="format_version 99"):
        ckpt.load_checkpoint(latest)
    (latest / "trainer_state.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="cannot be read"):
        ckpt.load_checkpoint(latest)


def test_a_checkpoint_holds_one_safetensors_file_at_its_top_and_the_old_layout_resumes(tmp_path):
    """Serving engines load every *.safetensors at the top of a directory: only the drafter's may be there.
    A version-1 checkpoint (trainer_state.safetensors at the top) still loads."""
    state = ckpt.TrainerState({"step": 5}, {"master.w": torch.arange(4.0)})
    out = ckpt.save_checkpoint(
        tmp_path, 5, write_drafter=lambda d: (d / "model.safetensors").write_bytes(b""), state=state, keep=2
    )
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert (out / ckpt.TRAINER_TENSORS).is_file()
    old = out / ckpt.LEGACY_TRAINER_TENSORS
    (out / ckpt.TRAINER_TENSORS).rename(old)
    (out / "trainer").rmdir()
    st = json.loads((out / "trainer_state.json").read_text())
    (out / "trainer_state.json").write_text(json.dumps({**st, "format_version": 1}))
    loaded = ckpt.load_checkpoint(out)
    assert loaded["step"] == 5 and torch.equal(loaded.tensors["master.w"], torch.arange(4.0))


# ---------------------------------------------------------------------------------------------- loop helpers
def test_microbatches_cover_every_token_once_within_the_budget(live):
    m, store = live
    publish_all(m, store)
    for j in m.jobs("written"):
        shard = store.read_shard(j.epoch, j.id, j.checksum)
        for budget in (1, 50, 300, 10_000):
            mbs = microbatches(shard, budget)
            assert torch.equal(torch.cat([mb["input_ids"] for mb in mbs]), shard.input_ids.long())
            for mb in mbs:
                cu = mb["cu_seqlens"]
                assert int(cu[0]) == 0 and int(cu[-1]) == mb["hidden"].shape[0] == mb["input_ids"].shape[0]
                assert int(cu[-1]) <= budget or cu.numel() == 2  # over budget only as a lone sequence


def test_lr_schedule_warms_up_peaks_and_decays_to_zero():
    total, base = 100, 1e-3
    lrs = [lr_at(s, total, base, 0.1) for s in range(total)]
    assert lrs[:10] == sorted(lrs[:10]) and math.isclose(lrs[9], base)
    assert lrs[10:] == sorted(lrs[10:], reverse=True) and lrs[-1] < 1e-3 * base
    assert lr_at(total, total, base, 0.1) == 0.0
    wsd = [lr_at(s, total, base, 0.1, "wsd", 0.2) for s in range(total)]
    assert wsd[:10] == lrs[:10] and set(wsd[10:80]) == {base}  # warmup, then stable
    assert wsd[80:] == sorted(wsd[80:], reverse=True) and 0 < wsd[-1] <= base / 20


def test_plot_draws_the_curves_and_refuses_a_run_without_metrics(tmp_path):
    from helpers import cli

    lines = [
        {"step": s, "loss": 5.0 / s, "tau": 1 + s / 100, "lr": 1e-3, "tokens": 100} for s in range(1, 40)
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 40, "loss"'
    )
    code, out = cli("plot", tmp_path)
    assert code == 0, out
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out = cli("plot", tmp_path / "nope")
    assert code == 1 and out.startswith("error: ") and "metrics.jsonl" in out


def test_ranks_wait_together_and_release_when_extract_would_wait(live, monkeypatch):
    """DDP: a rank that is ready (its source says nothing more is coming) does not draw while another
    rank still waits; the ranks checkpoint and release before waiting only when extract's window is
    full (or the wait is long), and a rank's error stops all."""
    from types import SimpleNamespace

    from dflash_staged.train import draw
    from dflash_staged.train.draw import gather_step
    from dflash_staged.train.sources import DrainError

    m, store = live

    class TwoRanks:  # this rank's collectives, with the other rank's answers scripted
        enabled, rank, world = True, 0, 2

        def __init__(self, other_not_ready: int, other_error: str | None = None):
            self.polls, self.other_not_ready, self.other_error = 0, other_not_ready, other_error

        def fill(self, _buffer) -> None:  # each poll starts with a fill, then asks whether all are ready
            self.polls += 1
            self.other_not_ready -= 1

        def any(self, flag: bool) -> bool:  # "is any rank not ready?" right after a fill; else this rank's
            asks_ready, self.last_polls = self.polls != getattr(self, "last_polls", 0), self.polls
            return flag or (asks_ready and self.other_not_ready >= 0)

        def gather_obj(self, obj):
            return [obj, (DrainError, self.other_error) if self.other_error else None]

    released, in_window = [], {"shards": 8, "bytes": 0}
    dist = TwoRanks(other_not_ready=3)
    t = SimpleNamespace(
        buffer=ShardBuffer(store, capacity=4),
        dist=dist,
        step=5,
        draw_gen=torch.Generator().manual_seed(0),
        cfg=SimpleNamespace(
            train=TrainConfig(grad_accum=2, min_ready=2, buffer_capacity=4),
            extract=SimpleNamespace(window=64),
        ),
        m=SimpleNamespace(
            meta={"extract_window": {"shards": 8}},
            window=lambda node=None: in_window,
            forget_meta=lambda: None,
        ),
        source=SimpleNamespace(
            finished=lambda: True,
            fill=lambda b: t.dist.fill(b),
            check_progress_possible=lambda: None,
            forced_step=lambda step: [],
            live=True,
        ),
        ledger=SimpleNamespace(
            holds_unreleased=lambda step: not released, poll=lambda: None, deletes=dist.rank == 0, node=None
        ),
        checkpoint_and_release=lambda: released.append(t.step),
        progress=SimpleNamespace(waiting=lambda *a, **k: None),
    )
    data = gather_step(t, stop=False)
    assert dist.polls == 4 and data is not None and data.shards == []  # drew only once the other was ready
    assert released == [5]  # the window was full (8 of 8): released at once, before the first wait
    released.clear()
    in_window["shards"] = 7  # room for a claim: a short wait costs no checkpoint
    t.dist = TwoRanks(other_not_ready=3)
    assert gather_step(t, stop=False) is not None and released == []
    monkeypatch.setattr(draw, "CHECKPOINT_AFTER_S", 0.02)  # ... and a long one does
    t.dist = TwoRanks(other_not_ready=3)
    assert gather_step(t, stop=False) is not None and released == [5]
    t.dist = TwoRanks(other_not_ready=10, other_error="2 job(s) are still pending")
    with pytest.raises(DrainError, match="still pending"):
        gather_step(t, stop=False)  # the other rank's error stops this one too, instead of a hang


def test_metrics_that_cannot_be_written_stop_in_one_line_and_passes_must_be_positive(tmp_path):
    from dflash_staged.train.metrics import MetricsLog

    from helpers import cli

    (tmp_path / "metrics.jsonl").mkdir()  # as unwritable as a full disk, and as easy to make
    with pytest.raises(DflashError, match=r"cannot append step 3 to .*metrics\.jsonl.*rerun"):
        MetricsLog(tmp_path, enabled=True).write({"step": 3, "loss": 1.0})
    code, out = cli("train", "--replay", "--manifest", tmp_path, "--out", tmp_path / "o", "--passes", "0")
    assert code == 2 and "--passes" in out and "0 is not in the range x>=1" in out, out


def test_cpu_bf16_follows_the_cpu_s_flags_and_refuses_emulation():
    """train.cpu_bf16: "auto" is on exactly where /proc/cpuinfo lists bf16 instructions, "on" is refused
    where it does not (on any CPU this test runs on, one branch or the other is checked)."""
    from pathlib import Path

    from dflash_staged.errors import DflashError
    from dflash_staged.train.trained_drafter import cpu_bf16

    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    has = bool(flags & {"amx_bf16", "avx512_bf16"})
    assert cpu_bf16("off") is False and cpu_bf16("auto") is has
    if has:
        assert cpu_bf16("on") is True
    else:
        with pytest.raises(DflashError, match="bf16 would be emulated"):
            cpu_bf16("on")

"""Both sides' busy and idle time (dflash_staged.manifest.balance): the shares, the verdict and the split
against hand-computed cases; the figures through each manifest backend into `dflash status`."""

from __future__ import annotations

import json
import queue
import types

import pytest

from dflash_staged.manifest import Manifest
from dflash_staged.manifest.balance import (
    Tally,
    collect,
    format_balance,
    shares,
    short,
    verdict,
)
from dflash_staged.manifest.states import Proc

from helpers import cli, plan


def ex(busy, full, none=0.0):
    return {"busy_s": busy, "window_full_s": full, "no_work_s": none}


def tr(busy, wait):
    return {"busy_s": busy, "data_wait_s": wait}


# ---------------------------------------------------------------------------------------------- pure parts
def test_shares_and_tally_recent_interval():
    assert shares(ex(29, 71)) == pytest.approx({"busy_s": 0.29, "window_full_s": 0.71, "no_work_s": 0.0})
    assert shares(tr(0, 0)) == {"busy_s": 0.0, "data_wait_s": 0.0}
    t = Tally(("busy_s", "data_wait_s"), now=0.0, recent_s=60)
    t.add("busy_s", 10)
    assert t.snapshot(10.0) == {"total": tr(10, 0), "recent": tr(10, 0), "recent_s": 10.0}
    t.add("busy_s", 5)
    t.add("data_wait_s", 3)
    # marks at 0, 10, 100: the newest at least 60 s old is the one at 10
    assert t.snapshot(100.0) == {"total": tr(15, 3), "recent": tr(5, 3), "recent_s": 90.0}
    t.set(tr(20, 2))  # totals kept elsewhere; they never go back
    assert t.snapshot(101.0)["total"] == tr(20, 3)


def test_the_verdicts_split_is_the_node_choosers():
    """Status suggests what dflash node --split auto would choose for the same rates (one chooser)."""
    from dflash_staged.split import choose_split

    # 4 + 4 GPUs, extract busy 116 of 400 device-seconds, train 396: per-device rates 1/116 : 1/396
    v = verdict(ex(116, 284), tr(396, 4), 4, 4)
    best = choose_split(8, 1, 1 / 116, 1 / 396)
    assert v["split"] == [best.extract_devices, best.train_ranks]
    v2 = verdict(ex(116, 284), tr(396, 4), 4, 4, tp=2)  # whole groups of 2
    assert v2["split"][0] % 2 == 0 and v2["split"] == [
        choose_split(8, 2, 2 / 116, 1 / 396).extract_devices,
        6,
    ]


def test_verdict_training_is_the_bottleneck():
    # 4 + 4 GPUs for 100 s: extract busy 29%, idle 71% on a full window; train waits 1%
    v = verdict(ex(116, 284), tr(396, 4), 4, 4)
    # rates 1/116 and 1/396 per device: e=2 gives min(2/116, 6/396) = 6/396, now min(4/116, 4/396) = 4/396
    assert v["bottleneck"] == "train" and v["split"] == [2, 6] and v["gain"] == pytest.approx(1.5)
    assert v["text"] == (
        "extract idle 71% on a full window: training is the bottleneck; move GPUs from extract to "
        "train (e.g. 2 extract + 6 train, about 1.50x the throughput)"
    )


def test_verdict_extraction_is_the_bottleneck():
    # 1 extract GPU always busy; 7 train GPUs waiting 60%: rates 1/100 and 1/280 per device
    v = verdict(ex(100, 0), tr(280, 420), 1, 7, unit="devices")
    assert v["bottleneck"] == "extract" and v["split"] == [2, 6] and v["gain"] == pytest.approx(2.0)
    assert v["text"].startswith("train waiting 60% for data: extraction is the bottleneck; move devices")
    assert "(e.g. 2 extract + 6 train, about 2.00x the throughput)" in v["text"]


def test_verdict_balanced_missing_both_waiting_and_no_better_split():
    v = verdict(ex(99, 1), tr(98, 2), 4, 4)
    assert v["bottleneck"] == "none" and v["split"] is None
    assert v["text"] == "balanced: extract idle 1% on a full window, train waiting 2% for data"
    v = verdict(ex(10, 0), None, 1, 0)
    assert v["bottleneck"] is None and v["text"] == "no figures from train yet"
    assert verdict(None, tr(0, 0))["text"] == "no figures from extract or train yet"
    both = verdict(ex(80, 20), tr(90, 10), 4, 4)  # extract waits more: training, and a small window
    assert both["bottleneck"] == "train" and "the other side waits too, 10%: raise --window" in both["text"]
    # one device each: no other split exists
    one = verdict(ex(30, 70), tr(100, 0), 1, 1, unit="devices")
    assert one["split"] == [1, 1] and one["gain"] == 1.0
    assert (
        "no other split of the 2 devices does better" in one["text"] and "add devices to train" in one["text"]
    )
    # tensor-parallel groups of 4 on 8 GPUs: 4 + 4 is the only split
    assert verdict(ex(29, 71), tr(100, 0), 4, 4, tp=4)["split"] == [4, 4]
    # extract ran ahead and has nothing left to claim; train never waited: training sets the pace
    ahead = verdict(ex(6, 0, 94), tr(100, 0), 1, 1, unit="devices")
    assert ahead["bottleneck"] == "train" and ahead["text"].startswith(
        "extract idle 94% with nothing left to claim (it ran ahead) while train waited only 0%: training is "
    )
    # train waits while extract has nothing to claim: the split may not be the cause
    odd = verdict(ex(50, 0, 50), tr(70, 30), 2, 1)
    assert odd["bottleneck"] == "extract" and "nothing to claim 50% of the time" in odd["text"]


def proc(role, balance, pid=1, rank=None):
    return Proc(f"{role}:{pid}", role, "h", pid, None, None, rank, {"balance": balance} if balance else {})


def fig(kinds, total, recent=None, run="r", rank=None, devices=("cuda:0",), t=100.0):
    return {
        "t": t,
        "devices": list(devices),
        "tp": 1,
        "run": run,
        "rank": rank,
        "total": total,
        "recent": recent or total,
        "recent_s": 60.0,
    }


def test_collect_sums_live_processes_and_falls_back_to_the_last_finished_run():
    live = [
        proc("extract", fig(None, ex(10, 30), ex(5, 15), devices=["cuda:0", "cuda:1"]), pid=1),
        proc("extract", fig(None, ex(10, 30), ex(5, 15), devices=["cuda:2", "cuda:3"]), pid=2),
        proc("train", None, pid=3),  # registered, nothing published yet
    ]
    finished = {
        "train": [
            fig(None, tr(1, 1), run="old", rank=0),
            fig(None, tr(50, 1), run="new", rank=0, devices=["cuda:4"]),
            fig(None, tr(50, 1), run="new", rank=1, devices=["cuda:5"]),
            fig(None, tr(60, 2), run="new", rank=1, devices=["cuda:5"]),  # a retried final report: the last
        ]
    }
    b = collect(live, finished, now=103.0)
    assert b["extract"]["live"] and b["extract"]["processes"] == 2 and len(b["extract"]["devices"]) == 4
    assert b["extract"]["total"] == ex(20, 60) and b["extract"]["recent"] == ex(10, 30)
    assert b["extract"]["age_s"] == 3.0
    assert not b["train"]["live"] and b["train"]["total"] == tr(110, 3) and len(b["train"]["devices"]) == 2
    assert b["verdict"]["total"]["bottleneck"] == "train" and "GPUs" in b["verdict"]["total"]["text"]
    lines = format_balance(b)
    assert lines[1] == (
        "time (whole run): extract busy 25%, window full 75%, nothing to claim 0% (4 device(s)); "
        "train busy 97%, data wait 3% (2 device(s), finished)"
    )
    assert lines[3] == f"bottleneck (whole run): {b['verdict']['total']['text']}"
    assert short(b) == "extract idle 75% (window full 75%), train waits 3%: training is the bottleneck"
    assert collect([], {}, 0.0)["extract"] is None and format_balance(collect([], {}, 0.0)) == []
    assert short(collect([proc("extract", fig(None, ex(0, 0)))], {}, 0.0)) == ""  # nothing counted yet


def test_a_trainer_gone_with_jobs_left_gets_no_advice_to_move_devices():
    """Issue 50: after the trainer was interrupted, extract (waiting on its full window for a trainer that
    is gone) advised moving devices to train. The advice is for a trainer alive and slow, or one that
    trained every job."""
    live = [proc("extract", fig(None, ex(10, 90), devices=["cuda:0"]))]
    finished = {"train": [fig(None, tr(50, 1), run="g", rank=0, devices=["cuda:1"])]}
    gone = collect(live, finished, now=101.0, train_left=5)
    for span in ("recent", "total"):
        v = gone["verdict"][span]
        assert v["bottleneck"] is None and v["split"] is None and "GPUs" not in v["text"]
        assert v["text"].startswith("no trainer is running and 5 job(s) are left to train"), v["text"]
        assert "start `dflash train`" in v["text"]
    assert "bottleneck" not in short(gone) and "move" not in " ".join(format_balance(gone))
    finished_all = collect(live, finished, now=101.0, train_left=0)  # it trained every job
    assert finished_all["verdict"]["total"]["bottleneck"] == "train"
    alive = collect(live + [proc("train", fig(None, tr(50, 1)), pid=2)], {}, now=101.0, train_left=5)
    assert alive["verdict"]["total"]["bottleneck"] == "train" and "GPUs" in alive["verdict"]["total"]["text"]


# ---------------------------------------------------------------------------------------------- the manifest
def test_status_counts_the_jobs_a_gone_trainer_left(tmp_path):
    mdir = plan(tmp_path, n=8)
    with Manifest.open(mdir) as m:
        m.register("extract", info={"devices": ["cpu"], "tp": 1})
        m.report("extract", fig(None, ex(10, 90), devices=["cpu"]))
        key = m.register("train", group_id="g", rank=0)
        m.report("train", fig(None, tr(50, 1), run="g", rank=0, devices=["cpu"]), final=True)
        m.unregister(key)  # interrupted: no job was trained
        st = m.status()
        left = st["total_jobs"]
        assert left > 0 and st["groups"]["trained"] == 0
        for span in ("recent", "total"):
            text = st["balance"]["verdict"][span]["text"]
            assert text.startswith(f"no trainer is running and {left} job(s) are left to train"), text


def test_report_reaches_status_through_each_backend(tmp_path, backend):
    mdir = plan(tmp_path, n=8, manifest=backend.address(tmp_path))
    with Manifest.open(mdir) as m:
        assert m.status()["balance"]["extract"] is None  # nothing published: what an older run leaves
        pid_key = m.register("extract", info={"devices": ["cpu"], "tp": 1})
        m.report("extract", fig(None, ex(3, 1), devices=["cpu"]))
        m.report("train", fig(None, tr(1, 1)))  # this process holds no train registration: a no-op
        with Manifest.open(mdir, readonly=True) as r:
            st = r.status()
            assert st["balance"]["extract"]["total"] == ex(3, 1) and st["balance"]["extract"]["live"]
            assert st["balance"]["train"] is None
            assert [p.info["devices"] for p in r.live_procs("extract")] == [["cpu"]]  # the rest kept
        if backend.name == "postgres":  # a registration written again after a cut-off carries them too
            row, _ = m._procs._heart._regs[pid_key]
            assert json.loads(row[8]) == {
                "devices": ["cpu"],
                "tp": 1,
                "balance": fig(None, ex(3, 1), devices=["cpu"]),
            }
        m.report("extract", fig(None, ex(6, 2), devices=["cpu"]), final=True)
        m.unregister(pid_key)
    code, out = cli("status", "--manifest", mdir, "--json")
    assert code == 0, out
    b = json.loads(out)["balance"]
    assert b["extract"]["total"] == ex(6, 2) and not b["extract"]["live"]
    code, text = cli("status", "--manifest", mdir)
    assert "time (whole run): extract busy 75%, window full 25%, nothing to claim 0% (1 device(s), " in text
    assert "bottleneck (whole run): no figures from train yet" in text


def test_sqlite_reports_skip_the_fsync_but_the_final_one(tmp_path, monkeypatch):
    """The reports every 2 s per rank and per supervisor held SQLite's write lock through an fsync, on
    the step path: only the final one (which becomes an event that outlives the run) is durable."""
    mdir = plan(tmp_path, n=8)
    with Manifest.open(mdir) as m:
        m.register("extract", info={"devices": ["cpu"], "tp": 1})
        real, seen = m._tx, []

        def tx(durable: bool = True):
            seen.append(durable)
            return real(durable)

        monkeypatch.setattr(m, "_tx", tx)
        m.report("extract", fig(None, ex(3, 1), devices=["cpu"]))
        m.report("extract", fig(None, ex(4, 1), devices=["cpu"]))
        m.report("extract", fig(None, ex(6, 2), devices=["cpu"]), final=True)
        assert seen == [False, False, True]
        assert m.synchronous() == 2  # FULL again for every other commit
        assert m.events("balance:extract")


def test_stopwatch_and_the_trainers_figures(tmp_path, monkeypatch):
    from dflash_staged.extract.messages import Seconds, Stopwatch
    from dflash_staged.train.loop import BusyIdle

    now = [0.0]
    monkeypatch.setattr("time.monotonic", lambda: now[0])
    q: queue.Queue = queue.Queue()
    w = Stopwatch(0, q)
    now[0] = 1.0
    w.lap()  # the time before the first claim counts as nothing
    w.kind, now[0] = "busy_s", 3.0
    w.lap()
    w.kind, now[0] = "window_full_s", 3.5
    assert not w.going(lambda: False)  # the loop ends: sent
    assert isinstance(q.queue[-1], Seconds) and q.queue[-1].seconds == ex(2.0, 0.5)

    mdir = plan(tmp_path, n=8)
    m = Manifest.open(mdir)
    m.register("train", group_id="g", rank=0)
    t = types.SimpleNamespace(
        m=m,
        opts=types.SimpleNamespace(replay=False),
        device="cpu",
        dist=types.SimpleNamespace(group_id="g", rank=0),
    )
    b = BusyIdle(t)
    now[0] = 10.0
    b.step(5.0)  # the first step's wait is start-up
    now[0] = 12.0
    b.step(1.5)  # 2 s, 1.5 of them waiting
    now[0] = 20.0
    b.step(4.0)  # 8 s, 4 of them waiting
    now[0] = 30.0
    b.publish(final=True)  # the rest (the last step, the final checkpoint) is busy
    st = m.status()["balance"]
    assert st["train"]["total"] == tr(14.5, 5.5) and st["train"]["devices"] == ["cpu"]
    assert [json.loads(e["detail"])["total"] for e in m.events("balance:train")] == [tr(14.5, 5.5)]
    m.close()


def test_launcher_status_line_and_summary_show_both_sides(tmp_path):
    from dflash_staged.launch.monitor import Monitor, summary

    mdir = plan(tmp_path, n=8)
    with Manifest.open(mdir) as m:
        m.register("extract", info={"devices": ["cpu"], "tp": 1})
        m.register("train", group_id="g", rank=0)
        m.report("extract", fig(None, ex(30, 70), devices=["cpu"]))
        m.report("train", fig(None, tr(99, 1), run="g", rank=0, devices=["cpu"]))
        mon = Monitor(mdir, None, None)
        try:
            line = mon.line()
            assert line.endswith(
                "| extract idle 70% (window full 70%), train waits 1%: training is the bottleneck"
            ), line
            said = []
            side = types.SimpleNamespace(seconds=lambda: 1.0, exit_code=lambda: 0)
            s = summary(said.append, mon, 0, 0.0, side, side, 2.0, tmp_path / "summary.json")
        finally:
            mon.close()
    assert s["balance"]["extract"]["total"] == ex(30, 70)
    assert json.loads((tmp_path / "summary.json").read_text())["balance"]["train"]["total"] == tr(99, 1)
    assert [x for x in said if x.startswith("bottleneck (whole run): extract idle 70% on a full window")]

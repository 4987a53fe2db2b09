"""Non-finite values never reach the drafter (issue 33, item 7).

Extract screens each job's states before publishing: a job with an inf or a NaN is not published;
it is retried once and then marked failed, with one line naming the job, its samples and the layer,
and `dflash status` counts it. The trainer skips an update whose gradient is not finite, records
the step as skipped, and stops with one line after a run of them.
"""

from __future__ import annotations

import json

import torch

from dflash_staged.extract.forward import nonfinite_layers
from dflash_staged.manifest import Manifest

from helpers import cli, run, status, write_config, write_dataset
from rel_helpers import hooked_env, tracebacks

EXTRA = "[data]\ntoken_budget = 512\n"
INF_TOKEN = 2  # write_dataset draws ids from 4..2047: this id appears only where the test puts it


def test_nonfinite_layers_names_the_layers():
    h = torch.zeros(5, 3, 4)
    assert nonfinite_layers(h, [2, 5, 9]) == []
    h[3, 1, 2] = float("nan")
    h[0, 2, 0] = float("-inf")
    assert nonfinite_layers(h, [2, 5, 9]) == [5, 9]
    assert nonfinite_layers(torch.zeros(0, 3, 4), [2, 5, 9]) == []


def test_a_job_with_nonfinite_states_is_not_published_and_fails_after_a_retry(tmp_path):
    data = write_dataset(tmp_path / "data.jsonl", n=24)
    lines = data.read_text().splitlines()
    row = json.loads(lines[5])
    row["input_ids"][len(row["input_ids"]) // 2] = INF_TOKEN  # one token of sample 5 overflows
    lines[5] = json.dumps(row)
    data.write_text("\n".join(lines) + "\n")
    cfg = write_config(tmp_path / "cfg.toml", EXTRA)
    mdir = tmp_path / "manifest"
    code, text = cli("plan", "--config", cfg, "--data", data, "--manifest", mdir)
    assert code == 0, text
    env = hooked_env(fake_target={"hidden": 8, "inf_token": INF_TOKEN})
    r = run(["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu"], env)
    out = r.stdout + r.stderr
    assert not tracebacks(out), out
    with Manifest.open(mdir, readonly=True) as m:
        failed = m.jobs("failed")
        assert len(failed) == 1 and 5 in failed[0].sample_ids, [j.sample_ids for j in failed]
        bad = failed[0]
        assert not (
            tmp_path / "store" / "shards" / f"e{bad.epoch}" / f"j{bad.id}"
        ).exists()  # never published
        errors = [e for e in m.events("error") if e["job"] == bad.id]
        assert len(errors) == 2  # retried once, then failed
        layer = m.meta["layer_ids"][-1]
        assert (
            f"job {bad.id} failed (non-finite hidden states (inf or NaN) from target layer(s) [{layer}]"
            in out
        )
        assert "5" in errors[0]["detail"].split("samples ")[1].split(";")[0]
        written = m.counts()["written"]
        assert written == len(m.jobs()) - 1  # every other job published
    st = status(mdir)
    assert st["jobs"]["failed"] == 1, st["jobs"]


def test_the_trainer_skips_nonfinite_updates_and_stops_after_a_run_of_them(tmp_path, monkeypatch):
    """In process: a drafter whose loss turns NaN from its third step on. The first two updates apply;
    the next ones are skipped (logged as such, AdamW never stepped) and the run stops with one line
    after NONFINITE_STOP of them, every rank alike (the decision is the all-reduced gradient's)."""
    import pytest

    from dflash_staged.errors import DflashError
    from dflash_staged.train import loop
    from dflash_staged.train.options import TrainOptions
    from dflash_staged.train.trained_drafter import DrafterModel
    from dflash_staged.train.trainer import build_trainer

    from helpers import plan

    mdir = plan(tmp_path, n=72, extra=EXTRA)
    r = run(["extract", "--manifest", mdir, "--store", tmp_path / "store", "--devices", "cpu"])
    assert r.returncode == 0, r.stderr
    opts = TrainOptions(manifest=mdir, store=tmp_path / "store", out=tmp_path / "run", device="cpu")
    t = build_trainer(opts)
    real = DrafterModel.loss

    def loss(self, batch, knobs):
        value, stats = real(self, batch, knobs)
        return (value * float("nan") if t.step >= 2 else value), stats

    monkeypatch.setattr(DrafterModel, "loss", loss)
    monkeypatch.setattr(loop, "NONFINITE_STOP", 3)
    try:
        with pytest.raises(
            DflashError, match=r"not finite for 3 steps in a row \(steps 3-5; none was applied"
        ):
            loop.train_loop(t)
        adam_steps = {int(st["step"]) for st in t.optim.opt.state.values()}
    finally:
        t.close()
    assert adam_steps == {2}  # the skipped steps never reached AdamW
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("skipped") is not None for x in lines] == [False, False, True, True, True]
    assert all(x["loss"] is None for x in lines[2:]) and lines[0]["loss"] is not None

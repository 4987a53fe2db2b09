"""The trainer in process: one training step of the real loop, and the checkpoint as the sum of its
components' own states (a component registered in one place comes back after a resume)."""

from __future__ import annotations

import shutil

import pytest
import torch

from dflash_staged.train import checkpoint as ckpt
from dflash_staged.train.loop import train_loop
from dflash_staged.train.options import TrainOptions
from dflash_staged.train.trainer import build_trainer

from helpers import plan, run_dflash


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    d = tmp_path_factory.mktemp("extracted")
    mdir = plan(d, n=12, extra="[data]\ntoken_budget = 512\n")
    r = run_dflash(
        "extract", "--manifest", mdir, "--store", d / "store", "--devices", "cpu", "--window", "64"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return d


@pytest.fixture
def run(extracted, tmp_path):
    shutil.copytree(extracted / "manifest", tmp_path / "manifest")
    shutil.copytree(extracted / "store", tmp_path / "store")
    return lambda **kw: TrainOptions(
        manifest=tmp_path / "manifest", store=tmp_path / "store", out=tmp_path / "run", device="cpu", **kw
    )


class Counter:
    """A stateful component as a user would add one: it owns the key ``counter``."""

    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict:
        return {"counter": self.n}

    def load_state_dict(self, state) -> None:
        self.n = state["counter"]


class PerRank(Counter):
    per_rank = True

    def state_dict(self) -> dict:
        return {"per_rank_note": f"rank-{self.n}"}

    def load_state_dict(self, state) -> None:
        self.n = state["per_rank_note"]


def trained(opts: TrainOptions, **extra):
    t = build_trainer(opts, extra_states=extra)
    try:
        code = train_loop(t)
    finally:
        t.close()
    return t, code


def test_one_training_step_in_process(run):
    t = build_trainer(run(max_steps=1))
    before = {n: p.detach().clone() for n, p in t.model.params.items()}
    try:
        assert train_loop(t) == 0 and t.step == 1
    finally:
        t.close()
    changed = [n for n, p in t.model.params.items() if not torch.equal(p.detach(), before[n])]
    assert len(changed) >= len(before) // 2, changed
    assert list(t.ledger.consumed) == [1] and t.ledger.checkpointed == 1
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(t.opts.out))
    assert state["step"] == 1 and state.consumed() == t.ledger.consumed
    assert state["opt_steps"] == 1 and len(state["buffer"]) == len(state["generators"]) == 1  # one rank
    for n, p in t.model.params.items():  # the masters saved are the weights after the step
        assert torch.equal(state[f"master.{n}"], p.detach().float())


def test_a_component_added_in_one_place_is_restored_after_resume(run):
    counter = Counter()
    counter.n = 41
    t, code = trained(run(max_steps=1), counter=counter)
    assert code == 0 and ckpt.load_checkpoint(ckpt.latest_checkpoint(t.opts.out))["counter"] == 41
    fresh = Counter()
    t2 = build_trainer(run(max_steps=2), extra_states={"counter": fresh})
    try:
        assert fresh.n == 41 and t2.step == 1  # restored, with the built-in components
        fresh.n += 1
        assert train_loop(t2) == 0 and t2.step == 2
    finally:
        t2.close()
    again = Counter()
    build_trainer(run(), extra_states={"counter": again}).close()
    assert again.n == 42


def test_components_may_not_share_a_key_and_per_rank_parts_are_lists(run):
    t = build_trainer(run(max_steps=1))
    try:
        with pytest.raises(ValueError, match="'ledger' and 'twin' both write the checkpoint key 'consumed'"):
            ckpt.TrainerState.collect({**t.states, "twin": t.ledger}, t.dist.gather_obj)
        note = PerRank()
        note.n = 7
        state = ckpt.TrainerState.collect({"trainer": t, "note": note}, t.dist.gather_obj)
        assert state.values["per_rank_note"] == ["rank-7"] and state["step"] == 0
        back = PerRank()
        state.restore({"note": back}, rank=0)
        assert back.n == "rank-7"

        class Tensors(PerRank):
            def state_dict(self) -> dict:
                return {"t": torch.zeros(1)}

        with pytest.raises(
            ValueError, match="'tensors' is per rank: its part must be JSON values, not the tensor 't'"
        ):
            ckpt.TrainerState.collect({"tensors": Tensors()}, t.dist.gather_obj)
    finally:
        t.close()


def test_a_step_with_a_row_budget_and_activation_checkpointing(run):
    t = build_trainer(
        run(max_steps=1, overrides={"train": {"microbatch_rows": 4096, "activation_checkpointing": True}})
    )
    try:
        assert t.model.max_rows == 4096 and t.model.drafter.activation_checkpointing
        assert train_loop(t) == 0 and t.step == 1
    finally:
        t.close()

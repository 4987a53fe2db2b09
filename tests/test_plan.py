"""Planning: buckets, token-budget batches, epoch order (hypothesis properties + examples)."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_staged.config import DataConfig
from dflash_staged.plan.batching import (
    PlanError,
    bucket_edges,
    epoch_order,
    make_batches,
    make_plan,
    random_batches_waste,
)

from helpers import cfg_for

# cfg_for's base here
PLAN = dict(data__max_len=256, data__token_budget=1024, data__bucket_edges=[], data__num_buckets=4)


lengths_st = st.lists(st.integers(1, 256), min_size=1, max_size=300).map(np.asarray)
edges_st = st.one_of(
    st.just(()),
    st.lists(st.integers(1, 300), min_size=1, max_size=6, unique=True).map(lambda e: tuple(sorted(e))),
)


def bucket_of(length, edges):
    return next(i for i, e in enumerate(edges) if length <= e)


@settings(max_examples=60, deadline=None)
@given(
    lengths=lengths_st,
    budget=st.integers(256, 4096),
    edges=edges_st,
    nb=st.integers(1, 8),
    epochs=st.integers(1, 3),
    seed=st.integers(0, 2**32),
)
def test_plan_properties(lengths, budget, edges, nb, epochs, seed):
    plan = make_plan(
        lengths,
        cfg_for(PLAN, data__token_budget=budget, data__bucket_edges=list(edges), data__num_buckets=nb),
        epochs,
        seed,
    )
    jobs = list(plan.jobs())
    assert len(jobs) == epochs * len(plan.batches) == plan.num_jobs
    for e in range(epochs):
        ep = [j for j in jobs if j.epoch == e]
        # every sample in exactly one job per epoch
        ids = Counter(i for j in ep for i in j.sample_ids)
        assert sorted(ids) == list(range(len(lengths))) and set(ids.values()) == {1}
        assert [j.pos for j in ep] == list(range(len(ep)))
    for j in jobs:
        lens = lengths[j.sample_ids]
        # budget respected, padded = batch_size x longest, real = sum
        assert len(lens) * lens.max() <= budget
        assert j.padded_tokens == len(lens) * lens.max() and j.real_tokens == lens.sum()
        # a batch never mixes buckets, and the bucket is right
        assert {bucket_of(x, plan.edges) for x in lens} == {j.bucket}
    assert plan.tokens_real == lengths.sum()
    assert plan.padding_waste == pytest.approx(1 - plan.tokens_real / plan.tokens_padded)
    assert 0 <= plan.padding_waste < 1


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 2**32))
def test_same_seed_same_order_and_epochs_differ(lengths, seed):
    cfg = cfg_for(PLAN, data__token_budget=300)
    a, b = make_plan(lengths, cfg, 3, seed), make_plan(lengths, cfg, 3, seed)
    ja, jb = list(a.jobs()), list(b.jobs())
    assert [(j.epoch, j.bucket, j.sample_ids) for j in ja] == [(j.epoch, j.bucket, j.sample_ids) for j in jb]
    n = len(a.batches)
    # the order of an epoch is a pure function of (seed, epoch)
    assert np.array_equal(a.order(1), epoch_order(n, seed, 1))
    if n >= 6:  # 6! orders: a collision of three epochs is vanishingly rare but possible for tiny n
        orders = {tuple(a.order(e)) for e in range(3)}
        assert len(orders) > 1


def test_epoch_orders_differ_and_seed_matters():
    o0, o1 = epoch_order(1000, 7, 0), epoch_order(1000, 7, 1)
    assert sorted(o0.tolist()) == list(range(1000))
    assert not np.array_equal(o0, o1)
    assert not np.array_equal(o0, epoch_order(1000, 8, 0))
    assert np.array_equal(o0, epoch_order(1000, 7, 0))


def test_order_within_batch_is_fixed_across_epochs():
    lengths = np.random.default_rng(0).integers(1, 200, 500)
    plan = make_plan(lengths, cfg_for(PLAN, data__token_budget=512), 3, 1)
    per_epoch = [{tuple(j.sample_ids) for j in plan.jobs() if j.epoch == e} for e in range(3)]
    assert per_epoch[0] == per_epoch[1] == per_epoch[2]


def test_batches_are_length_sorted_longest_first():
    lengths = np.array([5, 90, 17, 90, 33, 2, 60])
    batches, real, padded = make_batches(lengths, [100], 100)
    flat = [i for _, ids in batches for i in ids]
    assert flat == [1, 3, 6, 4, 2, 0, 5]  # length desc, ties by id
    assert [ids for _, ids in batches] == [[1], [3], [6], [4, 2, 0], [5]]
    assert padded.tolist() == [90, 90, 60, 99, 2] and real.tolist() == [90, 90, 60, 55, 2]


def test_configured_edges_and_quantiles():
    lengths = np.arange(1, 101)
    assert bucket_edges(lengths, DataConfig(max_len=256, bucket_edges=[10, 50])) == [10, 50, 100]
    assert bucket_edges(lengths, DataConfig(max_len=256, bucket_edges=[10, 200])) == [10, 200]
    assert bucket_edges(lengths, DataConfig(max_len=256, num_buckets=4)) == [25, 50, 75, 100]
    # duplicate quantiles collapse; the last edge always covers the longest
    assert bucket_edges(np.array([8] * 50 + [9]), DataConfig(max_len=256, num_buckets=4)) == [8, 9]


def test_plan_rejects_oversize_and_bad_args():
    with pytest.raises(PlanError, match="token_budget"):
        make_batches(np.array([10, 600]), [600], 512)
    with pytest.raises(PlanError, match="epochs"):
        make_plan(np.array([3]), cfg_for(PLAN), 0, 0)
    with pytest.raises(PlanError, match="seed"):
        make_plan(np.array([3]), cfg_for(PLAN), 1, -1)


def test_sorted_batching_beats_random_on_long_tail():
    lengths = np.clip(np.random.default_rng(0).lognormal(4.5, 0.8, 20_000).astype(int), 8, 1024)
    cfg = cfg_for(PLAN, data__max_len=1024, data__token_budget=4096, data__num_buckets=8)
    plan = make_plan(lengths, cfg, 1, 0)
    assert plan.padding_waste <= 0.02
    assert random_batches_waste(lengths, 4096) > 5 * plan.padding_waste

"""The DFlash drafter and its objective: equivalence, gradients, loss, anchors, learning."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters import attention as block_attention
from dflash_staged.model.drafters.backbone import DFlashDrafter
from dflash_staged.train.objective import (
    block_labels,
    decay_weights,
    dflash_loss,
    head_loss,
    noise_std_at,
    per_offset_accuracy,
    sample_anchors,
    training_tau,
)

from helpers import H, V, make_drafter, one_by_one, packed_batch


@pytest.mark.parametrize("heads,kv", [(4, 2), (4, 4), (4, 1)])
def test_many_anchor_forward_equals_one_block_at_a_time(heads, kv):
    m = make_drafter(heads=heads, kv=kv).eval()
    b = packed_batch([23, 9, 31])
    # Anchors include position 0 of each sequence (no context), the last positions (blocks
    # running past the end), and come unsorted.
    anchors = torch.tensor([40, 0, 23, 5, 31, 32, 62, 1, 22, 60, 50])
    with torch.no_grad():
        train = m.logits(m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], anchors)[:, 1:])
        ref = one_by_one(m, b, anchors)
    assert train.shape == (len(anchors), m.block_size - 1, V)
    torch.testing.assert_close(train, ref, atol=1e-5, rtol=1e-5)


def test_attention_chunking_does_not_change_results(monkeypatch):
    m = make_drafter().eval()
    b = packed_batch([40, 33])
    anchors = sample_anchors(
        b["loss_mask"], b["cu_seqlens"], m.block_size, 20, torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        full = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], anchors)
        monkeypatch.setattr(block_attention, "ATTN_CHUNK_ELEMS", 1)  # one anchor per attention call
        chunked = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], anchors)
    assert block_attention.anchor_chunk(2, 20, 40, m.block_size, 4, torch.device("cpu")) == 1
    torch.testing.assert_close(full, chunked, atol=1e-5, rtol=1e-5)


def test_context_after_anchor_and_other_sequences_do_not_matter():
    m = make_drafter().eval()
    b = packed_batch([20, 20])
    anchors = torch.tensor([10, 25])
    with torch.no_grad():
        base = m.forward_train(b["hidden"], b["input_ids"], b["cu_seqlens"], anchors)
        h2 = b["hidden"].clone()
        h2[10:20] += 5.0  # after anchor 10 in sequence 0: invisible to both anchors
        h2[30:] -= 3.0  # after anchor 25 in sequence 1
        ids2 = b["input_ids"].clone()
        ids2[11:20] = 7  # tokens after the anchor never enter the block input
        moved = m.forward_train(h2, ids2, b["cu_seqlens"], anchors)
        h3 = b["hidden"].clone()
        h3[9] += 1.0  # just before anchor 10: visible
        seen = m.forward_train(h3, b["input_ids"], b["cu_seqlens"], anchors)
    torch.testing.assert_close(base, moved)
    assert not torch.allclose(base[0], seen[0]) and torch.equal(base[1], seen[1])


def test_gradients_reach_drafter_params_only():
    m = make_drafter()
    embed = torch.nn.Parameter(m.embed_weight.clone())  # even a trainable tensor passed in stays frozen
    m2 = DFlashDrafter(m.dcfg, embed, m.lm_head_weight)
    m2.load_state_dict(m.state_dict())
    loss, _ = dflash_loss(
        m2, packed_batch([30, 25]), num_anchors=8, gamma=4.0, generator=torch.Generator().manual_seed(0)
    )
    loss.backward()
    for name, p in m2.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert embed.grad is None
    assert not m2.embed_weight.requires_grad and not m2.lm_head_weight.requires_grad
    assert set(m2.state_dict()).isdisjoint({"embed_weight", "lm_head_weight", "inv_freq"})


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_head_loss_matches_autograd(chunk):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(V, H, generator=g)
    h0 = torch.randn(25, H, generator=g)
    y = torch.randint(0, V, (25,), generator=g)
    w = torch.rand(25, generator=g) * (torch.rand(25, generator=g) > 0.3)
    h1, h2 = h0.clone().requires_grad_(), h0.clone().requires_grad_()
    loss, wsum, hits = head_loss(h1, W, y, w, loss_chunk=chunk)
    (loss * 2.5).backward()
    logits = h2 @ W.t()
    ref = (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()
    (ref * 2.5).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h1.grad, h2.grad)
    assert torch.equal(hits, logits.argmax(-1) == y) and torch.isclose(wsum, w.sum())


def test_dflash_loss_equals_explicit_per_anchor_computation():
    m = make_drafter().eval()
    b = packed_batch([30, 12, 27], loss_mask_p=0.7, seed=5)
    gamma, B = 3.0, m.block_size
    loss, stats = dflash_loss(m, b, num_anchors=6, gamma=gamma, generator=torch.Generator().manual_seed(9))
    anchors = sample_anchors(b["loss_mask"], b["cu_seqlens"], B, 6, torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = one_by_one(m, b, anchors)
    cu = b["cu_seqlens"].tolist()
    num = den = 0.0
    correct = [0] * (B - 1)
    total = [0] * (B - 1)
    for i, a in enumerate(anchors.tolist()):
        end = min(c for c in cu[1:] if c > a)
        for k in range(1, B):
            if a + k < end and b["loss_mask"][a + k] > 0:
                w = math.exp(-(k - 1) / gamma)
                ce = F.cross_entropy(logits[i, k - 1][None], b["input_ids"][a + k][None]).item()
                num, den = num + w * ce, den + w
                total[k - 1] += 1
                correct[k - 1] += int(logits[i, k - 1].argmax() == b["input_ids"][a + k])
    assert abs(loss.item() - num / den) < 1e-5
    assert stats["total"].tolist() == total and stats["correct"].tolist() == correct
    assert abs(stats["weight_sum"].item() - den) < 1e-4 and abs(stats["loss_sum"].item() - num) < 1e-3
    assert stats["num_anchors"].item() == len(anchors)


def test_no_candidates_gives_zero_loss_that_backpropagates():
    m = make_drafter()
    b = packed_batch([1, 1])  # no position has a next token
    loss, stats = dflash_loss(m, b, num_anchors=4, gamma=4.0, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert loss.item() == 0.0 and stats["num_anchors"].item() == 0 and stats["total"].sum() == 0


def test_inconsistent_batch_is_a_user_error():
    m = make_drafter()
    b = packed_batch([10, 10])
    b["cu_seqlens"] = torch.tensor([0, 10, 15])
    with pytest.raises(DflashError, match="cu_seqlens"):
        dflash_loss(m, b, num_anchors=4, gamma=4.0)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    block=st.integers(2, 8),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    p=st.floats(0.0, 1.0),
)
def test_sample_anchors_properties(lengths, block, n, seed, p):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    lm = (torch.rand(T, generator=g) < p).long()
    anchors = sample_anchors(lm, cu, block, n, torch.Generator().manual_seed(seed))
    again = sample_anchors(lm, cu, block, n, torch.Generator().manual_seed(seed))
    assert torch.equal(anchors, again)
    a = anchors.tolist()
    assert a == sorted(set(a))
    for s in range(len(lengths)):
        lo, hi = int(cu[s]), int(cu[s + 1])
        cands = [t for t in range(lo, hi) if lm[t] and t + 1 < hi and lm[t + 1]]
        mine = [t for t in a if lo <= t < hi]
        assert set(mine) <= set(cands)
        assert len(mine) == min(n, len(cands))


def test_sample_anchors_is_uniform_over_candidates():
    lm = torch.ones(12)
    lm[3] = 0
    cu = torch.tensor([0, 12])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(12)
    for _ in range(600):
        counts[sample_anchors(lm, cu, 4, 2, g)] += 1
    # candidates: t and t+1 supervised, t+1 inside: 0..10 minus 2 and 3 -> 9 positions, each drawn
    # with probability 2/9 (the last ones too: partial blocks are allowed)
    assert counts[2] == 0 and counts[3] == 0 and counts[11] == 0
    cand = counts[[0, 1, 4, 5, 6, 7, 8, 9, 10]]
    assert cand.min() > 85 and cand.max() < 185  # expectation 133


def test_block_labels_mask_end_and_loss_mask():
    ids = torch.arange(10, 20)
    lm = torch.ones(10)
    lm[4] = 0
    labels, valid = block_labels(ids, lm, torch.tensor([0, 6, 10]), torch.tensor([2, 7]), 4)
    assert labels.tolist() == [[13, 0, 15], [18, 19, 0]]
    assert valid.tolist() == [[True, False, True], [True, True, False]]


def test_decay_noise_and_acceptance_metrics():
    assert torch.allclose(decay_weights(4, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert noise_std_at(5, 10, 0.2, "constant") == 0.2
    assert abs(noise_std_at(5, 10, 0.2, "linear") - 0.1) < 1e-12
    assert abs(noise_std_at(0, 10, 0.2, "cosine") - 0.2) < 1e-12
    assert abs(noise_std_at(10, 10, 0.2, "cosine")) < 1e-12 and noise_std_at(3, 10, 0.0, "linear") == 0.0
    with pytest.raises(DflashError):
        noise_std_at(1, 10, 0.1, "step")
    assert training_tau(torch.tensor(6), torch.tensor(4)) == 2.5 and training_tau(0, 0) == 1.0
    assert per_offset_accuracy(torch.tensor([3, 0]), torch.tensor([4, 0])) == [0.75, 0.0]


def test_noise_changes_features_reproducibly():
    m = make_drafter().eval()
    b = packed_batch([30])
    runs = [
        dflash_loss(m, b, 4, 4.0, torch.Generator().manual_seed(1), noise_std=s)[0].item()
        for s in (0.0, 0.5, 0.5)
    ]
    assert runs[1] == runs[2] and runs[0] != runs[1]


def test_tiny_drafter_overfits_fixed_batches():
    torch.manual_seed(0)
    m = make_drafter(layers=1, block=4, vocab=64)
    g = torch.Generator().manual_seed(0)
    batches = []
    for s in range(3):
        b = packed_batch([20, 12], seed=s)
        b["input_ids"] = torch.randint(0, 63, b["input_ids"].shape, generator=g)
        batches.append(b)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)

    def total_loss():
        with torch.no_grad():
            return sum(
                dflash_loss(m, b, 64, 4.0, torch.Generator().manual_seed(0))[0].item() for b in batches
            )

    start = total_loss()
    for step in range(60):  # anchors are re-drawn every step
        loss, _ = dflash_loss(m, batches[step % 3], 64, 4.0, torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = total_loss()
    assert end < start / 8, (start, end)

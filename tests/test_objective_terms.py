"""The loss terms on the target's distribution (issue 31): every term of ``train.loss`` against a direct
full-vocabulary computation with autograd on a toy vocabulary (values and gradients, chunked and not,
with a softcap and at another temperature), the identities KL = 0 at equal logits and TV = 1 -
overlap, the target's rows in the head, and the objective's target metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_staged.config import LOSS_TERMS, TARGET_TERMS, TrainConfig
from dflash_staged.config.checks import ConfigError
from dflash_staged.model.target.logits import transform_logits
from dflash_staged.model.target.weights import FinalNorm
from dflash_staged.train.objective import dflash_loss, expected_acceptance
from dflash_staged.train.objective.head import TargetRows, head_rows
from dflash_staged.train.objective.terms import TERMS

from helpers import make_drafter, packed_batch

P, H, V = 23, 12, 37


def reference(name: str, u: torch.Tensor, t: torch.Tensor, y: torch.Tensor, T: float, eta: float = 3.0):
    """Each term written directly over the full vocabulary (autograd gives the gradient)."""
    logq, logp = torch.log_softmax(u / T, -1), torch.log_softmax(t / T, -1)
    q, p = logq.exp(), logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    if name == "ce":
        return F.cross_entropy(u, y, reduction="none")
    if name == "ce_target":
        return F.cross_entropy(u, t.argmax(-1), reduction="none")
    if name == "kl":
        return kl
    if name == "rkl":
        return (q * (logq - logp)).sum(-1)
    if name == "jsd":
        logm = torch.log((p + q) / 2)
        return 0.5 * (p * (logp - logm)).sum(-1) + 0.5 * (q * (logq - logm)).sum(-1)
    if name == "tv":
        return tv
    if name == "lk":
        lam = torch.exp(-eta * (1 - tv).detach())
        return lam * kl + (1 - lam) * tv
    if name == "lk_alpha":
        return -torch.minimum(p, q).sum(-1).clamp_min(1e-5).log()
    raise AssertionError(name)


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(P, H, generator=g, dtype=torch.float64).float()
    W = (torch.randn(V, H, generator=g) * 0.7).float()
    x = torch.randn(P, H, generator=g) * 1.5  # the target's last layer at each row's position
    y = torch.randint(0, V, (P,), generator=g)
    w = torch.rand(P, generator=g)  # per-row weights, applied after the head (as the objective does)
    return h, W, x, y, w


def test_the_registry_is_the_configs_list_and_the_config_checks_loss():
    assert set(TERMS) == set(LOSS_TERMS)
    assert {n for n, t in TERMS.items() if t.needs_target} == set(TARGET_TERMS)
    t = TrainConfig(loss={"ce": 0.1, "tv": 0.9})
    assert t.needs_target and t.target_terms == ["tv"]
    assert not TrainConfig().needs_target and TrainConfig(selector_labels="target").needs_target
    with pytest.raises(ConfigError, match=r"train\.loss\.kld: unknown loss term"):
        TrainConfig(loss={"kld": 1.0})
    with pytest.raises(ConfigError, match="not all 0"):
        TrainConfig(loss={"ce": 0.0})


@pytest.mark.parametrize("name", LOSS_TERMS)
@pytest.mark.parametrize("chunk", [P, 5])
@pytest.mark.parametrize("softcap,T", [(None, 1.0), (4.0, 1.0), (None, 2.0)])
def test_each_term_matches_the_full_vocabulary_computation(name, chunk, softcap, T):
    h, W, x, y, w = setup()
    norm = FinalNorm(torch.ones(H) * 1.3, 1e-6)
    mult = 0.8 if softcap else 1.0
    # the head, in chunks
    hh = h.clone().requires_grad_(True)
    rows = head_rows(
        hh,
        W,
        y,
        chunk,
        mult,
        softcap,
        terms={name: 1.0},
        target=TargetRows(x, torch.arange(P), norm),
        temperature=T,
    )
    (w * rows.loss).sum().backward()
    # directly
    hr = h.clone().requires_grad_(True)
    u = transform_logits(hr @ W.t(), mult, softcap)
    t = transform_logits(norm(x) @ W.t(), mult, softcap)
    ref = reference(name, u, t, y, T)
    (w * ref).sum().backward()
    torch.testing.assert_close(rows.loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hh.grad, hr.grad, rtol=1e-4, atol=1e-6)


def test_a_weighted_mix_is_the_weighted_sum_of_its_terms():
    h, W, x, y, w = setup(1)
    target = TargetRows(x, torch.arange(P), FinalNorm(torch.ones(H), 1e-6))
    grads, losses = {}, {}
    for terms in ({"ce": 0.1, "tv": 0.9}, {"ce": 1.0}, {"tv": 1.0}):
        hh = h.clone().requires_grad_(True)
        rows = head_rows(hh, W, y, 7, terms=terms, target=target)
        (w * rows.loss).sum().backward()
        grads[tuple(terms)], losses[tuple(terms)] = hh.grad, rows.loss
    torch.testing.assert_close(losses[("ce", "tv")], 0.1 * losses[("ce",)] + 0.9 * losses[("tv",)])
    torch.testing.assert_close(grads[("ce", "tv")], 0.1 * grads[("ce",)] + 0.9 * grads[("tv",)])


def test_kl_is_zero_when_the_drafter_is_the_target_and_tv_is_one_minus_the_overlap():
    h, W, _, y, _ = setup(2)
    norm = FinalNorm(torch.ones(H), 1e-6)
    same = TargetRows(h.clone(), torch.arange(P), norm)
    hn = norm(h)  # the drafter's states equal the target's normed ones: equal logits
    for name in ("kl", "rkl", "jsd", "tv", "lk"):
        rows = head_rows(hn.clone().requires_grad_(True), W, y, 5, terms={name: 1.0}, target=same)
        assert rows.loss.abs().max() < 1e-5, (name, rows.loss)
    _, W, x, y, _ = setup(3)
    target = TargetRows(x, torch.arange(P), norm)
    rows = head_rows(h, W, y, 5, terms={"tv": 1.0}, target=target)
    p, q = torch.softmax(norm(x) @ W.t(), -1), torch.softmax(h @ W.t(), -1)
    overlap = torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(rows.loss, 1 - overlap)
    torch.testing.assert_close(rows.overlap, overlap)  # the acceptance metric is the same quantity
    assert torch.equal(rows.target_ids, (norm(x) @ W.t()).argmax(-1))
    assert torch.equal(rows.target_hits, (h @ W.t()).argmax(-1) == rows.target_ids)


def test_expected_acceptance_is_the_sum_of_cumulative_products():
    alpha = torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.2, 1.0]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    # block 0: .5 + .25 + .125; block 1: the invalid offset neither breaks nor counts: .9 + .9
    assert float(expected_acceptance(alpha, valid)) == pytest.approx(0.875 + 1.8)


def test_dflash_loss_with_the_target_logs_its_metrics_and_refuses_without_it():
    d = make_drafter()
    b = packed_batch([40, 25], k_taps=len(d.dcfg.target_layer_ids) + 1)  # + the target's last layer
    norm = FinalNorm(torch.ones(d.dcfg.hidden_size), 1e-6)
    g = torch.Generator().manual_seed(0)
    loss, st = dflash_loss(d, b, 8, 4.0, g, terms={"ce": 0.1, "tv": 0.9}, target_norm=norm)
    loss.backward()
    n = st["target_total"].sum()
    assert n > 0 and torch.equal(st["target_total"], st["total"])
    assert 0 < float(st["overlap"].sum() / n) < 1 and 0 < float(st["expected_accepted"])
    assert 0 <= float(st["target_accepted"]) <= float(st["blocks"]) * (d.block_size - 1)
    # plain CE on the same batch: the taps alone feed the drafter, so the DFlash term is unchanged
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    plain, _ = dflash_loss(d, b, 8, 4.0, g1)
    b_taps = dict(b, hidden=b["hidden"][:, :-1])
    taps_only, st2 = dflash_loss(d, b_taps, 8, 4.0, g2)
    torch.testing.assert_close(plain, taps_only)
    assert float(st2["target_total"].sum()) == 0
    with pytest.raises(Exception, match="store_last_layer"):
        dflash_loss(d, b_taps, 8, 4.0, g1, terms={"kl": 1.0}, target_norm=norm)

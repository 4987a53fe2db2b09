"""The target's top-k at a real vocabulary (issue 48): V = 151,936 with rows as peaked as a real model's
(top-1 at 1 - 1e-6, two-token peaks, logits near 30), the drafter's logits in float32 as trained and
the top-k stored as extract stores them (fp16 log-probabilities, the tail's float32 log-mass). Every
term's value and gradient is finite and equals the float64 brute force on the bucketed distributions;
``rkl`` stays below its full-vocabulary value; a tail of one token is exact; DSpark's and DSpine's head
stays finite; and a short training run on such rows skips no step."""

from __future__ import annotations

import pytest
import torch

from dflash_staged.model.drafters.target_dist import TopK, legacy_logtail
from dflash_staged.model.target.logits import log_probs
from dflash_staged.train.objective.head import TopkRows, head_rows
from dflash_staged.train.objective.terms import TERMS, Chunk

V, K, N = 151_936, 64, 6
TERM_NAMES = ["kl", "rkl", "jsd", "tv", "lk", "lk_alpha"]


def target_logits(kind: str, seed: int = 0) -> torch.Tensor:
    """``[N, V]`` float64 logits near 30: the tail N(0, 2^2), the peak placed so its mass is exact."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(N, V, generator=g, dtype=torch.float64) * 2.0
    lse = torch.logsumexp(t, -1)
    tail = {"top1": 1e-6, "two": 1e-6, "top1_1e-4": 1e-4, "top1_1e-8": 1e-8}[kind]
    peak = lse + torch.log(torch.tensor((1 - tail) / tail, dtype=torch.float64))
    if kind == "two":  # two tokens share the top (0.6 / 0.4 of 1 - 1e-6)
        t[:, 7], t[:, 11] = peak + torch.log(torch.tensor(0.6)), peak + torch.log(torch.tensor(0.4))
    else:
        t[:, 7] = peak
    return t


def drafter_logits(t: torch.Tensor, kind: str, seed: int = 1) -> torch.Tensor:
    """The drafter's float32 logits: equal to the target's, more confident, or near it."""
    g = torch.Generator().manual_seed(seed)
    u = t.clone()
    if kind == "confident":  # less than float32's resolution of 1 - sum q outside the target's top-k
        u[:, 7] += 4.0
    elif kind == "near":
        u += 0.3 * torch.randn(u.shape, generator=g, dtype=torch.float64)
    return u.float()


def stored_topk(t: torch.Tensor, k: int = K) -> TopK:
    """As extract computes and stores them (``Target.topk_of``): float32 logits, their log-probabilities,
    fp16 for the top-k, the tail's float32 log-mass from the log-probabilities outside the ids."""
    lp = log_probs(t.float())
    v, i = lp.topk(k, dim=-1)
    return TopK(i.int(), v.half(), torch.logsumexp(lp.scatter(1, i, float("-inf")), -1))


def bucketed(name: str, u: torch.Tensor, top: TopK, eta: float = 3.0) -> torch.Tensor:
    """The term on (the k ids one by one, the tail as one outcome) in float64, by hand (autograd in ``u``):
    the drafter's tail from its logits outside the ids, the target's from the stored tail, its top-k
    scaled to 1 - r."""
    ids = top.ids.long()
    lse = torch.logsumexp(u, -1, keepdim=True)
    logq = torch.cat(
        [u.gather(1, ids), torch.logsumexp(u.scatter(1, ids, float("-inf")), -1, keepdim=True)], 1
    )
    logq = logq - lse
    lr = top.logtail.double()[:, None]
    lp = top.logp.double()
    lp = lp - torch.logsumexp(lp, -1, keepdim=True) + torch.log(-torch.expm1(lr))
    logp = torch.cat([lp, lr], 1)
    p, q = logp.exp(), logq.exp()
    kl = (p * (logp - logq)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    if name == "kl":
        return kl
    if name == "rkl":
        return (q * (logq - logp)).sum(-1)
    if name == "jsd":
        logm = torch.logaddexp(logp, logq) - torch.log(torch.tensor(2.0, dtype=torch.float64))
        return 0.5 * ((p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1))
    if name == "tv":
        return tv
    if name == "lk":
        lam = torch.exp(-eta * (1 - tv).detach())
        return lam * kl + (1 - lam) * tv
    return -torch.log1p(-tv)  # lk_alpha


def full_value(name: str, u: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return TERMS[name].fn(Chunk(u.double(), torch.zeros(N, dtype=torch.long), t, 1.0, 3.0))[0]


def fp16_slack(u: torch.Tensor, top: TopK) -> torch.Tensor:
    """How far the stored fp16 log-probabilities can move ``rkl``: ``sum_top q |log p| 2^-11`` (half an
    fp16 step is at most ``|x| 2^-11``), plus float32's rounding."""
    q = torch.softmax(u.double(), -1).gather(1, top.ids.long())
    return (q * top.logp.double().abs()).sum(-1) * 2.0**-11 + 1e-9


CASES = [(tk, dk) for tk in ("top1", "two", "top1_1e-4") for dk in ("matched", "confident", "near")]


@pytest.mark.parametrize("tkind,dkind", CASES)
def test_every_term_is_finite_and_equals_the_float64_bucketed_brute_force(tkind, dkind):
    t = target_logits(tkind)
    u = drafter_logits(t, dkind)
    top = stored_topk(t)
    c = Chunk(u, torch.zeros(N, dtype=torch.long), None, 1.0, 3.0, top=top)
    for name in TERM_NAMES:
        value, grad = TERMS[name].fn(c)
        assert bool(torch.isfinite(value).all()) and bool(torch.isfinite(grad).all()), name
        x = u.double().requires_grad_(True)
        want = bucketed(name, x, top)
        want.sum().backward()
        # float32 holds a log-probability near -1 to 6e-8; a few such roundings add up
        torch.testing.assert_close(value.double(), want.detach(), rtol=1e-4, atol=3e-7, msg=name)
        if not (dkind == "matched" and name in ("tv", "lk", "lk_alpha")):  # |p - q| has no gradient
            torch.testing.assert_close(grad.double(), x.grad, rtol=1e-4, atol=3e-7, msg=name)  # at p = q
        if name == "rkl":  # a lower bound of the full-vocabulary reverse KL (data processing)
            full = full_value(name, x.detach(), t)
            assert bool((value.double() <= full + fp16_slack(u, top)).all()), (value, full)


def test_the_float32_value_stays_a_lower_bound_where_the_old_tail_broke_it():
    """rkl over the top-k stays below the full-vocabulary rkl (up to float32's rounding) on every peaked
    row, with the tail stored; the tail derived from the fp16 entries overshoots on a peaked row."""
    for tkind in ("top1", "two", "top1_1e-4", "top1_1e-8"):
        t = target_logits(tkind, seed=3)
        u = drafter_logits(t, "near", seed=4)
        top = stored_topk(t)
        got = TERMS["rkl"].fn(Chunk(u, torch.zeros(N, dtype=torch.long), None, 1.0, 3.0, top=top))[0]
        full = full_value("rkl", u, t)
        assert bool((got.double() <= full + fp16_slack(u, top)).all()), (tkind, got, full)
        lp = torch.log_softmax(t, -1)  # the tail in float64 from the true logits
        true_r = torch.logsumexp(lp.scatter(1, top.ids.long(), float("-inf")), -1).exp()
        torch.testing.assert_close(top.logtail.double().exp(), true_r, rtol=1e-5, atol=0)
        derived = legacy_logtail(top.logp).exp()  # what a store without the tail gets
        if tkind == "top1_1e-8":  # fp16 entries cannot carry a tail of 1e-8: off by more than half
            assert bool(((derived - true_r).abs() > 0.5 * true_r).all()), (derived, true_r)


def test_a_tail_of_one_token_is_exact_at_a_real_vocabulary():
    """k = V - 1 in float64: the tail is one token of mass ~1e-20; every term equals its full value."""
    t = target_logits("top1", seed=5)
    t[:, 3] = t[:, 7] - 46.0  # the least likely token, far below everything
    u = drafter_logits(t, "near", seed=6).double()
    z = t
    lse = torch.logsumexp(z, -1)
    v, i = z.topk(V - 1, dim=-1)
    assert bool((i != 3).all())
    top = TopK(i, v - lse[:, None], torch.logsumexp(z.scatter(1, i, float("-inf")), -1) - lse)
    y = torch.zeros(N, dtype=torch.long)
    for name in TERM_NAMES:
        a = TERMS[name].fn(Chunk(u, y, t, 1.0, 3.0))
        b = TERMS[name].fn(Chunk(u, y, None, 1.0, 3.0, top=top))
        torch.testing.assert_close(b[0], a[0], rtol=1e-9, atol=1e-14, msg=name)
        torch.testing.assert_close(b[1], a[1], rtol=1e-9, atol=1e-14, msg=name)


def planted(H: int = 64, seed: int = 0, tail: float = 1e-6):
    """A frozen head ``W [V, H]`` and final states ``h [N, H]`` whose logits ``h W^T`` are peaked as a
    real model's (top-1 at 1 - ``tail``, near 30): the scale of ``h`` along a token's row, bisected."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, H, generator=g)
    rows = torch.randint(0, V, (N,), generator=g)
    h = torch.empty(N, H)
    for r, j in enumerate(rows.tolist()):
        lo, hi = 0.0, 2.0
        for _ in range(40):
            a = (lo + hi) / 2
            lp = torch.log_softmax((W @ (a * W[j])).double(), -1)[j]
            lo, hi = (a, hi) if -lp > tail else (lo, a)
        h[r] = a * W[j]
    return W, h


def test_dspark_and_dspine_head_are_finite_and_accept_what_matches():
    """distill_head at V = 151,936 with the drafter equal to the target on peaked rows: CE, L1 and the
    acceptance finite, the acceptance ~1 (not 0), the L1 ~0 (not 1e26), the gradients finite."""
    from dflash_staged.model.drafters.distill_head import HeadInputs, distill_head

    W, h_t = planted()
    top = stored_topk((h_t @ W.T).double())
    for h0 in (h_t, h_t * 1.2):  # matched, and more confident than the target
        h = h0.clone().requires_grad_(True)
        x = HeadInputs(
            W, top.ids[:, 0].long(), torch.ones(N), torch.arange(N), None, None, top, 1.0, None, 0.1, 0.9, 4,
            cand_k=16,
        )  # fmt: skip
        loss, ce, l1, accept, *_ = distill_head(h, None, None, x)
        loss.backward()
        assert bool(torch.isfinite(h.grad).all()) and torch.isfinite(loss)
        assert float(l1.max()) < 1e-3 and float(accept.min()) > 0.999, (l1, accept)


def test_a_short_training_run_on_peaked_rows_skips_no_step():
    """The drafter's final states start equal to the target's (its logits as peaked: the case that gave
    inf gradients) and train 12 steps with the project's optimizer on every target term over the
    stored top-64: every step is applied (none skipped as non-finite)."""
    from dflash_staged.config import TrainConfig
    from dflash_staged.train.distributed import Dist
    from dflash_staged.train.optim import Optimizer

    W, h_t = planted(seed=1)
    top = stored_topk((h_t @ W.T).double())
    for name in TERM_NAMES:
        h = torch.nn.Parameter(h_t.clone())
        opt = Optimizer({"h": h}, TrainConfig(lr=1e-3, grad_clip=1.0), Dist(torch.device("cpu")))
        for step in range(12):
            rows = head_rows(
                h, W, top.ids[:, 0].long(), 4, terms={name: 1.0}, target=TopkRows(top, torch.arange(N))
            )
            rows.loss.sum().backward()
            assert opt.step(1e-3), f"{name}: step {step} skipped (non-finite gradient)"
            assert bool(torch.isfinite(rows.overlap).all()) and float(rows.overlap.min()) > 0.99

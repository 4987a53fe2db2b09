"""dflash eval at T > 0: the target's distribution (temperature, top-k, top-p), lossless rejection
sampling checked exactly on a toy vocabulary, the DFlash v1 and DFlash2 (selector walk) proposals,
seeded reproducibility, and the sampling settings in the report."""

import functools
import json
import math

import pytest
import torch
from click.testing import CliRunner
from test_evaluate import B, prompt, random_drafter, tiny_target

from dflash_staged.cli import main
from dflash_staged.errors import DflashError
from dflash_staged.evaluate.sampling import (
    Sampler,
    SamplingSettings,
    SparseQ,
    dense_q,
    target_probs,
    verify_law,
)
from dflash_staged.evaluate.speculative import DrafterProposer, greedy_generate, speculative_generate
from dflash_staged.model.drafters.dflash2 import FAMILY as dflash2_family
from dflash_staged.model.drafters.weights import save_drafter

F64 = torch.float64


@pytest.fixture(scope="module")
def dense():
    return tiny_target()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000004"
    save_drafter(random_drafter(tiny_target(layer_ids=(1, 3))), d)
    return d


# -- the target's distribution --------------------------------------------------------------------
def test_target_probs_temperature_top_k_top_p_by_hand():
    base = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=F64)
    logits = base.log()
    assert torch.allclose(target_probs(logits, 1.0), base, atol=1e-15)
    t2 = base.sqrt() / base.sqrt().sum()  # T = 2: p^(1/2), renormalised
    assert torch.allclose(target_probs(logits, 2.0), t2, atol=1e-15)
    k4 = torch.tensor([0.4, 0.25, 0.15, 0.1, 0, 0], dtype=F64) / 0.9
    assert torch.allclose(target_probs(logits, 1.0, top_k=4), k4, atol=1e-15)
    # top-p 0.7 after top-k 4: 0.444 alone is short of 0.7, 0.444 + 0.278 reaches it
    kp = torch.tensor([0.4, 0.25, 0, 0, 0, 0], dtype=F64) / 0.65
    assert torch.allclose(target_probs(logits, 1.0, top_k=4, top_p=0.7), kp, atol=1e-15)
    # top-p alone: 0.4 + 0.25 + 0.15 = 0.8 reaches 0.75; the most likely token always stays
    p75 = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0], dtype=F64) / 0.8
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.75), p75, atol=1e-15)
    assert torch.equal(target_probs(logits, 1.0, top_p=0.1), torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=F64))
    ties = torch.tensor([3.0, 1.0, 1.0, 0.0], dtype=F64)  # ties at the k-th value stay, as in HF
    assert (target_probs(ties, 1.0, top_k=2) > 0).tolist() == [True, True, True, False]
    rows = torch.stack([logits, logits.flip(0)])  # row-wise
    assert torch.allclose(target_probs(rows, 1.0, top_k=4)[1], k4.flip(0), atol=1e-15)


# -- lossless rejection sampling, exactly -----------------------------------------------------------
V = 5


def toy_target(top_k=0, top_p=1.0, seed=0):
    """p(. | previous token) of a toy target: one logits row per previous token, then top-k/top-p."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g, dtype=F64) * 1.5
    return logits, target_probs(logits, 1.0, top_k, top_p)


def dense_drafter(seed=1):
    """q(. | previous token) over the whole vocabulary (as a v1 drafter's softmax(logits / T))."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g, dtype=F64).softmax(-1)


def sparse_drafter(seed=2, K=2):
    """q(. | previous token) on K candidates (as the DFlash2 walk), so p has mass outside q's support."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(V)])
    probs = torch.rand(V, K, generator=g, dtype=F64).softmax(-1)
    return ids, probs


def q_row(drafter, prev):
    if isinstance(drafter, torch.Tensor):
        return {t: float(drafter[prev, t]) for t in range(V)}
    ids, probs = drafter
    return {int(i): float(p) for i, p in zip(ids[prev], probs[prev])}


def q_block(drafter, prevs):
    """The block's proposal in the form a proposer returns it (dense rows, or SparseQ)."""
    if isinstance(drafter, torch.Tensor):
        return drafter[prevs]
    return SparseQ(drafter[0][prevs], drafter[1][prevs])


def outcome_law(p_table, drafter, anchor: int, L: int, n: int) -> dict:
    """The exact distribution of the next ``L`` committed tokens after ``anchor`` of speculative
    sampling with ``n`` drafts per block, by enumerating every draft outcome (the drafter walks:
    draft k is drawn given draft k-1) and every verify outcome of :func:`verify_law`, step after
    step (the law after a step depends only on its last token and how many tokens are still to come)."""

    def drafts_from(prev, k):
        if k == 0:
            yield (), 1.0
            return
        for t, qt in q_row(drafter, prev).items():
            if qt > 0:
                for rest, qr in drafts_from(t, k - 1):
                    yield (t, *rest), qt * qr

    @functools.cache
    def law(anchor: int, need: int) -> tuple:
        out: dict[tuple, float] = {}
        for drafts, qd in drafts_from(anchor, n):
            block = (anchor, *drafts)
            p = p_table[list(block)]  # row j: the target after block[j]
            stop, last = verify_law(p, q_block(drafter, list(block[:-1])), torch.tensor(drafts))
            for a in range(n + 1):
                for t in range(V):
                    w = qd * float(stop[a]) * float(last[a, t])
                    if w <= 0:
                        continue
                    step = drafts[:a] + (t,)
                    rest = {(): 1.0} if len(step) >= need else dict(law(t, need - len(step)))
                    for tail, wt in rest.items():
                        key = (step + tail)[:need]
                        out[key] = out.get(key, 0.0) + w * wt
        return tuple(out.items())

    return dict(law(anchor, L))


def target_law(p_table, anchor: int, L: int) -> dict:
    """The target's own distribution of the next ``L`` tokens, sampled token by token."""
    law = {(): 1.0}
    for _ in range(L):
        law = {
            seq + (t,): w * float(p_table[(anchor, *seq)[-1], t])
            for seq, w in law.items()
            for t in range(V)
            if w * float(p_table[(anchor, *seq)[-1], t]) > 0
        }
    return law


@pytest.mark.parametrize(
    "kind,top_k,top_p", [("dense", 0, 1.0), ("dense", 3, 0.8), ("sparse", 0, 1.0), ("sparse", 4, 0.7)]
)
def test_rejection_sampling_output_law_is_the_targets_exactly(kind, top_k, top_p):
    _, p_table = toy_target(top_k, top_p)
    drafter = dense_drafter() if kind == "dense" else sparse_drafter()
    if top_k or top_p < 1:
        assert (p_table == 0).any()  # the truncation removes tokens that q proposes
    if kind == "sparse":
        support = torch.zeros(V, V, dtype=torch.bool).scatter_(1, drafter[0], True)
        assert (p_table[~support] > 0.05).any()  # p has real mass outside q's support
    for n, L in [(1, 3), (2, 3), (3, 4)]:
        got = outcome_law(p_table, drafter, 0, L, n)
        want = target_law(p_table, 0, L)
        assert set(got) <= set(want)  # never a token the target cannot sample
        assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
        for seq, w in want.items():
            assert got.get(seq, 0.0) == pytest.approx(w, abs=1e-12), (n, seq)


def test_verify_law_by_hand_and_verify_draws_from_it():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]], dtype=F64)
    q = SparseQ(torch.tensor([[1, 3]]), torch.tensor([[0.6, 0.4]], dtype=F64))  # one draft
    stop, last = verify_law(p, q, torch.tensor([1]))
    acc = 0.3 / 0.6
    assert torch.allclose(stop, torch.tensor([1 - acc, acc], dtype=F64))
    resid = torch.tensor([0.5, 0.0, 0.2, 0.0], dtype=F64) / 0.7  # max(0, p - q), normalised
    assert torch.allclose(last[0], resid) and torch.equal(last[1], p[1])
    assert torch.equal(dense_q(q, 4), torch.tensor([[0, 0.6, 0, 0.4]], dtype=F64))
    stop, _ = verify_law(p, q, torch.tensor([3]))
    assert stop.tolist() == [1.0, 0.0]  # p(3) = 0: always rejected
    # the sampler's verify draws (a, token) from that law: frequencies within 5 sigma
    s = Sampler(SamplingSettings(temperature=1.0, seed=3))
    n = 3000
    counts: dict = {}
    for _ in range(n):
        key = s.verify(torch.tensor([1]), q, p.log())
        counts[key] = counts.get(key, 0) + 1
    stop, last = verify_law(p, q, torch.tensor([1]))
    for (a, t), c in counts.items():
        w = float(stop[a] * last[a, t])
        assert w > 0 and abs(c / n - w) < 5 * math.sqrt(w * (1 - w) / n) + 1e-9, (a, t)
    assert sum(counts.values()) == n


def test_settings_are_checked_and_described():
    assert SamplingSettings().describe()["mode"] == "greedy" and SamplingSettings().label() == "greedy"
    s = SamplingSettings(1.0, 0.95, 20, 7)
    assert s.describe() == {
        "mode": "sampled",
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 20,
        "seed": 7,
        "draft_sampling": "filtered",
    }
    assert s.label() == "T=1, top-p 0.95, top-k 20, seed 7"
    for bad, flag in [((-1.0,), "--temperature"), ((1.0, 0.0), "--top-p"), ((1.0, 1.0, -1), "--top-k")]:
        with pytest.raises(DflashError, match=flag):
            SamplingSettings(*bad)


# -- proposers: DFlash v1 and DFlash2 (selector walk) ------------------------------------------------
def test_v1_proposer_samples_from_softmax_over_temperature(dense):
    drafter = random_drafter(dense, seed=1)
    ctx, toks = torch.randn(12, 2, dense.hidden_size), prompt(13)
    s = Sampler(SamplingSettings(temperature=0.7, seed=5))
    drafts, q = DrafterProposer(drafter).propose(ctx, toks, s)
    logits = drafter.draft_block(ctx, toks[12])
    assert torch.allclose(q, (logits / 0.7).softmax(-1), atol=1e-6) and drafts.shape == (B - 1,)
    s.reseed(5)
    again, _ = DrafterProposer(drafter).propose(ctx, toks, s)
    assert torch.equal(drafts, again)
    assert torch.equal(DrafterProposer(drafter).propose(ctx, toks), logits.argmax(-1))  # greedy unchanged


class TopOneSelector:
    """A stand-in DFlash2 selector with the walk's signature: K candidates = top-K of the logits; greedy
    picks the top one, T > 0 samples softmax(candidate logits / T) (the sparse q). Records its calls."""

    def __init__(self, K=4):
        self.K, self.calls = K, []

    def walk(self, logits, hidden, anchor_token, temperature=0.0, generator=None):
        self.calls.append((hidden.shape, int(anchor_token), temperature, generator))
        vals, ids = logits.topk(self.K, dim=-1)
        if temperature == 0:
            probs = torch.zeros_like(vals)
            probs[:, 0] = 1
            return ids[:, 0], ids, probs
        probs = (vals / temperature).softmax(-1)
        pick = torch.multinomial(probs, 1, generator=generator)
        return ids.gather(1, pick)[:, 0], ids, probs


class DFlash2Like(torch.nn.Module):
    """A v1 drafter with a ``selector`` and ``draft_block(..., return_hidden=True)`` (hidden is a
    stand-in until the real DFlash2 drafter exists)."""

    def __init__(self, inner, selector):
        super().__init__()
        self.inner, self.selector, self.candidate_selector = inner, selector, selector
        self.block_size, self.fc = inner.block_size, inner.fc
        self.family, self.first_row, self.proposals = dflash2_family, 1, inner.block_size - 1
        self.d2t = None  # the whole vocabulary

    def fuse_context(self, hidden):
        return self.inner.fuse_context(hidden)

    def draft_block(self, *args, return_hidden=False, state=None, **kw):
        logits = self.inner.draft_block(*args, **kw)
        return (logits, logits.new_zeros(logits.shape[0], 3)) if return_hidden else logits


def test_dflash2_proposer_walks_the_selector(dense):
    inner = random_drafter(dense, seed=2)
    sel = TopOneSelector()
    prop = DrafterProposer(DFlash2Like(inner, sel))
    ctx, toks = torch.randn(10, 2, dense.hidden_size), prompt(11)
    logits = inner.draft_block(ctx, toks[10])
    assert torch.equal(prop.propose(ctx, toks), logits.argmax(-1))  # the greedy walk
    assert sel.calls[-1] == (torch.Size([B - 1, 3]), int(toks[10]), 0.0, None)
    s = Sampler(SamplingSettings(temperature=1.0, top_p=0.9, seed=4))
    prop.reset()
    drafts, q = prop.propose(ctx, toks, s)
    assert isinstance(q, SparseQ) and q.ids.shape == q.probs.shape == (B - 1, 4)
    assert torch.equal(q.ids, logits.topk(4, dim=-1).indices)
    assert (q.ids == drafts[:, None]).any(1).all()  # each draft is one of its row's candidates
    assert sel.calls[-1][2] == 1.0 and sel.calls[-1][3] is s.generator("cpu")
    p = prompt(9)
    runs = []
    for _ in range(2):
        s.reseed(11)
        runs.append(speculative_generate(dense, prop, p, 24, sampler=s))
    assert runs[0] == runs[1] and len(runs[0].tokens) == 24
    assert sum(runs[0].accepted) == 23 and all(1 <= k <= B for k in runs[0].accepted)
    ref = greedy_generate(dense, p, 24)
    assert speculative_generate(dense, prop, p, 24).tokens == ref  # greedy walk: plain greedy decoding


# -- end to end ---------------------------------------------------------------------------------------
class SamplingOracle:
    """Draws each draft from the target's own distribution p (the whole prefix, run token by token), and
    proposes q = p: every draft is accepted, so tau = B, whatever the draws."""

    def __init__(self, target, block=B):
        self.target, self.block_size = target, block

    def reset(self):
        pass

    def propose(self, context, tokens, sampler):
        seq, drafts, qs = tokens.clone(), [], []
        for _ in range(self.block_size - 1):
            logits, _, _ = self.target.forward_with_taps(seq[None])
            p = sampler.probs(logits[0, -1:])
            d = sampler.sample(p)
            drafts.append(d)
            qs.append(p)
            seq = torch.cat([seq, d])
        return torch.cat(drafts), torch.cat(qs)


def test_sampling_oracle_is_always_accepted_and_seed_reproduces(dense):
    p = prompt(8, 3)
    s = Sampler(SamplingSettings(temperature=0.8, top_k=50, top_p=0.9, seed=2))
    out = speculative_generate(dense, SamplingOracle(dense), p, 1 + 3 * B, sampler=s)
    assert out.accepted == [B] * 3
    # a random drafter, seeded: the same tokens again; another seed, other tokens
    drafter = random_drafter(dense, seed=4)
    outs = []
    for seed in (9, 9, 10):
        s.reseed(seed)
        outs.append(speculative_generate(dense, drafter, p, 20, sampler=s))
    assert outs[0] == outs[1] and outs[0].tokens != outs[2].tokens
    s.reseed(9)
    assert greedy_generate(dense, p, 20, sampler=s) != greedy_generate(dense, p, 20)  # plain sampling


def test_cli_reports_greedy_and_sampled_tau_with_settings(tmp_path, checkpoint):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": prompt(8, s).tolist()}) + "\n" for s in range(2)))
    args = ["eval", "--drafter", str(checkpoint), "--target", "configs/tiny.toml", "--prompts", str(prompts)]
    args += ["--max-new-tokens", "12", "--top-p", "0.9", "--top-k", "40", "--seed", "3"]
    res = CliRunner().invoke(
        main, [*args, "--temperature", "0,1", "--json", "--plot", str(tmp_path / "e.png")]
    )
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout.strip().splitlines()[-1])
    greedy, sampled = r["runs"]
    assert greedy["sampling"] == {
        "mode": "greedy",
        "temperature": 0.0,
        "top_p": None,
        "top_k": None,
        "seed": None,
    }
    assert sampled["sampling"] == {
        "mode": "sampled",
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 3,
        "draft_sampling": "filtered",
    }
    assert r["tau"] == greedy["tau"] and r["sampling"] == greedy["sampling"]  # the top level: the first run
    assert greedy["lossless"] == {"identical_prompts": 2, "prompts": 2} and "lossless" not in sampled
    assert 1.0 <= sampled["tau"] <= B and sampled["speculative"]["tokens"] == 24
    assert sampled["baseline"]["tokens"] == 24 and "greedy" not in sampled
    assert (tmp_path / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = CliRunner().invoke(main, [*args, "--temperature", "1", "--json"])
    r1 = json.loads(again.stdout.strip().splitlines()[-1])
    assert "runs" not in r1 and r1["sampling"] == sampled["sampling"]
    assert [x["tau"] for x in r1["per_prompt"]] == [x["tau"] for x in sampled["per_prompt"]]  # seeded
    text = CliRunner().invoke(main, [*args, "--temperature", "1", "--no-baseline"]).output
    assert "T=1, top-p 0.9, top-k 40, seed 3: tau " in text
    bad = CliRunner().invoke(main, [*args, "--temperature", "0,x"])
    assert bad.exit_code == 2 and "--temperature" in bad.output and "'x' is not a temperature" in bad.output


@pytest.mark.cuda
def test_cuda_bf16_sampled_speculative_decoding():
    from dflash_staged.config import TargetConfig
    from dflash_staged.model.target import load_target

    t = load_target(TargetConfig(model="tiny:qwen3", dtype="auto"), "cuda", layer_ids=[1, 4])
    drafter = random_drafter(t).to("cuda", torch.bfloat16)
    s = Sampler(SamplingSettings(temperature=1.0, top_p=0.95, top_k=20, seed=1))
    p, n = prompt(), 1 + 4 * B
    outs = []
    for _ in range(2):
        s.reseed(1)
        outs.append(speculative_generate(t, drafter, p, n, sampler=s))
    assert outs[0] == outs[1] and len(outs[0].tokens) == n and sum(outs[0].accepted) == n - 1
    assert any(k.startswith("cuda") for k in s._gens) and all(1 <= k <= B for k in outs[0].accepted)
    # bf16 block verification may round differently from the oracle's one-token forwards: not exact
    acc = speculative_generate(t, SamplingOracle(t), p, n, sampler=s).accepted
    assert sum(acc) / len(acc) >= B / 2


def test_a_v1_proposal_takes_the_targets_top_k_and_top_p_as_the_reference_draws_it():
    """The reference draws DFlash v1 drafts from the same transform as the target's (temperature, top-k,
    top-p); "temperature" keeps the temperature alone (issue 35, item 2)."""
    from dflash_staged.evaluate.sampling import Sampler, SamplingSettings, target_probs

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    s = Sampler(SamplingSettings(0.7, top_p=0.8, top_k=10, seed=1))
    drafts, q = s.propose(logits)
    torch.testing.assert_close(q, target_probs(logits, 0.7, 10, 0.8))
    assert all(q[i, d] > 0 for i, d in enumerate(drafts.tolist()))  # drawn from q: never a filtered token
    assert int((q > 0).sum(-1).max()) <= 10
    t = Sampler(SamplingSettings(0.7, top_p=0.8, top_k=10, seed=1, draft_sampling="temperature"))
    torch.testing.assert_close(t.propose(logits)[1], (logits / 0.7).softmax(-1))

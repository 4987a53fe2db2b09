"""dflash eval: speculative decoding is lossless, oracle/random drafters bound tau, the CLI reports."""

import json

import pytest
import torch
from click.testing import CliRunner

from dflash_staged.cli import main
from dflash_staged.config import TargetConfig
from dflash_staged.errors import DflashError
from dflash_staged.evaluate.prompts import load_prompts
from dflash_staged.evaluate.speculative import (
    DrafterProposer,
    acceptance_stats,
    greedy_generate,
    speculative_generate,
)
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.weights import save_drafter
from dflash_staged.model.target import load_target
from dflash_staged.model.target.tiny import MASK

B = 8


def tiny_target(kind="qwen3", layer_ids=(1, 4)):
    return load_target(TargetConfig(model=f"tiny:{kind}", dtype="float32"), "cpu", layer_ids=list(layer_ids))


def random_drafter(target, seed=0, block=B):
    dcfg = DraftModelConfig(
        hidden_size=target.hidden_size,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=target.vocab_size,
        block_size=block,
        num_target_layers=target.num_layers,
        target_layer_ids=list(target.layer_ids),
        mask_token_id=MASK,
        dtype="float32",
    )
    torch.manual_seed(seed)
    m = target.model
    return DFlashDrafter(dcfg, m.get_input_embeddings().weight, m.get_output_embeddings().weight).eval()


class Oracle:
    """Proposes the target's own greedy continuation (checks it is handed the right anchor)."""

    def __init__(self, reference, block=B, wrong_at=None, strict=True):
        self.ref, self.block_size, self.wrong_at, self.calls = list(reference), block, wrong_at, []
        self.strict = strict

    def reset(self):
        self.calls.clear()

    def propose(self, context, tokens):
        S = context.shape[0]
        assert tokens.shape[0] == S + 1 and (
            tokens.tolist() == self.ref[: S + 1] or not self.strict
        )  # anchor = last
        self.calls.append(S)
        out = [self.ref[i] if i < len(self.ref) else 0 for i in range(S + 1, S + self.block_size)]
        if self.wrong_at is not None:
            out[self.wrong_at] = (out[self.wrong_at] + 1) % 2048
        return torch.tensor(out)


def prompt(n=12, seed=0):
    return torch.randint(4, 2048, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def dense():
    return tiny_target()


def test_random_drafter_is_lossless_and_tau_near_one(dense):
    drafter = random_drafter(dense)
    for seed in range(3):
        p = prompt(10 + 3 * seed, seed)
        ref = greedy_generate(dense, p, 40)
        out = speculative_generate(dense, drafter, p, 40)
        assert out.tokens == ref
        assert sum(out.accepted) == len(ref) - 1  # every token after the prefill one is committed by a step
        assert all(1 <= k <= B for k in out.accepted)
    st = acceptance_stats(out.accepted, B)
    assert 1.0 <= st["tau"] < 1.2


def test_no_drafter_gives_greedy_with_tau_one(dense):
    p = prompt()
    out = speculative_generate(dense, None, p, 17)
    assert out.tokens == greedy_generate(dense, p, 17)
    assert out.accepted == [1] * 16


def test_oracle_gets_tau_equal_block_size(dense):
    p = prompt()
    n = 1 + 6 * B  # the prefill token, then six full blocks
    ref = p.tolist() + greedy_generate(dense, p, n)
    oracle = Oracle(ref)
    out = speculative_generate(dense, oracle, p, n)
    assert out.tokens == ref[len(p) :]
    assert out.accepted == [B] * 6
    assert acceptance_stats(out.accepted, B)["tau"] == B
    assert oracle.calls == [len(p) + i * B for i in range(6)]  # context = all positions before the anchor


def test_partly_wrong_oracle_and_short_last_block(dense):
    p = prompt()
    ref = p.tolist() + greedy_generate(dense, p, 32)
    out = speculative_generate(dense, Oracle(ref, wrong_at=3), p, 32)  # draft 4 is always wrong
    assert out.tokens == ref[len(p) :]
    assert out.accepted == [4] * 7 + [3]  # 3 drafts + the bonus; the last block is cut to the 3 tokens left
    st = acceptance_stats(out.accepted, B)
    assert st["per_position_acceptance"] == [1.0, 1.0, 7 / 8, 0.0, 0.0, 0.0, 0.0]
    assert st["accept_length_histogram"] == [0, 0, 1, 7, 0, 0, 0, 0]
    assert st["tau"] == pytest.approx(1 + sum(st["per_position_acceptance"])) == 31 / 8


def test_stop_token_ends_generation(dense):
    p = prompt()
    ref = greedy_generate(dense, p, 30)
    stop = ref[9]
    first = ref.index(stop)
    out = speculative_generate(dense, Oracle(p.tolist() + ref), p, 30, stop_token_ids=[stop])
    assert out.tokens == ref[: first + 1] == greedy_generate(dense, p, 30, [stop])


def test_drafter_proposer_matches_draft_block(dense):
    drafter = random_drafter(dense, seed=1)
    prop = DrafterProposer(drafter)
    ctx = torch.randn(20, 2, dense.hidden_size)
    toks = prompt(21)
    prop.reset()
    prop.propose(ctx[:11], toks[:12])  # builds the fused cache incrementally
    got = prop.propose(ctx, toks)
    want = drafter.draft_block(ctx, toks[20]).argmax(-1)
    assert torch.equal(got, want)


class Recording:
    """A proposer that records every draft it hands out."""

    def __init__(self, inner):
        self.inner, self.block_size, self.drafts, self.contexts = inner, inner.block_size, [], []

    def reset(self):
        self.inner.reset()

    def propose(self, context, tokens):
        self.contexts.append(context.shape[0])
        self.drafts.append(self.inner.propose(context, tokens).clone())
        return self.drafts[-1]


@pytest.mark.parametrize("layers", [None, ["sliding_attention", "full_attention"]])
def test_drafter_kv_cache_drafts_as_recomputing_and_stays_lossless(dense, layers):
    import dataclasses

    t = dense
    drafter = random_drafter(t, seed=3)
    if layers:
        c = dataclasses.replace(drafter.dcfg, num_hidden_layers=2, layer_types=layers, sliding_window=5)
        torch.manual_seed(3)
        m = t.model
        drafter = DFlashDrafter(c, m.get_input_embeddings().weight, m.get_output_embeddings().weight).eval()
    for seed in range(2):
        p = prompt(9 + 5 * seed, seed)
        ref = greedy_generate(t, p, 30)
        cached, fresh = (
            Recording(DrafterProposer(drafter)),
            Recording(DrafterProposer(drafter, kv_cache=False)),
        )
        out_c = speculative_generate(t, cached, p, 30)
        out_f = speculative_generate(t, fresh, p, 30)
        assert out_c.tokens == out_f.tokens == ref and out_c.accepted == out_f.accepted
        assert len(cached.drafts) == len(fresh.drafts) > 3
        assert all(torch.equal(a, b) for a, b in zip(cached.drafts, fresh.drafts))
        assert cached.inner._cache.length == cached.contexts[-1]  # the committed positions, no block


def test_hybrid_target_is_lossless():
    t = tiny_target("qwen3_5", layer_ids=(1, 5))
    assert not t.supports_crop
    p = prompt(9)
    ref = greedy_generate(t, p, 20)
    assert speculative_generate(t, random_drafter(t), p, 20).tokens == ref
    out = speculative_generate(t, Oracle(p.tolist() + ref, block=4, wrong_at=1), p, 20)
    assert out.tokens == ref and out.accepted[0] == 2  # a rejected draft: the cache copy re-runs 2 tokens


# -- prompts and the command ---------------------------------------------------------------------
def test_load_prompts_messages_and_ids(tmp_path):
    from dflash_staged.model.target.tiny import build_tiny_tokenizer

    f = tmp_path / "p.jsonl"
    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the answer"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n\n" + json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    tok = build_tiny_tokenizer()
    got = load_prompts(f, lambda: tok, 2048)
    want = tok(
        tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert got == [(1, want), (3, [5, 6, 7])]
    assert len(load_prompts(f, lambda: tok, 2048, limit=1)) == 1
    # ShareGPT conversations (from/value, an optional system), as plan and regenerate read them
    g = tmp_path / "sharegpt.jsonl"
    turns = [{"from": "human", "value": m["content"]} for m in msgs[:1]] + [{"from": "gpt", "value": "ref"}]
    g.write_text(json.dumps({"conversations": turns}) + "\n")
    assert load_prompts(g, lambda: tok, 2048) == [(1, want)]


@pytest.mark.parametrize(
    "line,needle",
    [
        ("not json", ":1: line: invalid JSON"),
        ('{"text": "x"}', ":1: line: no messages, conversations or input_ids"),
        ('{"input_ids": [1, "a"]}', ":1: input_ids: expected a non-empty list"),
        ('{"input_ids": [1, 99999]}', ":1: input_ids: token id 99999 is outside"),
        ('{"messages": [{"role": "user"}]}', ":1: messages[0].content: missing field"),
        ('{"conversations": [{"from": "robot", "value": "x"}]}', ":1: conversations[0].from: unknown role"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', ":1: messages: only assistant turns"),
    ],
)
def test_bad_prompt_lines(tmp_path, line, needle):
    from dflash_staged.model.target.tiny import build_tiny_tokenizer

    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(DflashError, match=None) as e:
        load_prompts(f, build_tiny_tokenizer, 2048)
    assert needle in str(e.value) and str(f) in str(e.value)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, dense):
    d = tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000004"
    save_drafter(random_drafter(tiny_target(layer_ids=(1, 3))), d)
    return d


def test_cli_json_plot_out(tmp_path, checkpoint):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": prompt(8, s).tolist()}) + "\n" for s in range(2)))
    res = CliRunner().invoke(
        main,
        [
            "eval",
            "--drafter",
            str(checkpoint.parent.parent),
            "--target",
            "configs/tiny.toml",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--json",
            "--plot",
            str(tmp_path / "e.png"),
            "--out",
            str(tmp_path / "e.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r == json.loads((tmp_path / "e.json").read_text())
    assert 1.0 <= r["tau"] <= B and r["prompts"] == 2 and r["drafter"] == str(checkpoint)
    assert r["tau_pooled"] == r["tau"]
    assert r["tau_per_prompt_mean"] == pytest.approx(sum(x["tau"] for x in r["per_prompt"]) / 2, abs=1e-4)
    assert r["lossless"] == {"identical_prompts": 2, "prompts": 2}
    assert r["target_layer_ids"] == [1, 3] and len(r["per_position_acceptance"]) == B - 1
    assert sum(r["accept_length_histogram"]) == r["steps"]
    assert r["speculative"]["tokens"] == r["greedy"]["tokens"] == 24 and r["greedy"]["tokens_per_s"] > 0
    assert (tmp_path / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_are_one_line(tmp_path, checkpoint):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [4, 5]}\n{"input_ids": []}\n')
    r = CliRunner().invoke(
        main, ["eval", "--drafter", str(checkpoint), "--target", "tiny:qwen3", "--prompts", str(bad)]
    )
    assert r.exit_code == 1 and r.output.count("\n") == 1
    assert r.output.startswith("error: ") and f"{bad}:2: input_ids" in r.output
    r = CliRunner().invoke(
        main, ["eval", "--drafter", str(tmp_path), "--target", "tiny:qwen3", "--prompts", str(bad)]
    )
    assert r.exit_code == 1 and "neither a drafter checkpoint" in r.output
    r = CliRunner().invoke(
        main, ["eval", "--drafter", str(checkpoint), "--target", "tiny:qwen3_5", "--prompts", str(bad)]
    )
    assert r.exit_code == 1 and "has 8 layers" in r.output


@pytest.mark.cuda
def test_cuda_bf16_speculative_decoding():
    t = load_target(TargetConfig(model="tiny:qwen3", dtype="auto"), "cuda", layer_ids=[1, 4])
    assert t.dtype == torch.bfloat16
    p = prompt()
    n = 1 + 4 * B
    ref = greedy_generate(t, p, n)
    assert speculative_generate(t, None, p, n).tokens == ref  # one-token steps: the very same computation
    out = speculative_generate(t, random_drafter(t).to("cuda", torch.bfloat16), p, n)
    assert len(out.tokens) == n and sum(out.accepted) == n - 1 and all(1 <= k <= B for k in out.accepted)
    # bf16 block verification may round differently from one-token steps, so the oracle is not asked to be
    # exact
    oracle = Oracle(p.tolist() + ref, strict=False)
    assert acceptance_stats(speculative_generate(t, oracle, p, n).accepted, B)["tau"] >= B / 2


class SizedOracle(Oracle):
    """An Oracle that, as DrafterProposer, drafts a shorter block when asked (records the sizes)."""

    sized = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.sizes = []

    def propose(self, context, tokens, size=None):
        self.sizes.append(size)
        out = super().propose(context, tokens)
        return out[: (size or self.block_size) - 1]


def test_the_last_block_is_drafted_short_and_its_bonus_dropped_as_the_reference_does(dense):
    """With r new tokens to go the reference verifies the anchor and min(B-1, r) drafts, runs the
    drafter on that shorter block, and commits at most r tokens: an accepted block's bonus past
    max_new_tokens is discarded (issue 35, item 1)."""
    p = prompt()
    n = 1 + 2 * B + 3  # the prefill token, two full blocks, then 3 tokens to go
    ref = p.tolist() + greedy_generate(dense, p, n + B)
    oracle = SizedOracle(ref)
    out = speculative_generate(dense, oracle, p, n)
    assert out.tokens == ref[len(p) : len(p) + n]
    assert out.accepted == [B, B, 3]  # 3 drafts accepted, the bonus dropped
    assert oracle.sizes == [None, None, 4]  # the anchor and 3 drafts: the last block drafted short
    plain = Oracle(ref)
    assert speculative_generate(dense, plain, p, n).accepted == [B, B, 3]  # a proposer without sizes: cut


def test_the_time_budget_starts_no_prompt_that_would_end_past_it(dense, monkeypatch):
    """A fake clock: each speculative decode takes 10 s. With 25 s, prompts 1 and 2 run (the second ends at
    20 s), and the third, which would end at 30 s at the mean so far, does not start (it would, at 20 s,
    under a rule that only asks whether the deadline has passed)."""
    import types

    from dflash_staged.evaluate import report
    from dflash_staged.evaluate.sampling import SamplingSettings

    clock = [0.0]
    monkeypatch.setattr(report, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real = report.speculative_generate

    def slow(*a, **kw):
        clock[0] += 10.0
        return real(*a, **kw)

    monkeypatch.setattr(report, "speculative_generate", slow)
    prompts = [(i + 1, prompt(8, seed=i)) for i in range(4)]
    prop = DrafterProposer(random_drafter(dense))
    run = report._decode_all(dense, prop, prompts, 8, [], SamplingSettings(), False, True, deadline=25.0)
    assert len(run["per_prompt"]) == 2, run["per_prompt"]

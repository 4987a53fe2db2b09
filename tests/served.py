"""A tiny Qwen3 target and fitted drafters on disk, for the tests that serve them in a real llama-server.

* :func:`save_served_target`: the planted tiny target (``tests/planted.py``: ``tiny:qwen3`` with its
  logits sharpened) saved as an ordinary Hugging Face directory, with a SentencePiece ``tokenizer.model``
  trained here on the tiny corpus (ids 0..3 = pad, bos, eos, unk; the rest of the 2,048 rows unused).
  llama.cpp's converter reads a Qwen3 target's vocabulary from ``tokenizer.model`` when there is one;
  the tiny byte-level BPE tokenizer's pre-tokenizer is one it does not know. The prompts are token ids,
  so the tokenizer's pieces matter only to the converter; eos (2) ends a generation on both sides.
* :func:`fitted_checkpoint`: a drafter of a family, started from the target's top layers and trained
  (the project's own objective, ``fit_to_target``) on the target's greedy continuations of the prompts,
  saved with ``save_drafter`` in float32; with ``draft_vocab`` > 0, over a draft vocabulary of that many
  rows chosen (``vocab.choose``) from the tokens of those continuations and of the prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_staged.config import TargetConfig, load_config
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.weights import save_drafter
from dflash_staged.model.target import load_target
from dflash_staged.model.target.tiny import MASK, VOCAB, _corpus

from planted import fit_to_target, greedy_continuation, planted_target

LAYERS = [1, 3]
BLOCKS = {"dflash": 8, "dflash2": 8, "dspark": 7}


def save_served_target(dir: Path) -> Path:
    import sentencepiece as spm

    target = planted_target(LAYERS)
    target.model.save_pretrained(dir)
    cfg = json.loads((dir / "config.json").read_text())
    assert cfg["vocab_size"] == VOCAB
    corpus = dir / "corpus.txt"
    corpus.write_text("\n".join(_corpus()))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(dir / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    corpus.unlink()
    (dir / "tokenizer.vocab").unlink(missing_ok=True)
    return dir


def served_target(dir: Path):
    """Our side's view of the saved target (the same weights llama.cpp converts)."""
    return load_target(TargetConfig(model=str(dir)), "cpu", layer_ids=LAYERS)


def prompts(n: int, length: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 400, (length,), generator=g) for _ in range(n)]


def fitted_checkpoint(
    out: Path, family: str, target, target_dir: Path, ps, new_tokens: int, draft_vocab: int = 0
) -> Path:
    from dflash_staged.model.drafters.init import init_from_target
    from dflash_staged.model.target.weights import load_embed_and_head

    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype, cfg.drafter.architecture = "float32", family
    cfg.drafter.block_size, cfg.drafter.intermediate_size = BLOCKS[family], 256
    fit = {}
    if family == "dflash2":
        cfg.drafter.conv_group_size, cfg.drafter.selector_rank, cfg.drafter.selector_top_k = 16, 16, 8
    if family == "dspark":
        cfg.drafter.options = {"markov_rank": 16, "markov_head_type": "vanilla", "confidence_head": False}
        fit = {"options": {"ce_weight": 1.0, "l1_weight": 0.0}}
    tcfg = TargetConfig(model=str(target_dir))
    embed, head = load_embed_and_head(tcfg)
    ids = None
    if draft_vocab:
        ids = draft_vocab_ids(target, ps, new_tokens + BLOCKS[family], draft_vocab)
        cfg.drafter.draft_vocab_size = draft_vocab
    torch.manual_seed(0)
    d = DFlashDrafter(DraftModelConfig.from_config(cfg, 128, VOCAB, 6, LAYERS, MASK), embed, head, ids)
    init_from_target(d, tcfg)
    fit_to_target(d, target, ps, new_tokens, steps=100, lr=5e-3 if family == "dspark" else 3e-3, **fit)
    return save_drafter(d, out)


def draft_vocab_ids(target, ps, new_tokens: int, n: int) -> torch.Tensor:
    """The ``n`` draft-vocabulary ids (sorted target ids) chosen from every token of the prompts and of
    the target's greedy continuations of them (``new_tokens`` each: what ``fit_to_target`` trains on);
    every continuation token is inside, so a served decode of these prompts never needs one outside."""
    from dflash_staged.model.drafters.vocab import choose, loss_token_counts

    seqs = [greedy_continuation(target, p, new_tokens) for p in ps]
    tokens = torch.cat(seqs).numpy()
    vocab = choose(loss_token_counts(tokens, tokens >= 0, VOCAB), n)
    assert vocab.coverage == 1.0, f"{n} draft ids leave out {vocab.loss_tokens - vocab.covered} tokens"
    return torch.from_numpy(vocab.ids)


def step_oracle(ckpt: Path, target, prompt: torch.Tensor, out: list[int], eps: float = 0.0, seed: int = 0):
    """``commit(p)``: the tokens a greedy verify step whose anchor is output token ``p`` commits with the
    checkpoint's drafter, computed in this process from the target's taps of ``prompt + out`` (the step's
    drafts against the greedy output, which is the target's argmax there), however the decode that is
    compared reached ``p``. ``eps`` > 0 multiplies every drafter weight by ``1 + eps * N(0, 1)`` (seeded):
    a step whose outcome such a perturbation changes hangs on a near tie of the drafter's."""
    from dflash_staged.evaluate.speculative import DrafterProposer
    from dflash_staged.model.drafters.weights import load_drafter

    embed = target.model.get_input_embeddings().weight
    head = target.model.get_output_embeddings().weight
    drafter = load_drafter(ckpt, embed, head, device="cpu", dtype=target.dtype)
    if eps:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for w in drafter.parameters():
                if w.data_ptr() not in (embed.data_ptr(), head.data_ptr()):  # the target's own stay exact
                    w.mul_(1 + eps * torch.randn(w.shape, generator=g))
    proposer = DrafterProposer(drafter, kv_cache=False)
    full = torch.cat([prompt, torch.tensor(out)])
    with torch.inference_mode():
        _, taps, _ = target.forward_with_taps(full[None])
    P = prompt.numel()

    def commit(p: int) -> int:
        s = P + p
        with torch.inference_mode():
            drafts = proposer.propose(taps[0, :s], full[: s + 1])
        after = full[s + 1 : s + 1 + drafts.numel()]
        a = int((drafts[: after.numel()] == after).long().cumprod(0).sum())
        return min(a + 1, len(out) - 1 - p)

    return commit


def judge_steps(ckpt: Path, target, prompt: torch.Tensor, out: list[int], committed: list[int], draws=4):
    """Each verify step of a served greedy decode of ``prompt`` (``committed``: the tokens of each step,
    the output ``out``), its final step left out, against :func:`step_oracle`: (steps that agree, steps
    that differ on a near tie, steps that differ with a wide margin). A near tie is a step whose outcome a
    perturbation of the drafter's weights by 1e-3 of their size changes in one of ``draws`` seeded draws:
    two orders of magnitude above the disagreement of two f32 kernels (llama.cpp's and torch's, about
    1e-5 of a logit's scale), so a difference there is rounding, and one elsewhere is a bug."""
    exact = step_oracle(ckpt, target, prompt, out)
    shaken = [step_oracle(ckpt, target, prompt, out, eps=1e-3, seed=k) for k in range(draws)]
    same, tie, wide, p = [], [], [], 0
    for c in committed[:-1]:
        want = exact(p)
        if c == want:
            same.append(p)
        elif any(f(p) != want for f in shaken):
            tie.append(p)
        else:
            wide.append((p, c, want))
        p += c
    return same, tie, wide

"""``dflash eval``: :func:`run_eval` loads the drafter checkpoint (or a run directory's newest), the
target it names (tapped layers from the drafter's ``config.json``) and the prompts
(:mod:`dflash_staged.evaluate.prompts`), decodes every prompt speculatively
(:mod:`dflash_staged.evaluate.speculative`, whose docstring is the contract) and with plain
decoding, and reports tau, per-position rates, the accepted-length histogram, tokens/s
and (greedy) whether the outputs are identical.

Sampling settings (:class:`~dflash_staged.evaluate.sampling.SamplingSettings`): each setting is one
decoding of every prompt, a *run*; ``sampling`` in a run states it (``mode`` ``greedy`` at
temperature 0, else ``sampled`` with ``temperature``, ``top_p``, ``top_k``, ``seed``). A sampled
run draws each prompt from its own generator (seeded from ``seed`` and the prompt's line, so a
prompt's draws do not depend on which prompts run with it); its baseline is plain sampling at the
same settings, compared for tokens/s only (sampled outputs are not expected to be identical; the
rejection sampler is lossless by construction and tested so). With several settings the report's
top level is the first run and ``runs`` lists every run (``dflash eval --temperature 0,1``: greedy
and T=1 tau from one load of the models).

Each run's ``block_size`` is the drafter's (its ``config.json``'s) and ``drafts_per_step`` the drafts
one verify step checks: ``block_size - 1`` for DFlash's block (the anchor, then the drafts), all
``block_size`` for DSpark's (every row a draft, as DeepSpec and vLLM count it); tau is at most
``drafts_per_step + 1``, and the histogram has that many bins.

Each run's ``per_prompt`` gives, for each prompt, its line, lengths, tau and timings, the new tokens
(``tokens``) and the tokens each verify step committed (``accepted``): ``dflash serve eval --compare``
holds a served drafter to them step by step.

Two taus, each named (both count the bonus token, as the reference does):

* ``tau_per_prompt_mean``: the mean over prompts of each prompt's mean committed tokens per
  verify step, the "Average Acceptance length" the reference ``dflash.benchmark`` prints;
* ``tau_pooled`` (also ``tau``): all committed tokens over all verify steps, which weighs long
  generations more.

Comparing with published figures: the reference benchmark (z-lab ``dflash.benchmark``)
decodes greedily by default, or at the sampling settings it is given (the DFlash2 release quotes
``--temperature 1 --top-p 0.95 --top-k 20``), with ``--max-new-tokens 2048`` (our default), the
target's chat template and benchmark prompts (gsm8k, math500, humaneval, mbpp, mt-bench), on GPU
in bf16, and prints the per-prompt mean. A figure from it compares with ``tau_per_prompt_mean``
here only for the same target, drafter, prompts, length and sampling settings: tau depends on all
of them, on the prompts most, and a shorter ``--max-new-tokens`` measures only the start of each
answer. Here the last block is
shortened so no more than ``--max-new-tokens`` are committed and a stop token ends the count,
where the reference counts the whole last block: at most one step per prompt differs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from dflash_staged.errors import DflashError
from dflash_staged.evaluate.prompts import chat_line, chat_options, load_prompts
from dflash_staged.evaluate.sampling import Sampler, SamplingSettings, label_of
from dflash_staged.evaluate.speculative import (
    DrafterProposer,
    acceptance_stats,
    greedy_generate,
    speculative_generate,
)


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"eval: {msg}", file=sys.stderr, flush=True)


DEFAULT_MAX_NEW_TOKENS = 2048  # the reference benchmark's default


def run_eval(
    drafter_path,
    target_spec: str,
    prompts_path,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    device: str | None = None,
    limit: int | None = None,
    baseline: bool = True,
    quiet: bool = False,
    chat_template_kwargs: dict | None = None,
    chat_template: str | Path | None = None,
    sampling: SamplingSettings | list[SamplingSettings] | None = None,
    time_budget_s: float | None = None,
    walk_options: dict | None = None,
) -> dict:
    """Speculative decoding of every prompt (and plain greedy, unless ``baseline=False``): the report.

    Prompts are rendered with the chat options of :func:`~dflash_staged.evaluate.prompts.chat_options`
    (the checkpoint's record, updated by `chat_template_kwargs`, template replaced by `chat_template`).
    ``sampling``: one setting or several (default greedy); each is one decoding of every prompt, and
    the report's top level is the first one's, with ``runs`` listing all of them when there are several.
    ``time_budget_s``: no prompt starts that would end past that much time (from the models' loading
    on), at the mean time of the prompts so far; each setting gets an equal share, and at least one
    prompt: the report then says how many ran.
    ``walk_options``: the drafter family's decoding options (DSpark: ``confidence_threshold``).
    """
    from dflash_staged.config import target_from_spec
    from dflash_staged.model.drafters.weights import load_drafter, read_drafter_config
    from dflash_staged.model.target import load_target, load_tokenizer, stop_token_ids
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.preflight import device as preflight_device
    from dflash_staged.train.checkpoint import resolve_checkpoint

    preflight_device(device)  # before any prompt is read or model loaded
    ckpt = resolve_checkpoint(drafter_path, "--drafter")
    dcfg = read_drafter_config(ckpt)
    tcfg = target_from_spec(target_spec)
    num_layers, hidden, vocab = target_dims(tcfg)
    if dcfg.num_target_layers != num_layers or max(dcfg.target_layer_ids) >= num_layers:
        raise DflashError(
            f"{ckpt}/config.json: the drafter taps layers {dcfg.target_layer_ids} of a "
            f"{dcfg.num_target_layers}-layer target, but {tcfg.model} has {num_layers} layers; "
            "evaluate it with the target it was trained on"
        )
    if dcfg.hidden_size != hidden:
        raise DflashError(
            f"{ckpt}/config.json: hidden_size {dcfg.hidden_size} differs from the target's "
            f"{hidden} ({tcfg.model}); evaluate it with the target it was trained on"
        )
    tok_cache: list = []

    def tokenizer():
        if not tok_cache:
            tok_cache.append(load_tokenizer(tcfg))
        return tok_cache[0]

    chat, chat_source = chat_options(ckpt, target_spec, chat_template_kwargs, chat_template)
    prompts = load_prompts(
        prompts_path, tokenizer, vocab, limit, chat
    )  # bad lines fail before the model loads
    _say(chat_line(chat.template_path, chat.kwargs, chat_source), quiet)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    target = load_target(tcfg, device, layer_ids=list(dcfg.target_layer_ids))
    embed = target.model.get_input_embeddings().weight
    head = target.model.get_output_embeddings().weight
    drafter = load_drafter(ckpt, embed, head, device=device, dtype=target.dtype)
    _say(f"loaded target {tcfg.model} and drafter {ckpt} in {time.perf_counter() - t0:.1f} s", quiet)
    stop = stop_token_ids(target.model, tok_cache[0] if tok_cache else None)
    proposer = DrafterProposer(drafter, **(walk_options or {}))
    greedy_generate(target, prompts[0][1], 2, stop)  # warm-up: first-call overheads stay out of the timings
    settings = _settings_list(sampling)
    runs = []
    for i, s in enumerate(settings):
        deadline = None
        if time_budget_s:  # this setting's share of what is left
            deadline = time.perf_counter() + (time_budget_s - (time.perf_counter() - t0)) / (
                len(settings) - i
            )
        runs.append(
            _decode_all(target, proposer, prompts, max_new_tokens, stop, s, baseline, quiet, deadline)
        )
    report = dict(runs[0])
    if len(runs) > 1:
        report["runs"] = runs
    report.update(
        drafter=str(ckpt),
        target=tcfg.model,
        target_layer_ids=list(dcfg.target_layer_ids),
        prompts_file=str(prompts_path),
        device=str(device),
        dtype=str(target.dtype).replace("torch.", ""),
        stop_token_ids=stop,
        chat={"kwargs": chat.kwargs, "template": chat.template_path or None, "from": chat_source},
    )
    return report


def _settings_list(sampling) -> list[SamplingSettings]:
    if sampling is None:
        return [SamplingSettings()]
    out = [sampling] if isinstance(sampling, SamplingSettings) else list(sampling)
    if not out:
        raise DflashError("--temperature: give at least one temperature (0 = greedy)")
    return out


def prompt_seed(seed: int, line: int) -> int:
    """The generator seed of one prompt: its own stream, the same whichever prompts run with it."""
    return (int(seed) * 1_000_003 + int(line)) % (2**63)


def _decode_all(
    target, proposer, prompts, max_new_tokens, stop, settings, baseline, quiet, deadline=None
) -> dict:
    """Every prompt speculatively (and plainly, with ``baseline``) at one sampling setting: its run. With
    ``deadline`` (``time.perf_counter()``), a prompt starts only if it would end by then at the mean time
    of the prompts so far (the first always runs), so the budget holds on a host that slows down."""
    block = proposer.block_size
    spec, plain = Sampler(settings), Sampler(settings)
    accepted_all: list[int] = []
    verified_all: list[int] = []
    spec_tok = spec_s = base_tok = base_s = 0.0
    identical = 0
    per_prompt = []
    prompt_taus: list[float] = []
    label = settings.label()
    asked = len(prompts)
    t_loop = time.perf_counter()
    for i, (line, ids) in enumerate(prompts):
        now = time.perf_counter()
        if i and deadline is not None and now + (now - t_loop) / i > deadline:
            _say(f"{label}: time budget spent after {i} of {asked} prompts", quiet)
            prompts = prompts[:i]
            break
        spec.reseed(prompt_seed(settings.seed, line))
        plain.reseed(prompt_seed(settings.seed, line))
        t = time.perf_counter()
        out = speculative_generate(target, proposer, ids, max_new_tokens, stop, sampler=spec)
        dt = time.perf_counter() - t
        spec_tok, spec_s = spec_tok + len(out.tokens), spec_s + dt
        accepted_all += out.accepted
        verified_all += out.verified
        if out.accepted:  # a prompt that stopped at its first token has no verify step
            prompt_taus.append(sum(out.accepted) / len(out.accepted))
        rec = {
            "line": line,
            "prompt_tokens": len(ids),
            "new_tokens": len(out.tokens),
            "tau": round(sum(out.accepted) / max(1, len(out.accepted)), 4),
            "spec_s": round(dt, 3),
            "accepted": list(out.accepted),
            "tokens": list(out.tokens),
        }
        if baseline:
            t = time.perf_counter()
            ref = greedy_generate(target, ids, max_new_tokens, stop, sampler=plain)
            dt = time.perf_counter() - t
            base_tok, base_s = base_tok + len(ref), base_s + dt
            rec.update(baseline_s=round(dt, 3))
            if settings.greedy:
                rec.update(greedy_s=round(dt, 3), identical=ref == out.tokens)
                identical += ref == out.tokens
        per_prompt.append(rec)
        _say(
            f"{label}: prompt {i + 1}/{len(prompts)} (line {line}): {len(out.tokens)} tokens, "
            f"tau {rec['tau']:.2f}" + (f", same as greedy: {rec['identical']}" if "identical" in rec else ""),
            quiet,
        )
    run = {
        **acceptance_stats(accepted_all, block),
        "sampling": settings.describe(),
        "block_size": getattr(proposer, "drafter_block_size", block),
        "drafts_per_step": block - 1,
        "architecture": proposer.family.name if hasattr(proposer, "family") else None,
        "verified_per_step": sum(verified_all) / len(verified_all) if verified_all else 0.0,
        "tau_per_prompt_mean": sum(prompt_taus) / len(prompt_taus) if prompt_taus else 0.0,
        "prompts": len(prompts),
        "prompts_asked": asked,
        "max_new_tokens": max_new_tokens,
        "speculative": {
            "tokens": int(spec_tok),
            "seconds": round(spec_s, 3),
            "tokens_per_s": round(spec_tok / max(spec_s, 1e-9), 2),
        },
    }
    if baseline:
        run["baseline"] = {
            "tokens": int(base_tok),
            "seconds": round(base_s, 3),
            "tokens_per_s": round(base_tok / max(base_s, 1e-9), 2),
        }
        run["speedup"] = round(base_s / max(spec_s, 1e-9) * spec_tok / max(base_tok, 1), 3)
        if settings.greedy:
            run["greedy"] = run["baseline"]
            run["lossless"] = {"identical_prompts": int(identical), "prompts": len(prompts)}
    run["per_prompt"] = per_prompt
    return run


def _format_run(r: dict) -> list[str]:
    label = label_of(r.get("sampling"))
    lines = [
        f"{label}: tau {r['tau_per_prompt_mean']:.3f} (mean over prompts of each prompt's mean, as the "
        f"reference reports it); pooled over all steps {r['tau_pooled']:.3f} (block {r['block_size']}: "
        f"{r['drafts_per_step']} drafts a step, "
        f"{r['steps']} verify steps, {r['prompts']} prompts, max {r['max_new_tokens']} new tokens; "
        f"{r.get('verified_per_step', 0):.2f} tokens verified a step)",
        "per-position acceptance: " + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]),
        "accepted-length histogram (1..B): " + " ".join(str(x) for x in r["accept_length_histogram"]),
        f"speculative: {r['speculative']['tokens']} tokens in {r['speculative']['seconds']:.1f} s "
        f"({r['speculative']['tokens_per_s']:.1f} tok/s)",
    ]
    if "lossless" in r:
        g, ll = r["baseline"], r["lossless"]
        lines.append(
            f"plain greedy: {g['tokens']} tokens in {g['seconds']:.1f} s ({g['tokens_per_s']:.1f} tok/s); "
            f"speedup {r['speedup']:.2f}x; identical outputs {ll['identical_prompts']}/{ll['prompts']}"
        )
    elif "baseline" in r:
        g = r["baseline"]
        lines.append(
            f"plain sampling: {g['tokens']} tokens in {g['seconds']:.1f} s ({g['tokens_per_s']:.1f} tok/s); "
            f"speedup {r['speedup']:.2f}x (outputs are sampled: lossless by rejection sampling, not compared)"
        )
    return lines


def format_report(r: dict) -> str:
    """A few human-readable lines: per sampling setting, then the chat template."""
    lines = [x for run in r.get("runs") or [r] for x in _format_run(run)]
    if r.get("chat"):
        lines.append(chat_line(r["chat"]["template"], r["chat"]["kwargs"] or {}, r["chat"]["from"]))
    return "\n".join(lines)

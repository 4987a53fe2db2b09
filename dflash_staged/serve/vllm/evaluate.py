"""``dflash serve eval --engine vllm``: the drafter in the real vLLM, its tau, its speed, lossless or not.

Contract:

* **Same prompts as ``dflash eval``**: the prompts file, the chat options (the checkpoint's record,
  :func:`~dflash_staged.evaluate.prompts.chat_options`) and ``max_new_tokens``; the rendered token ids
  go to vLLM as they are, and generation stops at the target's stop ids (its ``generation_config.json``
  and ``config.json`` ``eos_token_id``, and the tokenizer's when it was loaded), as in ``dflash eval``.
* **Runs**, one engine at a time (:mod:`.engine`): vLLM with the family's ``speculative_config``
  (:func:`.report.speculative_config`), first, so a refused drafter costs no plain run; then plain
  greedy vLLM (the baseline, unless ``baseline=False``). The run's record: tau pooled over every
  verify step (from the per-request metrics) and vLLM's own counter tau (``1 + accepted / drafts``,
  and the per-position acceptance), decode tokens/s with and without the drafter, ``lossless``
  (greedy outputs equal to the plain engine's) and, with ``compare`` (a ``dflash eval`` report), the
  per-step agreement (:func:`~dflash_staged.serve.report.agreement`) and ``dflash eval``'s tau beside
  vLLM's.
* **Files** under ``out``: ``serve_eval.json`` and ``logs/vllm-plain.log``, ``logs/vllm-spec.log`` (each
  engine's whole output, ``log=True``).
* **Refusal.** When vLLM refuses the drafter (on a CPU: DFlash2 and DSpark, ``Model Runner V1 does not
  support: ...``) the report is still written, with ``refused`` (the exact line, the vLLM version, the
  log), and :class:`VllmRefused` is raised with one line (:func:`.report.refusal_message`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import write_json_atomic
from dflash_staged.serve.report import agreement, out_dir, read_eval_report, report_head, summarize_run
from dflash_staged.serve.vllm import import_vllm, vllm_version
from dflash_staged.serve.vllm.report import (
    counter_summary,
    format_run,
    refusal_message,
    refused_report,
    speculative_config,
)


class VllmRefused(DflashError):
    """vLLM refused the drafter; the report (with ``refused``) was written."""


def target_stop_ids(tdir: Path, tokenizer=None) -> list[int]:
    """The target's stop ids from its files (module docstring), without loading the model."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        try:
            v = json.loads((tdir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if v is not None:
            ids |= {int(x) for x in (v if isinstance(v, list) else [v])}
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"serve: {msg}", file=sys.stderr, flush=True)


def serve_eval_vllm(
    drafter_path,
    target_dir,
    prompts_path,
    out: str | Path,
    max_new_tokens: int = 128,
    *,
    limit: int | None = None,
    chat_template_kwargs: dict | None = None,
    chat_template=None,
    baseline: bool = True,
    compare=None,
    log: bool = True,
    quiet: bool = False,
) -> dict:
    """Every prompt through vLLM with (and without) the drafter; the report (module docstring)."""
    from dflash_staged.config import target_from_spec
    from dflash_staged.evaluate.prompts import chat_options, load_prompts
    from dflash_staged.model.drafters.weights import read_drafter_config
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.serve.evaluate import machine
    from dflash_staged.serve.vllm.engine import Refused, counters, decode, engine_kwargs, open_engine
    from dflash_staged.train.checkpoint import resolve_checkpoint

    compared = read_eval_report(compare) if compare is not None else None
    ckpt = resolve_checkpoint(drafter_path, "--drafter")
    dcfg = read_drafter_config(ckpt)
    import_vllm()  # one line on how to install it, before any work
    version = vllm_version()
    try:
        spec = speculative_config(dcfg, str(ckpt), version)
    except ValueError as e:
        raise DflashError(f"{ckpt}/config.json: {e}") from None
    tcfg = target_from_spec(str(target_dir))
    tdir = Path(tcfg.model)
    if not (tdir / "config.json").is_file():
        raise DflashError(
            f"--target {target_dir}: vLLM is given the target as a local Hugging Face directory "
            f"(config.json, safetensors); {tdir} is not one"
        )
    layers, hidden, vocab = target_dims(tcfg)
    if dcfg.hidden_size != hidden or max(dcfg.target_layer_ids) >= layers:
        raise DflashError(
            f"{ckpt}/config.json: the drafter (hidden {dcfg.hidden_size}, taps {dcfg.target_layer_ids}) does "
            f"not fit {tdir} (hidden {hidden}, {layers} layers); serve it with the target it was trained on"
        )
    tok: list = []
    chat, chat_source = chat_options(ckpt, str(target_dir), chat_template_kwargs, chat_template)
    prompts = load_prompts(
        prompts_path, lambda: tok.append(load_tokenizer(tcfg)) or tok[0], vocab, limit, chat
    )
    stop = target_stop_ids(tdir, tok[0] if tok else None)
    _say(f"{len(prompts)} prompts rendered with {chat.kwargs or 'no options'} ({chat_source})", quiet)
    out = out_dir(out)
    max_len = max(len(ids) for _, ids in prompts) + max_new_tokens + dcfg.block_size + 8
    report = {
        "engine": {
            "name": "vLLM (in process, vllm.LLM)",
            "version": version,
            "settings": {k: v for k, v in engine_kwargs(tdir, max_len, None).items() if k != "model"},
            "speculative_config": spec,
        },
        "machine": machine(),
        **report_head(ckpt, dcfg, tdir, prompts_path, prompts, max_new_tokens),
        "stop_token_ids": stop,
        "runs": [],
    }

    def say_to(s):
        return (lambda msg: None) if quiet else s

    base = None
    stage = "speculative"  # first: a drafter vLLM refuses costs no plain run
    try:
        t0 = time.monotonic()
        with open_engine(engine_kwargs(tdir, max_len, spec), _log(out, "spec", log)) as (llm, s):
            say_to(s)(f"serve: vLLM {version} engine with the drafter up in {time.monotonic() - t0:.0f} s")
            before = counters(llm)
            recs = decode(llm, prompts, max_new_tokens, stop, True, say_to(s), f"vLLM {spec['method']}")
            after = counters(llm)
        stage = "plain"
        if baseline:
            t0 = time.monotonic()
            with open_engine(engine_kwargs(tdir, max_len, None), _log(out, "plain", log)) as (llm, s):
                say_to(s)(f"serve: vLLM {version} plain engine up in {time.monotonic() - t0:.0f} s")
                base = decode(llm, prompts, max_new_tokens, stop, False, say_to(s), "vLLM plain")
    except Refused as e:
        log_path = _log(out, "plain" if stage == "plain" else "spec", log)
        refused_report(report, stage, e.line, version, str(log_path) if log_path else None)
        write_json_atomic(out / "serve_eval.json", report)
        raise VllmRefused(refusal_message(report)) from None
    run = {
        "vllm": version,
        "method": spec["method"],
        "num_speculative_tokens": spec["num_speculative_tokens"],
    }
    run.update(outtype="f32", temperature=0.0)
    run.update(summarize_run(recs, base, greedy=True))
    run["counters"] = counter_summary(before, after)
    if compared is not None:
        run["agreement"] = agreement(recs, compared)
    run["per_prompt"] = recs
    report["runs"].append(run)
    _say(format_run(run), quiet)
    write_json_atomic(out / "serve_eval.json", report)
    return report


def _log(out: Path, name: str, log: bool) -> Path | None:
    return out / "logs" / f"vllm-{name}.log" if log else None


def report_lines(report: dict, out: Path) -> list[str]:
    """What the command prints for a report."""
    lines = []
    for run in report["runs"]:
        lines.append(format_run(run))
        c = run.get("counters") or {}
        if c.get("per_position_acceptance"):
            lines.append(
                "  per-position acceptance (vLLM): "
                + ", ".join(f"{a:.3f}" for a in c["per_position_acceptance"])
            )
        a = run.get("agreement")
        if a:
            lines.append(
                f"  vs dflash eval: tau {a['tau_served']:.3f} (vLLM) vs {a['tau_eval']:.3f} (dflash eval); "
                f"{a['identical_steps']}/{a['steps']} steps identical ({a['identical_step_share']:.1%}; each "
                f"prompt's final step left out), {a['identical_prompts']}/{a['prompts']} prompts identical"
            )
    lines.append(f"report: {Path(out) / 'serve_eval.json'}")
    return lines

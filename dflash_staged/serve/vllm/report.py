"""What ``dflash serve eval --engine vllm`` reports: no vLLM needed here (the unit tests run without it).

Contract:

* **The speculative config** (:func:`speculative_config`): vLLM 0.32's method for the family (``dflash``
  for DFlash and DFlash2, whose ``DFlash2DraftModel`` architecture selects the candidate head; ``dspark``
  for DSpark) and ``num_speculative_tokens`` = the drafts a verify step takes (``B - 1``, DSpark ``B``).
  DSpine has no vLLM model class: :func:`speculative_config` says so in one line.
* **A prompt's record** (:func:`prompt_record`), from vLLM's per-request metrics
  (``per_request_spec_decode_metrics="detailed"``: the accepted drafts of every verify step): the tokens
  each step commits, ``accepted + 1`` but no more than the tokens left (the first token comes from the
  prefill, and a step past ``max_new_tokens`` or a stop token is cut there), tokens left after the last
  step count one each; tau is their mean (``dflash eval``'s definition). Decode time is from the first
  token to the last (vLLM's engine-core timestamps), over the tokens after the first: prefill excluded.
  The record's keys are those of the llama.cpp serve eval's (:mod:`dflash_staged.serve.report`), so the
  same summary, lossless check and agreement with a ``dflash eval`` report apply.
* **tau from vLLM's own counters** (:func:`counter_summary`): the difference of two ``LLM.get_metrics()``
  snapshots (before and after the drafter's run), ``tau = 1 + accepted / drafts`` and the per-position
  acceptance ``accepted_per_pos[i] / drafts`` (the share of verify steps whose draft ``i`` was accepted).
* **A refusal** (:func:`refusal_line`): the one line vLLM refused with (a pydantic validation error's
  inner ``ValueError``, else the exception's first line, else the last error line of the engine's log).
"""

from __future__ import annotations

import re

SPEC_DECODE = "vllm:spec_decode_"
_GENERIC = "Engine core initialization failed"  # the engine's process failed: the cause is in its log
_ERROR_LINE = re.compile(r"\b(\w+(Error|Exception)|NotImplementedError): (.+)$")


def speculative_config(dcfg, ckpt: str, version: str) -> dict:
    """vLLM's ``speculative_config`` for this drafter; ``ValueError`` (one line) for a family vLLM lacks."""
    fam = dcfg.family.name
    if fam not in ("dflash", "dflash2", "dspark"):
        raise ValueError(
            f"vLLM {version} has no model class for a {fam} drafter (its registry has DFlashDraftModel, "
            "DFlash2DraftModel and Qwen3DSparkModel); evaluate it with dflash eval"
        )
    method = "dspark" if fam == "dspark" else "dflash"
    return {
        "method": method,
        "model": str(ckpt),
        "num_speculative_tokens": dcfg.family.proposals(dcfg.block_size),
    }


def prompt_record(
    line: int,
    prompt_ids: list[int],
    tokens: list[int],
    step_accepted: list[int] | None,
    first_ts: float,
    last_ts: float,
    finish: str | None = None,
) -> dict:
    """One prompt's record (module docstring); ``step_accepted`` None: plain decoding, one token a step."""
    tokens = [int(t) for t in tokens]
    left = max(0, len(tokens) - 1)  # the first token comes from the prefill
    committed = []
    for a in step_accepted or []:
        if left <= 0:
            break
        committed.append(min(int(a) + 1, left))
        left -= committed[-1]
    committed += [1] * left
    return {
        "line": line,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(tokens),
        "tokens": tokens,
        "accepted": committed,
        "tau": round(sum(committed) / len(committed), 4) if committed else 0.0,
        "drafted_steps": len(step_accepted or []),
        "decode_ms": round(max(0.0, last_ts - first_ts) * 1000, 3),
        "decoded": max(0, len(tokens) - 1),
        "stop": finish,
    }


def spec_counters(metrics) -> dict:
    """``{"drafts", "draft_tokens", "accepted", "accepted_per_pos"}`` summed over engines from a
    ``get_metrics()`` snapshot (objects with ``name`` and ``value`` or ``values``)."""
    out: dict = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted"}
    for m in metrics:
        name = getattr(m, "name", "")
        if not name.startswith(SPEC_DECODE):
            continue
        key = name[len(SPEC_DECODE) :]
        if key == "num_accepted_tokens_per_pos":
            vals = [int(v) for v in getattr(m, "values", [])]
            old = out["accepted_per_pos"]
            old += [0] * (len(vals) - len(old))
            out["accepted_per_pos"] = [a + b for a, b in zip(old, vals + [0] * (len(old) - len(vals)))]
        elif key in names:
            out[names[key]] += int(getattr(m, "value", 0))
    return out


def counter_summary(before: dict, after: dict) -> dict:
    """vLLM's counters over a run (``after - before``), its tau and per-position acceptance."""
    d = {k: after[k] - before.get(k, 0) for k in ("drafts", "draft_tokens", "accepted")}
    old = before.get("accepted_per_pos") or []
    per = [a - (old[i] if i < len(old) else 0) for i, a in enumerate(after.get("accepted_per_pos") or [])]
    d["accepted_per_pos"] = per
    drafts = d["drafts"]
    d["tau"] = round(1 + d["accepted"] / drafts, 4) if drafts else None
    d["per_position_acceptance"] = [round(a / drafts, 4) for a in per] if drafts else []
    d["draft_acceptance_rate"] = round(d["accepted"] / d["draft_tokens"], 4) if d["draft_tokens"] else None
    return d


def refusal_line(exc: BaseException | None, log_text: str = "") -> str:
    """The line vLLM refused with (module docstring)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
        except Exception:  # noqa: BLE001 - not pydantic's errors(): fall through to the text
            first = None
        if isinstance(first, dict):
            inner = (first.get("ctx") or {}).get("error")
            if inner is not None:
                return str(inner).strip().splitlines()[0]
            msg = str(first.get("msg", ""))
            if msg:
                return msg.removeprefix("Value error, ").splitlines()[0]
    text = str(exc).strip() if exc is not None else ""
    if not text or text.startswith(_GENERIC):  # the root cause is in the engine's own process: its log
        lines = [ln.strip() for ln in log_text.splitlines() if _GENERIC not in ln]
        found = [m.group(0) for ln in lines if (m := _ERROR_LINE.search(ln))]
        if found:
            return found[-1]
    return text.splitlines()[0] if text else type(exc).__name__


def refused_report(report: dict, stage: str, line: str, version: str, log: str | None) -> dict:
    """``report`` with its ``refused`` record: which engine run, the vLLM version, the exact line."""
    report["refused"] = {"engine": f"vLLM {version}", "run": stage, "line": line, "log": log}
    return report


def refusal_message(report: dict) -> str:
    """The command's one error line for a refused drafter."""
    r = report["refused"]
    return (
        f"{r['engine']} refused the {report['architecture']} drafter {report['drafter']} "
        f"({r['run']} engine): {r['line']}"
        + (f" (log: {r['log']})" if r.get("log") else "")
        + (
            "; on a CPU, vLLM's V1 model runner serves DFlash only (DFlash2 and DSpark need its GPU V2 "
            "runner)"
            if "Model Runner V1 does not support" in r["line"]
            else ""
        )
    )


def format_run(run: dict) -> str:
    s = f"vLLM {run['vllm']} {run['method']} k={run['num_speculative_tokens']}: tau {run['tau']:.3f}"
    s += f" pooled over {run['steps']} steps"
    c = run.get("counters") or {}
    if c.get("tau") is not None:
        s += f" (vLLM's counters: 1 + {c['accepted']}/{c['drafts']} = {c['tau']:.3f})"
    s += f", {run['speculative']['tokens_per_s']:.1f} tokens/s"
    if "baseline" in run:
        s += f" vs {run['baseline']['tokens_per_s']:.1f} plain ({run['speedup']:.2f}x)"
    if "lossless" in run:
        same = run["lossless"]
        s += f", lossless: {same['identical_prompts']}/{same['prompts']} equal to plain greedy"
    return s

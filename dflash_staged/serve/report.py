"""What ``dflash serve eval`` reports (:mod:`.evaluate`): each prompt's record from the server's answer and
trace, a run's summary, the fastest ``n_max``, and the agreement with a ``dflash eval`` report.

Contract:

* **A prompt's record** (:func:`prompt_result`): its tokens, the tokens each verify step commits (from the
  server's trace, read by :meth:`~.llamacpp.server.LlamaServer.complete`; the last token may be a step
  without a draft, as llama.cpp drafts at most the tokens still to come less one, and a trace that leaves
  more than that is an error naming the prompt's line), tau and the server's decode timings.
* **Agreement** (:func:`agreement`) with a ``dflash eval`` report of the same prompts (greedy): a step is
  identical when both sides have a step starting at the same output position and committing the same
  number of tokens. Each prompt's final step is left out on both sides (``final_steps_excluded``):
  llama.cpp drafts the whole block before ``max_new_tokens`` and truncates it where ``dflash eval``
  drafts the shorter block, as z-lab's reference does, so a bidirectional drafter may differ there by
  design. The report gives the share of identical steps (over the longer side's count), the prompts
  whose every step is identical, and the pooled taus (all steps) and their difference.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_staged.errors import DflashError


def out_dir(out) -> Path:
    """``--out`` made (with its ``logs/``), or one line saying it cannot be."""
    out = Path(out)
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DflashError(
            f"--out {out}: cannot create it ({e.strerror}); choose a writable directory"
        ) from None
    return out


def report_head(ckpt, dcfg, tdir, prompts_path, prompts: list, max_new_tokens: int) -> dict:
    """What both engines' serve-eval reports say of the drafter, the target and the prompts."""
    return {
        "drafter": str(ckpt),
        "architecture": dcfg.architecture,
        "block_size": dcfg.block_size,
        "target": str(tdir),
        "prompts_file": str(prompts_path),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }


def prompt_result(resp: dict, line: int = 0, log=None, traced: bool = True) -> dict:
    """One prompt's record from the server's response and, when ``traced`` (a server with a drafter), its
    verify steps (``resp["steps"]``; module docstring)."""
    tokens = [int(t) for t in resp.get("tokens") or []]
    t = resp.get("timings") or {}
    left = max(0, len(tokens) - 1)  # the first token comes from the prefill
    committed = []
    for a, _n in resp.get("steps", []):
        if left <= 0:
            break
        committed.append(min(a + 1, left))
        left -= committed[-1]
    if traced and left > 1:
        raise DflashError(
            f"prompt line {line}: llama-server's trace has verify steps for {len(tokens) - 1 - left} of the "
            f"{len(tokens) - 1} tokens after the first, and llama.cpp leaves at most the last one undrafted: "
            f"trace lines are missing from its log{f' ({log})' if log else ''}, so tau cannot be measured"
        )
    committed += [1] * left  # the last token: no draft fits before max_new_tokens
    return {
        "new_tokens": len(tokens),
        "tokens": tokens,
        "accepted": committed,
        "tau": round(sum(committed) / len(committed), 4) if committed else 0.0,
        "drafted": sum(n for _a, n in resp.get("steps", [])),
        "decode_ms": float(t.get("predicted_ms") or 0.0),
        "decoded": int(t.get("predicted_n") or 0),
        "stop": resp.get("stop_type"),
    }


def _rate(recs: list[dict]) -> dict:
    n, ms = sum(r["decoded"] for r in recs), sum(r["decode_ms"] for r in recs)
    return {"tokens": n, "seconds": round(ms / 1000, 3), "tokens_per_s": round(n / max(ms / 1000, 1e-9), 2)}


def summarize_run(recs: list[dict], base: list[dict] | None, greedy: bool) -> dict:
    steps = [c for r in recs for c in r["accepted"]]
    taus = [r["tau"] for r in recs if r["accepted"]]
    run = {
        "tau": round(sum(steps) / len(steps), 4) if steps else 0.0,
        "tau_per_prompt_mean": round(sum(taus) / len(taus), 4) if taus else 0.0,
        "steps": len(steps),
        "speculative": _rate(recs),
    }
    calls, ms = sum(r.get("draft_calls", 0) for r in recs), sum(r["decode_ms"] for r in recs)
    if calls and steps:  # where a step's time goes: the drafter (llama.cpp's own timer), and the rest
        draft_ms = sum(r.get("draft_ms", 0.0) for r in recs)
        run["step_ms"] = {
            "total": round(ms / len(steps), 3),
            "drafter": round(draft_ms / calls, 3),
            "verify_and_rest": round((ms - draft_ms) / len(steps), 3),
        }
    if base is not None:
        run["baseline"] = _rate(base)
        run["speedup"] = round(
            run["speculative"]["tokens_per_s"] / max(run["baseline"]["tokens_per_s"], 1e-9), 3
        )
        if greedy:
            same = [r["tokens"] == b["tokens"] for r, b in zip(recs, base)]
            for r, s in zip(recs, same):
                r["identical"] = s
            run["lossless"] = {"identical_prompts": sum(same), "prompts": len(same)}
    return run


def _spans(committed: list[int]) -> set[tuple[int, int]]:
    """Each step as (the output position it starts at, tokens it commits)."""
    out, pos = set(), 0
    for c in committed:
        out.add((pos, c))
        pos += c
    return out


def read_eval_report(path) -> list[dict]:
    """The ``per_prompt`` records of a ``dflash eval`` report (``--compare``), checked to hold each prompt's
    line, tokens and per-step committed lengths; one line naming the file otherwise."""
    path = Path(path)
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise DflashError(
            f"--compare {path}: cannot read it as JSON ({why}); give a dflash eval --out report"
        ) from None
    rows = rep.get("per_prompt") if isinstance(rep, dict) else None
    ok = (
        isinstance(rows, list)
        and rows
        and all(
            isinstance(r, dict) and isinstance(r.get("line"), int) and isinstance(r.get("accepted"), list)
            for r in rows
        )
    )
    if not ok:
        raise DflashError(
            f"--compare {path}: not a dflash eval report with per-step records (per_prompt[].line and "
            "accepted); give the --out JSON of dflash eval on the same prompts, greedy"
        )
    return rows


def agreement(serve_prompts: list[dict], eval_prompts: list[dict]) -> dict:
    """Per-step agreement of committed lengths with a ``dflash eval`` report's ``per_prompt``, each prompt's
    final step left out (module docstring)."""
    by_line = {r["line"]: r for r in eval_prompts}
    same_steps = all_steps = same_prompts = 0
    rows = []
    for r in serve_prompts:
        e = by_line.get(r["line"])
        if e is None or "accepted" not in e:
            raise DflashError(
                f"the dflash eval report has no per-step record for prompt line {r['line']}; rerun "
                "dflash eval on the same prompts with this version"
            )
        a, b = r["accepted"][:-1], e["accepted"][:-1]  # the final, truncated blocks differ by design
        n = max(len(a), len(b))
        same = len(_spans(a) & _spans(b))
        same_steps, all_steps = same_steps + same, all_steps + n
        same_prompts += a == b
        rows.append(
            {
                "line": r["line"],
                "tau_served": r["tau"],
                "tau_eval": e["tau"],
                "same_steps": same,
                "steps": n,
                "same_tokens": e.get("tokens") == r["tokens"] if "tokens" in e else None,
            }
        )
    s_all = [c for r in serve_prompts for c in r["accepted"]]
    e_all = [c for r in eval_prompts for c in r["accepted"]]
    tau_s, tau_e = sum(s_all) / max(1, len(s_all)), sum(e_all) / max(1, len(e_all))
    return {
        "identical_steps": same_steps,
        "steps": all_steps,
        "final_steps_excluded": len(serve_prompts),
        "identical_step_share": round(same_steps / max(1, all_steps), 4),
        "identical_prompts": same_prompts,
        "prompts": len(serve_prompts),
        "tau_served": round(tau_s, 4),
        "tau_eval": round(tau_e, 4),
        "tau_difference": round(tau_s - tau_e, 4),
        "per_prompt": rows,
    }


def recommend(runs: list[dict]) -> list[dict]:
    """For each outtype and temperature measured at more than one n_max: the fastest n_max here."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if "speedup" in r:
            groups.setdefault((r["outtype"], r["temperature"]), []).append(r)
    out = []
    for (outtype, t), rs in groups.items():
        if len(rs) > 1:
            best = max(rs, key=lambda r: r["speedup"])
            out.append(
                {"outtype": outtype, "temperature": t, "n_max": best["n_max"], "speedup": best["speedup"]}
            )
    return out


def format_run(r: dict) -> str:
    s = (
        f"{r['outtype']} n_max={r['n_max']} T={r['temperature']}: tau {r['tau']:.3f} pooled over "
        f"{r['steps']} "
        f"steps, {r['speculative']['tokens_per_s']:.1f} tokens/s"
    )
    if "baseline" in r:
        s += f" vs {r['baseline']['tokens_per_s']:.1f} plain ({r['speedup']:.2f}x)"
    if "lossless" in r:
        same = r["lossless"]
        s += f", same as plain greedy on {same['identical_prompts']}/{same['prompts']} prompts"
    if r.get("repack", "on") != "on":
        s += f"; weight repacking {r['repack']}"
    return s

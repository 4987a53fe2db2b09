"""``dflash serve eval``: a drafter served by a real ``llama-server``, its tau and its speed.

Contract:

* **Same prompts as ``dflash eval``.** The prompts file, the chat options (the checkpoint's record,
  :func:`~dflash_staged.evaluate.prompts.chat_options`) and ``max_new_tokens`` are the same; the
  rendered prompt's token ids are sent as they are, so both decode from identical tokens.
* **Files.** Under ``out``: ``gguf/`` (the target and the drafter converted by llama.cpp's converter at
  each outtype, :mod:`.llamacpp.convert`), ``logs/`` (every server's log, kept) and ``serve_eval.json``.
* **Runs.** For each outtype, one server without the drafter decodes every prompt at each temperature
  (the baseline: its tokens and its tokens/s), then one server with the drafter for each ``n_max``
  (default: the whole block, ``B - 1`` drafts for DFlash and DFlash2, ``B`` for DSpark). A run gives
  per prompt the accepted drafts of every verify step (from the server's ``LLAMA_TRACE`` lines; the
  one-token steps where no draft fits before ``max_new_tokens`` are counted from the output's length),
  the committed tokens per step, tau (committed tokens per verify step, the first token, which comes
  from the prefill, excluded: ``dflash eval``'s definition), and whether the output equals the
  baseline's (greedy). Pooled tau is over all steps. Tokens/s is the server's own decode rate
  (``timings.predicted_n / predicted_ms``), prompt processing excluded, pooled over prompts.
* **Sampling.** At ``T > 0`` llama.cpp drafts greedily and accepts a draft while it equals the token
  the target samples (lossless, but not the rejection sampler of ``dflash eval``), with the target's
  top-k and top-p off and min-p 0; tau there is llama.cpp's, not comparable to ``dflash eval``'s.
* **Precision.** An ``f32`` run computes in f32 end to end (f32 KV caches, plain attention: llama.cpp's
  CPU flash-attention kernel moves a drafter's logits by about 1e-3 of their scale, enough to flip a
  near tie); the other outtypes run with llama.cpp's defaults (f16 KV caches, flash attention ``auto``),
  as a llama.cpp user serves. Each run records ``kv_cache`` and ``flash_attn``.
* **Agreement** (:func:`agreement`) with a ``dflash eval`` report of the same prompts (greedy): a step is
  identical when both sides have a step starting at the same output position and committing the same
  number of tokens; the report gives the share of identical steps (over the longer side's count), the
  prompts whose every step is identical, and the pooled taus' difference. Known differences: llama.cpp
  drafts the whole block before ``max_new_tokens`` and truncates it where ``dflash eval`` drafts the
  shorter block, as z-lab's reference does (a bidirectional drafter may then differ on the last step).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.fsutil import write_json_atomic
from dflash_staged.serve.llamacpp import build as llama_build
from dflash_staged.serve.llamacpp.convert import convert
from dflash_staged.serve.llamacpp.server import LlamaServer

SPEC_TYPES = {"dflash": "draft-dflash", "dflash2": "draft-dflash", "dspark": "draft-dspark"}


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"serve: {msg}", file=sys.stderr, flush=True)


def max_drafts(dcfg) -> int:
    """Drafts per verify step the block allows: ``B`` for DSpark's anchor-first block, else ``B - 1``."""
    return dcfg.block_size if dcfg.architecture == "dspark" else dcfg.block_size - 1


def llama_spec_type(dcfg, source: str) -> str:
    """llama.cpp's ``--spec-type`` for this drafter, or one line saying why llama.cpp cannot serve it."""
    arch = dcfg.architecture
    if arch not in SPEC_TYPES:
        raise DflashError(
            f"{source}: a {arch} drafter has no serving engine yet (llama.cpp, vLLM and SGLang serve DFlash, "
            "DFlash2 and DSpark); evaluate it with dflash eval"
        )
    if (
        arch == "dspark"
        and dcfg.options.get("markov_rank")
        and dcfg.options.get("markov_head_type") != "vanilla"
    ):
        raise DflashError(
            f"{source}: markov_head_type={dcfg.options['markov_head_type']!r}: llama.cpp's converter and "
            'vLLM serve only the vanilla Markov head; train with markov_head_type = "vanilla" to serve it'
        )
    return SPEC_TYPES[arch]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform()}


def _prompt_result(resp: dict) -> dict:
    tokens = [int(t) for t in resp.get("tokens") or []]
    t = resp.get("timings") or {}
    left = max(0, len(tokens) - 1)  # the first token comes from the prefill
    committed = []
    for a, _n in resp.get("steps", []):
        if left <= 0:
            break
        committed.append(min(a + 1, left))
        left -= committed[-1]
    committed += [1] * left  # one-token steps: no draft fits before max_new_tokens
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


def _decode_all(server: LlamaServer, prompts, max_new_tokens, temperature, seed, label, quiet) -> list[dict]:
    out = []
    for i, (line, ids) in enumerate(prompts):
        resp = server.complete(ids, max_new_tokens, temperature=temperature, seed=seed + line)
        rec = {"line": line, "prompt_tokens": len(ids), **_prompt_result(resp)}
        rec.update({k: resp[k] for k in ("draft_calls", "draft_ms") if k in resp})
        out.append(rec)
        _say(
            f"{label}: prompt {i + 1}/{len(prompts)} (line {line}): {rec['new_tokens']} tokens, "
            f"tau {rec['tau']:.2f}",
            quiet,
        )
    return out


def _rate(recs: list[dict]) -> dict:
    n, ms = sum(r["decoded"] for r in recs), sum(r["decode_ms"] for r in recs)
    return {"tokens": n, "seconds": round(ms / 1000, 3), "tokens_per_s": round(n / max(ms / 1000, 1e-9), 2)}


def _summary(recs: list[dict], base: list[dict] | None, greedy: bool) -> dict:
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


def agreement(serve_prompts: list[dict], eval_prompts: list[dict]) -> dict:
    """Per-step agreement of committed lengths with a ``dflash eval`` report's ``per_prompt``."""
    by_line = {r["line"]: r for r in eval_prompts}
    same_steps = all_steps = same_prompts = 0
    rows = []
    for r in serve_prompts:
        e = by_line.get(r["line"])
        if e is None or "accepted" not in e:
            raise DflashError(
                f"the dflash eval report has no per-step record for prompt line {r['line']}; rerun "
                "dflash eval "
                "on the same prompts with this version"
            )
        a, b = r["accepted"], e["accepted"]
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
        "identical_step_share": round(same_steps / max(1, all_steps), 4),
        "identical_prompts": same_prompts,
        "prompts": len(serve_prompts),
        "tau_served": round(tau_s, 4),
        "tau_eval": round(tau_e, 4),
        "tau_difference": round(tau_s - tau_e, 4),
        "per_prompt": rows,
    }


def serve_eval(
    drafter_path,
    target_dir,
    prompts_path,
    out: str | Path,
    max_new_tokens: int = 128,
    *,
    outtypes=("f32",),
    n_max: list[int] | None = None,
    temperatures=(0.0,),
    seed: int = 0,
    threads: int | None = None,
    limit: int | None = None,
    chat_template_kwargs: dict | None = None,
    chat_template=None,
    baseline: bool = True,
    quiet: bool = False,
    kind: str | None = None,
) -> dict:
    """Every prompt through llama-server, with and without the drafter; the report (module docstring).
    ``kind``: the llama.cpp build, ``cpu`` or ``cuda`` (every layer offloaded); default: cuda with a GPU."""
    from dflash_staged.config import target_from_spec
    from dflash_staged.evaluate.prompts import chat_options, load_prompts
    from dflash_staged.model.drafters.weights import read_drafter_config
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.train.checkpoint import resolve_checkpoint

    ckpt = resolve_checkpoint(drafter_path, "--drafter")
    dcfg = read_drafter_config(ckpt)
    spec_type = llama_spec_type(dcfg, f"{ckpt}/config.json")
    tcfg = target_from_spec(str(target_dir))
    tdir = Path(tcfg.model)
    if not (tdir / "config.json").is_file():
        raise DflashError(
            f"--target {target_dir}: llama.cpp's converter needs the target as a local Hugging Face "
            "directory "
            f"(config.json, safetensors, tokenizer); {tdir} is not one"
        )
    _num_layers, _hidden, vocab = target_dims(tcfg)
    tok: list = []
    chat, chat_source = chat_options(ckpt, str(target_dir), chat_template_kwargs, chat_template)
    prompts = load_prompts(
        prompts_path, lambda: tok.append(load_tokenizer(tcfg)) or tok[0], vocab, limit, chat
    )
    _say(f"{len(prompts)} prompts rendered with {chat.kwargs or 'no options'} ({chat_source})", quiet)
    n_maxes = sorted(set(n_max or [max_drafts(dcfg)]))
    if n_maxes[0] < 1 or n_maxes[-1] > max_drafts(dcfg):
        raise DflashError(
            f"--n-max {n_maxes}: a {dcfg.architecture} drafter of block {dcfg.block_size} drafts 1 to "
            f"{max_drafts(dcfg)} tokens per step"
        )
    out = Path(out)
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DflashError(
            f"--out {out}: cannot create it ({e.strerror}); choose a writable directory"
        ) from None
    kind = kind or llama_build.default_kind()
    if not llama_build.is_built(kind):
        _say("llama-server is not built on this machine yet: building it first (once)", quiet)
    bin_dir = llama_build.build(kind, quiet=quiet)
    threads = threads or os.cpu_count() or 1
    gpu = kind == "cuda"
    src = llama_build.SOURCE
    report = {
        "engine": {
            "name": "llama.cpp llama-server",
            "source": f"{src.package} {src.version} ({src.subdir})",
            "build": kind,
            "spec_type": spec_type,
        },
        "machine": machine(),
        "threads": threads,
        "drafter": str(ckpt),
        "architecture": dcfg.architecture,
        "block_size": dcfg.block_size,
        "target": str(tdir),
        "prompts_file": str(prompts_path),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "runs": [],
    }
    for outtype in outtypes:
        tgt = convert(tdir, out / "gguf" / f"target-{outtype}.gguf", outtype, quiet=quiet)
        dft = convert(ckpt, out / "gguf" / f"drafter-{outtype}.gguf", outtype, target_dir=tdir, quiet=quiet)
        exact = outtype == "f32"  # f32 end to end; else what a llama.cpp user runs (its defaults)
        kv, fa = ("f32", "off") if exact else (None, None)
        base: dict[float, list[dict]] = {}
        if baseline:
            log = out / "logs" / f"plain-{outtype}.log"
            with LlamaServer(bin_dir, tgt, log, threads=threads, kv_type=kv, flash_attn=fa, gpu=gpu) as srv:
                for t in temperatures:
                    base[t] = _decode_all(
                        srv, prompts, max_new_tokens, t, seed, f"{outtype} plain T={t}", quiet
                    )
        for n in n_maxes:
            log = out / "logs" / f"spec-{outtype}-n{n}.log"
            t0 = time.monotonic()
            kw = {"draft": dft, "spec_type": spec_type, "n_max": n, "threads": threads}
            kw.update(kv_type=kv, flash_attn=fa, gpu=gpu)
            with LlamaServer(bin_dir, tgt, log, **kw) as srv:
                for t in temperatures:
                    label = f"{outtype} n_max={n} T={t}"
                    recs = _decode_all(srv, prompts, max_new_tokens, t, seed, label, quiet)
                    run = {"outtype": outtype, "kv_cache": kv or "f16", "flash_attn": fa or "auto"}
                    run.update(n_max=n, temperature=t)
                    run["log"] = str(log)
                    run.update(_summary(recs, base.get(t), greedy=t == 0))
                    run["per_prompt"] = recs
                    report["runs"].append(run)
                    _say(format_run(run), quiet)
            _say(f"{outtype} n_max={n}: {time.monotonic() - t0:.0f} s", quiet)
    report["recommended"] = recommend(report["runs"])
    write_json_atomic(out / "serve_eval.json", report)
    return report


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
    return s

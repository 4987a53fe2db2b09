"""``dflash data show``: the samples as ``dflash plan`` makes them, with the loss tokens marked.

:func:`show_data` ingests the whole input exactly as ``plan`` does (the same formats, chat
template and options, truncation and skipping: :func:`~dflash_staged.plan.dataset.load_dataset`)
and returns a report: the format, the record counts, the loss-token fraction, the length
percentiles over every sample, what a draft vocabulary of each size would cover of the loss tokens
(:mod:`dflash_staged.model.drafters.vocab`), and the chosen samples (the first N, or the given lines/rows) as
runs of decoded text, each run either loss or context. :func:`format_text` prints it for a
terminal (loss tokens in colour, or between ``[[`` and ``]]`` without colour);
:func:`format_html` makes a self-contained HTML page (loss tokens highlighted), written
atomically by the CLI.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
LOSS_OPEN, LOSS_CLOSE = "[[", "]]"  # loss-token markers of the plain-text view


def _runs(tok, ids: np.ndarray, mask: np.ndarray) -> list[tuple[bool, str]]:
    """Consecutive tokens of one kind (loss or not), decoded: [(is_loss, text), ...]."""
    if not len(ids):
        return []
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    out = []
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(ids)]):
        text = tok.decode(ids[a:b].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        out.append((bool(mask[a]), text))
    return out


def show_data(
    config_path: str | Path,
    data_path: str | Path,
    *,
    num: int = 3,
    lines: list[int] | None = None,
    skip_bad: bool = False,
    progress: bool = False,
) -> dict:
    """The report described in the module docstring."""
    from dflash_staged.chat import ChatOptions
    from dflash_staged.config import load_config
    from dflash_staged.plan.dataset import _load_tokenizer, load_dataset

    cfg = load_config(config_path)
    chat = ChatOptions.from_config(cfg.data)
    tok = _load_tokenizer(cfg.target)
    samples, _ = load_dataset(data_path, cfg, skip_bad=skip_bad, tokenizer=tok, progress=progress, chat=chat)
    lengths = samples.lengths()
    loss = int(samples.loss_mask.sum())
    where = {int(n): i for i, n in enumerate(samples.lines)}
    chosen = [where[n] for n in lines if n in where] if lines else list(range(min(num, len(samples))))
    shown = []
    for i in chosen:
        ids, mask = samples.sample(i)
        shown.append(
            {
                "line": int(samples.lines[i]),
                "tokens": len(ids),
                "loss_tokens": int(mask.sum()),
                "runs": _runs(tok, ids, mask),
            }
        )
    return {
        "draft_vocab": _draft_vocab(cfg, samples),
        "data": str(data_path),
        "config": str(config_path),
        "store": _store(cfg, int(lengths.sum())),
        "stats": samples.stats,
        "bad_examples": samples.bad_examples,
        "short_examples": samples.short_examples,
        "max_len": cfg.data.max_len,
        "min_loss": cfg.min_loss_tokens,
        "chat": {"kwargs": chat.kwargs, "template": chat.template_path or None},
        "tokens": int(lengths.sum()),
        "loss_tokens": loss,
        "loss_fraction": loss / max(1, int(lengths.sum())),
        "length": {
            "min": int(lengths.min()),
            "mean": float(lengths.mean()),
            "max": int(lengths.max()),
            **{f"p{p}": float(np.percentile(lengths, p)) for p in PERCENTILES},
        },
        "samples": shown,
        "not_found": [n for n in (lines or []) if n not in where],
    }


def _store(cfg, tokens: int) -> str | None:
    """The store line for all of the data's tokens, when the target's config is on this machine."""
    from dflash_staged.errors import DflashError
    from dflash_staged.model.target import resolve_layer_ids
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.plan.store_size import store_line

    try:
        dims = target_dims(cfg.target, local_only=True)
    except (DflashError, OSError):
        return None
    taps = len(resolve_layer_ids(cfg.target, dims.num_layers, cfg.drafter.num_hidden_layers))
    return store_line(cfg, dims.hidden_size, taps, tokens, "for the whole data, once")


VOCAB_SIZES = (4096, 8192, 16384, 32768)


def _draft_vocab(cfg, samples) -> dict:
    """What a draft vocabulary of each size (the config's and :data:`VOCAB_SIZES`) covers of the loss
    tokens (:mod:`dflash_staged.model.drafters.vocab`)."""
    from dflash_staged.model.drafters.vocab import coverage, loss_token_counts

    top = int(samples.tokens.max()) + 1 if samples.tokens.size else 1
    counts = loss_token_counts(samples.tokens, samples.loss_mask, top)
    n, seen = cfg.drafter.draft_vocab_size, int((counts > 0).sum())
    sizes = sorted({*(v for v in VOCAB_SIZES if v < seen), *([n] if n else [])})  # (all seen: 100%)
    return {"configured": n, "seen": seen, "coverage": coverage(counts, sizes)}


def summary_lines(r: dict) -> list[str]:
    """The whole-input figures, one per line."""
    st, ln = r["stats"], r["length"]
    skipped = [
        f"{st[k]:,} {what}"
        for k, what in (
            ("bad", "bad"),
            ("skipped_long", f"longer than {r['max_len']}"),
            ("skipped_short_loss", f"with < {r['min_loss']} loss tokens (data.min_loss_tokens)"),
        )
        if st.get(k)
    ]
    out = [
        f"data: {r['data']} ({st['format']})",
        f"samples: {st['samples']:,} of {st['lines']:,} records; skipped: {', '.join(skipped) or 'none'}"
        + (f"; truncated to {r['max_len']}: {st['truncated']:,}" if st.get("truncated") else ""),
        f"chat template: {r['chat']['template'] or '(the tokenizer template)'}, options "
        f"{r['chat']['kwargs']}",
        f"tokens: {r['tokens']:,}; loss tokens: {r['loss_tokens']:,} ({r['loss_fraction']:.1%})",
        "length (tokens): "
        + ", ".join(
            [f"min {ln['min']}"]
            + [f"p{p} {ln[f'p{p}']:.0f}" for p in PERCENTILES]
            + [f"max {ln['max']}", f"mean {ln['mean']:.1f}"]
        ),
    ]
    out += [r["store"]] if r.get("store") else []
    if dv := r.get("draft_vocab"):
        cov = ", ".join(f"{n:,} {c:.2%}" for n, c in dv["coverage"].items())
        out.append(
            f"draft vocabulary (share of loss tokens the N most frequent cover; {dv['seen']:,} distinct): "
            + cov
            + (f"; configured {dv['configured']:,}" if dv["configured"] else "; not configured")
        )
    out += [f"  e.g. {ex}" for ex in r["bad_examples"][:3] + r.get("short_examples", [])[:3]]
    if st.get("off_prompt"):
        from dflash_staged.chat import off_prompt_warning

        out.append(off_prompt_warning(st["off_prompt"]))
    if r["not_found"]:
        out.append(
            "not samples (blank, bad or skipped; see the counts above): line/row "
            + ", ".join(map(str, r["not_found"]))
        )
    return out


def _header(s: dict) -> str:
    return (
        f"line/row {s['line']}: {s['tokens']} tokens, {s['loss_tokens']} carry the loss "
        f"({s['loss_tokens'] / max(1, s['tokens']):.1%})"
    )


def format_text(r: dict, color: bool) -> str:
    """The report for a terminal: loss tokens green and bold (or between [[ ]] without colour)."""
    import click

    out = summary_lines(r)
    legend = (
        click.style("loss tokens", fg="green", bold=True) + ", " + click.style("context", dim=True)
        if color
        else f"{LOSS_OPEN}loss tokens{LOSS_CLOSE}, context"
    )
    out.append(f"shown: {len(r['samples'])} sample(s); {legend}")
    for s in r["samples"]:
        out.append(click.style(f"--- {_header(s)} ---", bold=True) if color else f"--- {_header(s)} ---")
        if color:
            out.append(
                "".join(
                    click.style(t, fg="green", bold=True) if loss else click.style(t, dim=True)
                    for loss, t in s["runs"]
                )
            )
        else:
            out.append("".join(f"{LOSS_OPEN}{t}{LOSS_CLOSE}" if loss else t for loss, t in s["runs"]))
    return "\n".join(out)


_CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 15px; margin: 20px 0 6px; }
ul.summary { margin: 0; padding-left: 18px; color: #333; }
pre { white-space: pre-wrap; word-break: break-word; font: 13px/1.5 ui-monospace, monospace;
      background: #fafafa; border: 1px solid #ddd; border-radius: 4px; padding: 10px; margin: 0; }
.ctx { color: #777; }
.loss { background: #b7f0b1; color: #0b3d0b; border-bottom: 2px solid #2e9c2e; }
.legend span { padding: 1px 6px; border-radius: 3px; }
"""


def format_html(r: dict) -> str:
    """A self-contained HTML page: the summary, then every chosen sample with the loss tokens highlighted."""
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>dflash data show</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>dflash data show: {e(r['data'])}</h1>",
        "<ul class='summary'>" + "".join(f"<li>{e(x)}</li>" for x in summary_lines(r)) + "</ul>",
        "<p class='legend'><span class='loss'>loss tokens</span> <span class='ctx'>context (no "
        "loss)</span></p>",
    ]
    for s in r["samples"]:
        body = "".join(f"<span class='{'loss' if loss else 'ctx'}'>{e(t)}</span>" for loss, t in s["runs"])
        parts.append(f"<h2>{e(_header(s))}</h2><pre>{body}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"

"""``dflash plan``: ingest the data, bucket and batch it, and create the manifest; print a summary."""

from __future__ import annotations

from pathlib import Path

from dflash_staged.plan.batching import Plan, make_plan


def plan_manifest(
    config_path: str | Path,
    data_path: str | Path,
    manifest_dir: str | Path,
    *,
    epochs: int = 1,
    seed: int = 0,
    skip_bad: bool = False,
    progress: bool = False,
) -> str:
    """Ingest, plan and create the manifest (a no-op if it exists with the same inputs); return a summary.

    Everything is computed in memory first, so a failing ingestion writes nothing.
    """
    from dflash_staged.chat import ChatOptions
    from dflash_staged.config import load_config
    from dflash_staged.manifest import Manifest
    from dflash_staged.model.target import load_tokenizer, resolve_layer_ids
    from dflash_staged.model.target.dims import target_dims
    from dflash_staged.plan.dataset import load_dataset
    from dflash_staged.plan.drafter_check import check_drafter
    from dflash_staged.preflight import writable_dir

    cfg = load_config(config_path)
    # An address, not necessarily a path: Path() would fold postgresql:// into a directory "postgresql:".
    manifest_dir = str(manifest_dir)
    existed = Manifest.exists(manifest_dir)  # a bad address fails here, before the data is read
    if "://" not in manifest_dir:  # a directory (SQLite): one line now if it cannot be written
        writable_dir(manifest_dir, "--manifest")
    dims = target_dims(cfg.target)
    if cfg.target.engine == "vllm":  # what vLLM's extractor cannot serve, refused before anything is written
        from dflash_staged.config.vllm_target import check_vllm_model
        from dflash_staged.model.target.dims import target_text_config

        text = target_text_config(cfg.target)
        check_vllm_model(text.model_type, text.to_dict(), f"target.model={cfg.target.model!r}")
    layer_ids = resolve_layer_ids(cfg.target, dims.num_layers, cfg.drafter.num_hidden_layers)
    tokenizer = load_tokenizer(cfg.target)
    notes = check_drafter(cfg, config_path, dims, layer_ids, tokenizer)  # before the data is read or written
    chat = ChatOptions.from_config(cfg.data)
    samples, data_hash = load_dataset(
        data_path, cfg, skip_bad=skip_bad, progress=progress, chat=chat, tokenizer=tokenizer
    )
    plan = make_plan(samples.lengths(), cfg, epochs, seed)
    from dflash_staged.model.drafters import vocab as dv

    # the loss tokens' counts, from which a draft vocabulary of any size is chosen (model/drafters/vocab.py)
    counts = dv.loss_token_counts(samples.tokens, samples.loss_mask, dims.vocab_size)
    extra = {"chat": chat.record(), "loss_tokens": dv.counts_record(counts)}
    n = cfg.drafter.draft_vocab_size
    vocab = dv.choose(counts, n) if n else None
    # meta "chat": how conversations were rendered; the trainer copies it into checkpoints for eval
    with Manifest.create(
        manifest_dir,
        config=cfg,
        samples=samples,
        plan=plan,
        data_path=str(Path(data_path).resolve()),
        data_hash=data_hash,
        layer_ids=layer_ids,
        extra_meta=extra,
    ) as m:
        where = m.address
    head = (
        f"{where} already holds this plan (same config, data, epochs and seed); nothing to do"
        if existed
        else f"planned {where}"
    )
    from dflash_staged.plan.store_size import store_line

    summary = format_plan_summary(
        samples, plan, str(data_path), cfg.data.max_len, cfg.min_loss_tokens, layer_ids
    )
    if vocab is not None:
        summary += "\n  " + vocab.line(dims.vocab_size)
    return (
        head
        + "".join(f"\n  note: {n}" for n in notes)
        + "\n"
        + summary
        + "\n  "
        + store_line(cfg, dims.hidden_size, len(layer_ids), plan.tokens_real)
    )


def format_plan_summary(
    samples, plan: Plan, data_path: str, max_len: int, min_loss: int, layer_ids: list[int] | None = None
) -> str:
    st = samples.stats
    lines = [f"  samples: {st['samples']:,} from {data_path} ({st['lines']:,} records)"]
    if st.get("format"):
        lines.append(f"  format: {st['format']}")
    skipped = [f"{st['bad']:,} bad"] if st.get("bad") else []
    if st.get("skipped_long"):
        skipped.append(f"{st['skipped_long']:,} longer than max_len {max_len}")
    if st.get("skipped_short_loss"):
        skipped.append(f"{st['skipped_short_loss']:,} with < {min_loss} loss tokens (data.min_loss_tokens)")
    lines.append(
        f"  skipped: {', '.join(skipped) or 'none'}"
        + (f"; truncated to {max_len}: {st['truncated']:,}" if st.get("truncated") else "")
    )
    for ex in getattr(samples, "bad_examples", [])[:3] + getattr(samples, "short_examples", [])[:3]:
        lines.append(f"    e.g. {ex}")
    if st.get("off_prompt"):
        from dflash_staged.chat import off_prompt_warning

        lines.append("  " + off_prompt_warning(st["off_prompt"]))
    lows = [1] + [e + 1 for e in plan.edges[:-1]]
    buckets = [f"{a}-{b}: {n}" for a, b, n in zip(lows, plan.edges, plan.bucket_counts())]
    lines.append(f"  buckets (length range: jobs per epoch): {', '.join(buckets)}")
    lines.append(
        f"  jobs: {len(plan.batches):,} per epoch x {plan.epochs} epoch(s) = {plan.num_jobs:,}; "
        f"seed {plan.seed}"
    )
    lines.append(
        f"  tokens per epoch: {plan.tokens_real:,} real, {plan.tokens_padded:,} padded; "
        f"padding waste {plan.padding_waste:.2%}"
    )
    if layer_ids is not None:
        lines.append(f"  tapped target layers: {layer_ids}")
    return "\n".join(lines)

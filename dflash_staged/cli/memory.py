"""``dflash memory``: a recipe's training memory before any GPU is touched (the trainer prints the same
estimate at start on CUDA, :mod:`dflash_staged.train.memory`)."""

from __future__ import annotations

import click

from dflash_staged.errors import user_errors


@click.command("memory", short_help="Estimate a recipe's GPU memory for training, offline.")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Config TOML: the target, [drafter] and [train], e.g. configs/qwen3-8b.toml.",
)
@click.option(
    "--device-gib", type=click.FloatRange(min=1), default=80.0, show_default=True, help="GPU memory."
)
@click.option(
    "--target-dims",
    default=None,
    help="LAYERS,HIDDEN,VOCAB of the target when its config is not on this machine (e.g. 36,4096,151936).",
)
@click.option("--set", "sets", multiple=True, help="SECTION.KEY=VALUE over the config (any section).")
@user_errors
def memory_cmd(config_path, device_gib, target_dims, sets):
    """Estimated peak of one training rank on a CUDA device of --device-gib (bf16), for the config's
    drafter family and [train] settings: weights, a drafter row, context, loss chunk; and the row budget."""
    import torch

    from dflash_staged.config import load_config
    from dflash_staged.errors import DflashError
    from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
    from dflash_staged.train.memory import estimate, row_budget

    cfg = load_config(config_path)
    if sets:
        from dflash_staged.config import apply_overrides
        from dflash_staged.config.overrides import parse_sets

        every = {section: set(values) for section, values in cfg.to_dict().items()}
        cfg = apply_overrides(cfg, parse_sets(sets), every, "dflash memory")
    if target_dims:
        try:
            layers, hidden, vocab = (int(x) for x in target_dims.split(","))
        except ValueError:
            raise DflashError(f"--target-dims {target_dims!r}: give LAYERS,HIDDEN,VOCAB") from None
    else:
        from dflash_staged.model.target.dims import target_dims as dims_of

        try:
            layers, hidden, vocab = dims_of(cfg.target)
        except DflashError as e:  # e.g. offline, with the target not downloaded: the dims suffice
            raise DflashError(
                f"{e}; or give the target's dimensions: --target-dims LAYERS,HIDDEN,VOCAB (its config's "
                "num_hidden_layers, hidden_size and vocab_size, e.g. 36,4096,151936 for Qwen3-8B)"
            ) from None
    ids = cfg.target.target_layer_ids or list(range(cfg.drafter.num_hidden_layers))
    mask = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else vocab - 1
    d = DraftModelConfig.from_config(cfg, hidden, vocab, layers, ids, mask)
    with torch.device("meta"):
        drafter = DFlashDrafter(d, torch.empty(vocab, hidden), torch.empty(vocab, hidden))
    target = cfg.train.needs_target or d.family.needs_target
    topk = 0 if cfg.target.store_last_layer else cfg.target.store_topk
    est = estimate(
        drafter, cfg.train, torch.device("cuda"), int(device_gib * 2**30), target_logits=target, topk=topk,
        fp8=cfg.extract.store_dtype != "target",
    )  # fmt: skip
    rows = row_budget(est, cfg.train, drafter.block_size)
    params = sum(p.numel() for p in drafter.parameters())
    route = (
        (f" (the target's distribution from its {'top-' + str(topk) if topk else 'last layer'})")
        if target
        else ""
    )
    click.echo(f"{d.family.name} drafter{route}: {params / 1e6:,.1f}M parameters; {est.line(rows)}")

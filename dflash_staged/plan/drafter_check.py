"""``dflash plan`` checks the whole drafter before it writes anything: the drafter config a run will build
(every family option against the target's dimensions), what every serving engine would mis-serve, and
whether the store the plan asks for holds the target's distribution the family or the loss needs, and,
with ``drafter.init = 'target_top'``, whether the target's top layers fit. A refusal is one line naming the
config file and the settings; a default the family scaled down to fit this target is said, not refused.
The trainer repeats the store's check against the store it finds (one planned by an older version)
through the same function (:func:`dflash_staged.model.run_drafter.store_problem`), and builds its drafter
config through :func:`~dflash_staged.model.run_drafter.run_drafter_config`.
"""

from __future__ import annotations

from dflash_staged.config import ConfigError
from dflash_staged.errors import DflashError


def check_drafter(cfg, config_path, dims, layer_ids: list[int], tokenizer) -> list[str]:
    """Refuse (``ConfigError``, one line starting with ``config_path``) a drafter that would fail after
    extraction; return the notes to print (defaults scaled to fit). ``tokenizer``: the target's."""
    from dflash_staged.model.drafters.engines import check_servable
    from dflash_staged.model.drafters.weights import validate_mask_token
    from dflash_staged.model.run_drafter import fitted_options, run_drafter_config, store_problem

    try:
        mask_id = validate_mask_token(cfg.drafter.mask_token_id, tokenizer, dims.vocab_size)
        dcfg = run_drafter_config(cfg, dims, layer_ids, mask_id)
        check_servable(dcfg)
    except ConfigError:
        raise
    except DflashError as e:
        raise ConfigError(f"{config_path}: {e}") from None
    t = cfg.target
    why = store_problem(
        cfg, t.store_last_layer, t.store_topk, t.topk_temperature, "the config stores", "set {what}"
    )
    if why:
        raise ConfigError(f"{config_path}: {why}")
    if cfg.drafter.init == "target_top":  # (auto falls back to random weights where they do not fit)
        from dflash_staged.model.drafters.init import target_top_layout

        try:
            target_top_layout(dcfg, t)
        except DflashError as e:
            raise ConfigError(f"{config_path}: {e}") from None
    return fitted_options(cfg, dcfg)

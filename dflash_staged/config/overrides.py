"""Changing a loaded config: ``dflash train --set`` over the manifest's snapshot.

Everything that shaped the plan and the stored shards stays as planned: ``train`` may change the
``[train]`` settings, ``train --replay`` also the drafter's (:data:`REPLAY_OVERRIDABLE`), and
:func:`apply_overrides` refuses anything else, naming the key.
"""

from __future__ import annotations

from dataclasses import fields
from difflib import get_close_matches
from typing import Any

from dflash_staged.config.loading import config_from_dict, tomllib
from dflash_staged.config.schema import Config, ConfigError, TrainConfig
from dflash_staged.errors import DflashError

# Settings `train --replay` may override (plain `train`: its [train] part); the rest is fixed by the shards.
REPLAY_OVERRIDABLE = {
    "drafter": {
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "block_size",
        "rms_norm_eps",
        "rope_theta",
        "dtype",
        "init",
        "layer_types",
        "sliding_window",
        "is_causal",
        "architecture",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "output_multiplier",
        "final_logit_softcapping",
        "input_embedding_scale",
        "options",
        "draft_vocab_size",
    },
    "train": {f.name for f in fields(TrainConfig)},
}


def apply_overrides(
    cfg: Config, overrides: dict[str, dict[str, Any]], allowed: dict[str, set[str]], what: str
) -> Config:
    """Return a copy of cfg with section.key values replaced; refuse keys outside `allowed`."""
    raw = cfg.to_dict()
    for section, kv in overrides.items():
        if section not in raw:
            raise ConfigError(f"--set {section}.*: no section [{section}]; the sections: {', '.join(raw)}")
        for key, value in kv.items():
            if key not in raw[section]:
                near = get_close_matches(key, list(raw[section]), n=1)
                keys = ", ".join(raw[section])
                hint = f"did you mean {section}.{near[0]}?" if near else f"its keys: {keys}"
                raise ConfigError(f"--set {section}.{key}: [{section}] has no setting {key!r}; {hint}")
            if key not in allowed.get(section, set()):
                raise ConfigError(
                    f"{section}.{key} cannot be changed for {what}: it is fixed by the "
                    f"manifest/stored shards; re-plan to change it"
                )
            raw[section][key] = value
    return config_from_dict(raw, f"<{what} overrides>")


def parse_sets(sets) -> dict:
    """['train.lr=1e-3', 'drafter.block_size=8'] -> {'train': {'lr': 0.001}, 'drafter': {'block_size': 8}}."""
    out: dict = {}
    for s in sets:
        key, sep, value = s.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise DflashError(f"--set {s!r}: use SECTION.KEY=VALUE, e.g. --set train.lr=1e-3")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value.strip()
        out.setdefault(section, {})[name] = parsed
    return out

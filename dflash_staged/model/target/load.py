"""Loading the target: the model (tiny, local or hub, whole or a tensor-parallel slice), its identity
(``target_id``), its tokenizer and the ids that end a generation.

The contract (tapped layers, ``target_id``) is specified in :mod:`dflash_staged.model.target`;
tensor-parallel loading in :mod:`dflash_staged.model.target.parallel`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from dflash_staged.config import TargetConfig
from dflash_staged.dtypes import resolve_dtype
from dflash_staged.errors import DflashError
from dflash_staged.model.target.dims import text_config
from dflash_staged.model.target.preflight import preflight_kernels
from dflash_staged.model.target.taps import Target, resolve_layer_ids

# Config keys that do not change the computation, left out of target_id.
_VOLATILE_KEYS = {
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "torch_dtype",
    "dtype",
    "_attn_implementation",
    "attn_implementation",
    "_attn_implementation_internal",
    "_commit_hash",
    "use_cache",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "experts_implementation",
    "_experts_implementation",
    "architectures",
}


def _stable_config_hash(model_config) -> str:
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in sorted(x.items()) if k not in _VOLATILE_KEYS}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    blob = json.dumps(clean(model_config.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _weights_fingerprint(path: Path) -> str:
    """Cheap fingerprint of local weight files: names, sizes, first and last MiB of each."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def target_id_of(cfg: TargetConfig, model_config) -> str:
    name = cfg.model + (f"/{cfg.gguf_file}" if cfg.gguf_file else "")
    if cfg.model.startswith("tiny:"):
        rev = f"seed{cfg.seed}"
    elif Path(cfg.model).is_dir():
        rev = "files-" + _weights_fingerprint(Path(cfg.model))
    else:
        rev = (getattr(model_config, "_commit_hash", None) or "unknown")[:12]
    return f"{name}@{rev}:cfg-{_stable_config_hash(model_config)}"


def _is_tiny(cfg: TargetConfig) -> bool:
    return cfg.model.startswith("tiny:")


def _tiny_kind(cfg: TargetConfig) -> str:
    from dflash_staged.model.target.tiny import KINDS

    kind = cfg.model.split(":", 1)[1]
    if kind not in KINDS:
        raise DflashError(
            f"target.model={cfg.model!r}: unknown tiny target; use one of "
            f"{', '.join('tiny:' + k for k in KINDS)}"
        )
    return kind


def _hf_kwargs(cfg: TargetConfig) -> dict:
    return {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}


def _load_error(cfg: TargetConfig, what: str, e: Exception) -> DflashError:
    return DflashError(
        f"cannot load the target {what} from target.model={cfg.model!r}"
        f"{f' (gguf_file={cfg.gguf_file!r})' if cfg.gguf_file else ''}: {type(e).__name__}: {e}. "
        "Check that it is a model directory or hub id; offline, the files must be local"
    )


def load_target(
    cfg: TargetConfig,
    device="cpu",
    *,
    layer_ids: list[int] | None = None,
    num_draft_layers: int = 1,
    tp: int = 1,
    logit_transform: tuple[float, float] | None = None,
) -> Target:
    """Load the target LM on ``device`` in eval mode, after the kernel preflight.

    ``layer_ids`` overrides the tapped layers; otherwise :func:`resolve_layer_ids`
    picks them from ``cfg`` and ``num_draft_layers``. ``tp > 1`` loads this process's
    slice of a tensor-parallel target (contract: :mod:`dflash_staged.model.target.parallel`).
    ``logit_transform``: the run's ``(output_multiplier, final_logit_softcapping)``, which the top-k
    are formed with (:mod:`dflash_staged.model.target.logits`); None: what the target's config says.
    """
    from dflash_staged.model.target.parallel import check_sharded, check_tp, shard_built_model, tp_kwargs

    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype, device)
    what = f"target.model={cfg.model!r}"
    if _is_tiny(cfg):
        from dflash_staged.model.target.tiny import build_tiny_model, tiny_config

        kind = _tiny_kind(cfg)
        model_config = tiny_config(kind)
        preflight_kernels(model_config, device, cfg.allow_slow_kernels)
        check_tp(model_config, tp, what)
        model = build_tiny_model(kind, seed=cfg.seed, dtype=dtype)
        if tp > 1:  # placed on this rank's device by the loading
            model = shard_built_model(model, tp, dtype, cfg.attn_implementation)
        else:
            if cfg.attn_implementation != model.config._attn_implementation:
                model.set_attn_implementation(cfg.attn_implementation)
            model.to(device)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            model_config = AutoConfig.from_pretrained(cfg.model, **_hf_kwargs(cfg))
        except (OSError, ValueError) as e:
            raise _load_error(cfg, "config", e) from None
        preflight_kernels(model_config, device, cfg.allow_slow_kernels)
        check_tp(model_config, tp, what)
        kwargs = dict(_hf_kwargs(cfg), dtype=dtype, attn_implementation=cfg.attn_implementation)
        if tp > 1:
            kwargs.update(tp_kwargs(tp))  # places this rank's slice on its own device
        elif device.type != "cpu":
            kwargs["device_map"] = {"": str(device)}
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.model, **kwargs)
        except (OSError, ValueError) as e:
            raise _load_error(cfg, "weights", e) from None
        if tp == 1 and "device_map" not in kwargs:
            model.to(device)
        model_config = model.config
    text = text_config(model_config)
    if layer_ids is None:
        layer_ids = resolve_layer_ids(cfg, text.num_hidden_layers, num_draft_layers)
    target = Target(
        model,
        layer_ids,
        target_id_of(cfg, model_config),
        device,
        model_config,
        last_layer=cfg.store_last_layer,
        topk=cfg.store_topk,
        topk_temperature=cfg.topk_temperature,
        logit_transform=logit_transform,
    )
    if tp > 1:
        check_sharded(model, target.layers, tp, what)
    return target


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer: the tiny BPE for ``tiny:*``, else AutoTokenizer from tokenizer or model."""
    if _is_tiny(cfg):
        _tiny_kind(cfg)
        from dflash_staged.model.target.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.model
    kwargs = _hf_kwargs(cfg) if source == cfg.model else {}
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise DflashError(
            f"cannot load the tokenizer from {source!r} (target.tokenizer, else target.model): "
            f"{type(e).__name__}: {e}. Offline, the files must be local"
        ) from None


def stop_token_ids(model, tokenizer=None) -> list[int]:
    """The ids that end a generation: the model's generation config, its config, the tokenizer's eos."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (
        getattr(gen, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
    ):
        if src is not None:
            ids |= {int(x) for x in (src if isinstance(src, (list, tuple)) else [src])}
    return sorted(ids)

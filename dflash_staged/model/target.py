"""The target model side of extraction and evaluation: load, tap, stop early.

Contract (extract workers, the shard store, the trainer and ``dflash eval`` rely on it):

* Tapped state ``k`` of a token is the **output of decoder layer**
  ``layer_ids[k]`` (``hidden_states[layer_ids[k] + 1]`` in transformers'
  numbering, where ``hidden_states[0]`` is the embedding output), in the
  model's dtype. The K axis follows ``layer_ids`` order.
* ``layer_ids`` is ``target.target_layer_ids`` when set, else the DFlash rule
  :func:`dflash_staged.config.dflash_target_layers` for the drafter's layer count.
* :meth:`Target.capture` takes a right-padded batch (:func:`pad_batch`) and
  returns ``[B, L, K, H]``; rows past a sample's length are padding and hold
  values that must be dropped with :func:`pack_unpadded`, which returns the real
  tokens ``[T, K, H]`` concatenated in batch order. A sample's real rows do not
  depend on what it is batched with (right padding + causal layers).
* The forward stops right after the deepest tapped layer: later layers, the
  final norm and the LM head never run. ``output_hidden_states`` is never used.
* :meth:`Target.forward_with_taps` runs the full model (logits + the same taps)
  with a KV cache; :func:`crop_cache` rolls a dense cache back. Hybrid
  (linear-attention) caches cannot be rolled back: their recurrent state only
  moves forward (see :attr:`Target.supports_crop`).
* ``Target.target_id`` names the model and its revision (hub commit, a
  fingerprint of local weight files, or the tiny seed) plus a hash of the
  architecture config; dtype and attention implementation are not part of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
from pathlib import Path

import torch

from dflash_staged.config import TargetConfig, dflash_target_layers
from dflash_staged.dtypes import resolve_dtype
from dflash_staged.model.dims import text_config
from dflash_staged.errors import DflashError
from dflash_staged.model.preflight import KernelPreflightError, is_hybrid_config, preflight_kernels  # noqa: F401 (re-export)

__all__ = ["Target", "load_target", "load_tokenizer", "resolve_layer_ids", "resolve_dtype", "pad_batch",
           "pack_unpadded", "crop_cache", "preflight_kernels", "KernelPreflightError"]

# Candidate locations of the decoder layer list, most common first.
_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers",
                "language_model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers")
# Config keys that do not change the computation, left out of target_id.
_VOLATILE_KEYS = {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype",
                  "_attn_implementation", "attn_implementation", "_attn_implementation_internal",
                  "_commit_hash", "use_cache", "output_hidden_states", "output_attentions", "return_dict",
                  "experts_implementation", "_experts_implementation", "architectures"}


class _StopForward(Exception):
    """Raised by the deepest tapped layer's hook to end the forward early."""


def resolve_layer_ids(cfg: TargetConfig, num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The tapped decoder layers: ``cfg.target_layer_ids`` if set, else the DFlash rule."""
    if cfg.target_layer_ids:
        ids, where = list(cfg.target_layer_ids), f"target.target_layer_ids={cfg.target_layer_ids}"
    else:
        ids = dflash_target_layers(num_target_layers, num_draft_layers)
        where = (f"the DFlash rule for {num_draft_layers} draft layers on a {num_target_layers}-layer "
                 f"target gives {ids}")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise DflashError(f"{where}: layer ids {bad} are out of range; the target has {num_target_layers} "
                          f"decoder layers (ids 0..{num_target_layers - 1}). Set target.target_layer_ids "
                          "to ids in that range")
    if len(set(ids)) != len(ids):
        raise DflashError(f"{where}: repeated layer ids; set target.target_layer_ids explicitly or use "
                          "fewer drafter.num_hidden_layers")
    return ids


def pad_batch(seqs, pad_id: int = 0, device=None):
    """Right-pad token sequences: ``(input_ids [B, L], attention_mask [B, L], lengths [B])``, all int64."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad_batch needs at least one sequence and no empty ones")
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    L = int(lengths.max())
    input_ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
    attention_mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
    if device is not None:
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    return input_ids, attention_mask, lengths


def pack_unpadded(captured: torch.Tensor, lengths) -> torch.Tensor:
    """Keep the real tokens of a right-padded ``[B, L, ...]`` tensor: ``[sum(lengths), ...]``, batch order."""
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=captured.device)
    keep = torch.arange(captured.shape[1], device=captured.device)[None, :] < lengths[:, None]
    return captured[keep]


def crop_cache(cache, length: int) -> None:
    """Roll a dense KV cache back to its first ``length`` tokens, in place."""
    layers = getattr(cache, "layers", ())
    if any(hasattr(layer, "recurrent_states") for layer in layers):
        raise NotImplementedError("a hybrid (linear-attention) cache cannot be cropped: its recurrent state "
                                  "cannot be rolled back; keep a copy.deepcopy of the cache and re-run instead")
    remove = cache.get_seq_length() - length
    if remove < 0 or length < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    if remove:
        cache.crop(-remove)  # a negative count means "remove this many" in every transformers version


def _find_layers(model, num_layers: int) -> torch.nn.ModuleList:
    """The decoder layer list: a known attribute path, else the only fitting ModuleList."""
    for path in _LAYER_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList) and len(obj) == num_layers:
            return obj
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers
             and not any(w in name for w in ("visual", "vision", "mtp"))]
    if len(found) != 1:
        raise DflashError(f"cannot find the {num_layers} decoder layers of {type(model).__name__} "
                          f"(candidates: {[n for n, _ in found] or 'none'}); this architecture is not supported")
    return found[0][1]


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


def _target_id(cfg: TargetConfig, model_config) -> str:
    name = cfg.model + (f"/{cfg.gguf_file}" if cfg.gguf_file else "")
    if cfg.model.startswith("tiny:"):
        rev = f"seed{cfg.seed}"
    elif Path(cfg.model).is_dir():
        rev = "files-" + _weights_fingerprint(Path(cfg.model))
    else:
        rev = (getattr(model_config, "_commit_hash", None) or "unknown")[:12]
    return f"{name}@{rev}:cfg-{_stable_config_hash(model_config)}"


class Target:
    """A loaded target LM with tapped decoder layers; build it with :func:`load_target`."""

    def __init__(self, model, layer_ids: list[int], target_id: str, device, model_config=None):
        self.model = model.eval().requires_grad_(False)
        cfg = model_config if model_config is not None else model.config
        text = text_config(cfg)
        self.num_layers: int = text.num_hidden_layers
        self.hidden_size: int = text.hidden_size
        self.vocab_size: int = text.vocab_size
        self.is_hybrid: bool = is_hybrid_config(cfg)
        self.layers = _find_layers(model, self.num_layers)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad or not layer_ids or len(set(layer_ids)) != len(layer_ids):
            raise DflashError(f"layer ids {layer_ids}: need distinct ids in 0..{self.num_layers - 1}")
        self.layer_ids: list[int] = list(layer_ids)
        self.target_id = target_id
        self.device = torch.device(device)
        self.dtype: torch.dtype = next(model.parameters()).dtype
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def supports_crop(self) -> bool:
        """Whether :func:`crop_cache` can roll this target's KV cache back (dense models only)."""
        return not self.is_hybrid

    @contextlib.contextmanager
    def _taps(self, out: torch.Tensor | None, stop: bool):
        """Hooks writing layer ``layer_ids[k]``'s output into ``out[:, :, k]`` (none with ``out=None``);
        optionally stop after the deepest."""
        deepest = max(self.layer_ids)

        def make_hook(k: int, last: bool):
            def hook(module, args, output):
                if out is not None:
                    hs = output[0] if isinstance(output, (tuple, list)) else output
                    out[:, :, k].copy_(hs)
                if last:
                    raise _StopForward
            return hook

        handles = [self.layers[i].register_forward_hook(make_hook(k, stop and i == deepest))
                   for k, i in enumerate(self.layer_ids)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _empty_taps(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, L = input_ids.shape
        return torch.empty(B, L, len(self.layer_ids), self.hidden_size, dtype=self.dtype, device=self.device)

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                keep: bool = True) -> torch.Tensor | None:
        """Tapped layer outputs ``[B, L, K, H]`` of a right-padded batch, with the forward stopped early.

        ``keep=False`` runs the same forward and keeps nothing (a tensor-parallel rank that does not
        write the shard); it returns None."""
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        out = self._empty_taps(input_ids) if keep else None
        with torch.inference_mode(), self._taps(out, stop=True):
            try:
                self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
            else:  # pragma: no cover - would mean the hook never fired
                raise RuntimeError(f"layer {max(self.layer_ids)} never ran; cannot stop the forward early")
        return out

    def forward_with_taps(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True):
        """Full forward (all layers + LM head): ``(logits [B, L, V], taps [B, L, K, H], cache)``.

        Pass the returned cache back to continue from where this call ended;
        positions continue from the cache length.
        """
        input_ids = input_ids.to(self.device)
        taps = self._empty_taps(input_ids)
        with torch.inference_mode(), self._taps(taps, stop=False):
            out = self.model(input_ids=input_ids, use_cache=use_cache, **{self._cache_kw: past_key_values})
        cache = getattr(out, "cache", None) if self._cache_kw == "cache" else getattr(out, "past_key_values", None)
        return out.logits, taps, cache


def _is_tiny(cfg: TargetConfig) -> bool:
    return cfg.model.startswith("tiny:")


def _tiny_kind(cfg: TargetConfig) -> str:
    from dflash_staged.model.tiny import KINDS
    kind = cfg.model.split(":", 1)[1]
    if kind not in KINDS:
        raise DflashError(f"target.model={cfg.model!r}: unknown tiny target; use one of "
                          f"{', '.join('tiny:' + k for k in KINDS)}")
    return kind


def _hf_kwargs(cfg: TargetConfig) -> dict:
    return {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}


def _load_error(cfg: TargetConfig, what: str, e: Exception) -> DflashError:
    return DflashError(f"cannot load the target {what} from target.model={cfg.model!r}"
                       f"{f' (gguf_file={cfg.gguf_file!r})' if cfg.gguf_file else ''}: {type(e).__name__}: {e}. "
                       "Check that it is a model directory or hub id; offline, the files must be local")


def load_target(cfg: TargetConfig, device="cpu", *, layer_ids: list[int] | None = None,
                num_draft_layers: int = 1, tp: int = 1) -> Target:
    """Load the target LM on ``device`` in eval mode, after the kernel preflight.

    ``layer_ids`` overrides the tapped layers; otherwise :func:`resolve_layer_ids`
    picks them from ``cfg`` and ``num_draft_layers``. ``tp > 1`` loads this process's
    slice of a tensor-parallel target (contract: :mod:`dflash_staged.model.parallel`).
    """
    from dflash_staged.model.parallel import check_sharded, check_tp, shard_built_model, tp_kwargs
    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype, device)
    what = f"target.model={cfg.model!r}"
    if _is_tiny(cfg):
        from dflash_staged.model.tiny import build_tiny_model, tiny_config
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
    target = Target(model, layer_ids, _target_id(cfg, model_config), device, model_config)
    if tp > 1:
        check_sharded(model, target.layers, tp, what)
    return target


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer: the tiny BPE for ``tiny:*``, else AutoTokenizer from tokenizer or model."""
    if _is_tiny(cfg):
        _tiny_kind(cfg)
        from dflash_staged.model.tiny import build_tiny_tokenizer
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer
    source = cfg.tokenizer or cfg.model
    kwargs = _hf_kwargs(cfg) if source == cfg.model else {}
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise DflashError(f"cannot load the tokenizer from {source!r} (target.tokenizer, else target.model): "
                          f"{type(e).__name__}: {e}. Offline, the files must be local") from None


def stop_token_ids(model, tokenizer=None) -> list[int]:
    """The ids that end a generation: the model's generation config, its config, the tokenizer's eos."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if src is not None:
            ids |= {int(x) for x in (src if isinstance(src, (list, tuple)) else [src])}
    return sorted(ids)

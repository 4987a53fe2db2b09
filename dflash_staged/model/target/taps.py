"""The loaded target and its forwards: which layers are tapped, the early-stopped capture, the full
forward with a KV cache, and rolling a dense cache back.

The contract (what a tapped state is, where the forward stops, what a cache allows) is specified in
:mod:`dflash_staged.model.target`; build a :class:`Target` with
:func:`dflash_staged.model.target.load_target`.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from dflash_staged.config import TargetConfig, dflash_target_layers
from dflash_staged.errors import DflashError
from dflash_staged.model.target.dims import text_config
from dflash_staged.model.target.logits import check_transform, declared_transform, topk_log_probs
from dflash_staged.model.target.preflight import is_hybrid_config

# Candidate locations of the decoder layer list, most common first.
_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "model.decoder.layers",
    "transformer.h",
    "gpt_neox.layers",
)


class _StopForward(Exception):
    """Raised by the deepest tapped layer's hook to end the forward early."""


def resolve_layer_ids(cfg: TargetConfig, num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The tapped decoder layers: ``cfg.target_layer_ids`` if set, else the DFlash rule."""
    if cfg.target_layer_ids:
        ids, where = list(cfg.target_layer_ids), f"target.target_layer_ids={cfg.target_layer_ids}"
    else:
        ids = dflash_target_layers(num_target_layers, num_draft_layers)
        where = (
            f"the DFlash rule for {num_draft_layers} draft layers on a {num_target_layers}-layer "
            f"target gives {ids}"
        )
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise DflashError(
            f"{where}: layer ids {bad} are out of range; the target has {num_target_layers} "
            f"decoder layers (ids 0..{num_target_layers - 1}). Set target.target_layer_ids "
            "to ids in that range"
        )
    if len(set(ids)) != len(ids):
        raise DflashError(
            f"{where}: repeated layer ids; set target.target_layer_ids explicitly or use "
            "fewer drafter.num_hidden_layers"
        )
    return ids


def crop_cache(cache, length: int) -> None:
    """Roll a dense KV cache back to its first ``length`` tokens, in place."""
    layers = getattr(cache, "layers", ())
    if any(hasattr(layer, "recurrent_states") for layer in layers):
        raise NotImplementedError(
            "a hybrid (linear-attention) cache cannot be cropped: its recurrent state "
            "cannot be rolled back; keep a copy.deepcopy of the cache and re-run instead"
        )
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
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList)
        and len(m) == num_layers
        and not any(w in name for w in ("visual", "vision", "mtp"))
    ]
    if len(found) != 1:
        raise DflashError(
            f"cannot find the {num_layers} decoder layers of {type(model).__name__} "
            f"(candidates: {[n for n, _ in found] or 'none'}); this architecture is not supported"
        )
    return found[0][1]


class Target:
    """A loaded target LM with tapped decoder layers; build it with :func:`load_target`."""

    def __init__(
        self,
        model,
        layer_ids: list[int],
        target_id: str,
        device,
        model_config=None,
        last_layer: bool = False,
        topk: int = 0,
        topk_temperature: float = 1.0,
        logit_transform: tuple[float, float] | None = None,
    ):
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
        # what capture() returns on its K axis: the taps, then (last_layer) the last decoder layer
        self.stored_ids: list[int] = self.layer_ids + ([self.num_layers - 1] if last_layer else [])
        self.last_layer: int | None = self.num_layers - 1 if last_layer else None
        # the target's top-k log-probabilities (topk_of), from its last layer, captured for it when not stored
        self.topk, self.topk_temperature = int(topk), float(topk_temperature) if topk else None
        self.captured_ids: list[int] = self.stored_ids + (
            [self.num_layers - 1] if topk and not last_layer else []
        )
        # the run's logit scaling ([drafter] output_multiplier, final_logit_softcapping), which the
        # top-k are formed with as the trainer forms the drafter's logits; held to what config.json
        # says where the top-k are stored (else the config's own)
        declared = declared_transform(text)
        self.logit_transform = check_transform(declared, logit_transform if topk else None, target_id)
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
    def _taps(self, out: torch.Tensor | None, stop: bool, ids: list[int] | None = None):
        """Hooks writing layer ``ids[k]``'s output (``ids``: the taps by default) into ``out[:, :, k]``
        (none with ``out=None``); optionally stop after the deepest."""
        ids = self.layer_ids if ids is None else ids
        deepest = max(ids)

        def make_hook(k: int, last: bool):
            def hook(module, args, output):
                if out is not None:
                    hs = output[0] if isinstance(output, (tuple, list)) else output
                    out[:, :, k].copy_(hs)
                if last:
                    raise _StopForward

            return hook

        last_k = max(k for k, i in enumerate(ids) if i == deepest)  # one hook stops, after the others
        handles = [
            self.layers[i].register_forward_hook(make_hook(k, stop and k == last_k))
            for k, i in enumerate(ids)
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _empty_taps(self, input_ids: torch.Tensor, k: int | None = None) -> torch.Tensor:
        B, L = input_ids.shape
        k = len(self.layer_ids) if k is None else k
        return torch.empty(B, L, k, self.hidden_size, dtype=self.dtype, device=self.device)

    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, keep: bool = True
    ) -> torch.Tensor | None:
        """The stored layers' outputs ``[B, L, K, H]`` of a right-padded batch (``K = len(stored_ids)``:
        the taps, then the last decoder layer when it is stored), with the forward stopped early.

        ``keep=False`` runs the same forward and keeps nothing (a tensor-parallel rank that does not
        write the shard); it returns None."""
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        out = self._empty_taps(input_ids, len(self.captured_ids)) if keep else None
        with torch.inference_mode(), self._taps(out, stop=True, ids=self.captured_ids):
            try:
                self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
            else:  # pragma: no cover - would mean the hook never fired
                raise RuntimeError(f"layer {max(self.captured_ids)} never ran; cannot stop the forward early")
        return out

    @torch.inference_mode()
    def topk_of(self, last: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, ...]:
        """The target's top-``topk`` next-token log-probabilities at ``topk_temperature`` from its last
        decoder layer's outputs ``last [T, H]`` (before the final norm), through its own final norm and
        head: :func:`~dflash_staged.model.target.logits.topk_log_probs` (the shapes and dtypes it gives)."""
        norm, head = self._final_norm(), self.model.get_output_embeddings()
        return topk_log_probs(last, norm, head, self.topk, self.topk_temperature, self.logit_transform, chunk)

    def _final_norm(self) -> torch.nn.Module:
        """The norm after the last decoder layer: the ``norm`` beside the layer list."""
        for _, module in self.model.named_modules():
            if getattr(module, "layers", None) is self.layers and isinstance(
                getattr(module, "norm", None), torch.nn.Module
            ):
                return module.norm
        raise DflashError(
            "the target has no final norm beside its decoder layers: its top-k cannot be computed"
        )

    def forward_with_taps(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True):
        """Full forward (all layers + LM head): ``(logits [B, L, V], taps [B, L, K, H], cache)``.

        Pass the returned cache back to continue from where this call ended;
        positions continue from the cache length.
        """
        input_ids = input_ids.to(self.device)
        taps = self._empty_taps(input_ids)
        with torch.inference_mode(), self._taps(taps, stop=False):
            out = self.model(input_ids=input_ids, use_cache=use_cache, **{self._cache_kw: past_key_values})
        cache = (
            getattr(out, "cache", None)
            if self._cache_kw == "cache"
            else getattr(out, "past_key_values", None)
        )
        return out.logits, taps, cache

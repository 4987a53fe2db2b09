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
* With ``[target] store_last_layer``, :meth:`Target.capture` also returns the
  output of the **last decoder layer** (before the final norm) as one more slice
  at the end of the K axis (``Target.stored_ids`` = the taps + that layer): the
  trainer recomputes the target's logits from it with the target's final norm and
  head (:mod:`dflash_staged.model.target.weights`).
* The forward stops right after the deepest stored layer: later layers, the
  final norm and the LM head never run. ``output_hidden_states`` is never used.
* :meth:`Target.forward_with_taps` runs the full model (logits + the same taps)
  with a KV cache; :func:`crop_cache` rolls a dense cache back. Hybrid
  (linear-attention) caches cannot be rolled back: their recurrent state only
  moves forward (see :attr:`Target.supports_crop`).
* ``Target.target_id`` names the model and its revision (hub commit, a
  fingerprint of local weight files, or the tiny seed) plus a hash of the
  architecture config; dtype and attention implementation are not part of it.

Import these names from here (the fault-injection tests replace ``load_target`` in this module).
The code is in :mod:`~dflash_staged.model.target.taps` (tapped layers, capture, the full forward,
:func:`crop_cache`), :mod:`~dflash_staged.model.target.load` (loading, ``target_id``, tokenizer,
stop tokens) and :mod:`~dflash_staged.model.target.padding` (:func:`pad_batch`, :func:`pack_unpadded`).
"""

from dflash_staged.dtypes import resolve_dtype
from dflash_staged.model.target.load import load_target, load_tokenizer, stop_token_ids
from dflash_staged.model.target.padding import pack_unpadded, pad_batch
from dflash_staged.model.target.preflight import KernelPreflightError, preflight_kernels
from dflash_staged.model.target.taps import Target, crop_cache, resolve_layer_ids

__all__ = [
    "Target",
    "load_target",
    "load_tokenizer",
    "stop_token_ids",
    "resolve_layer_ids",
    "resolve_dtype",
    "pad_batch",
    "pack_unpadded",
    "crop_cache",
    "preflight_kernels",
    "KernelPreflightError",
]

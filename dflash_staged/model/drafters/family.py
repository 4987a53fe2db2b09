"""What a drafter family is: the hooks through which the shared backbone, the trainer, the objective,
the checkpoint, ``dflash eval`` and the memory estimate meet one family's own code.

Contract (every family's folder under :mod:`dflash_staged.model.drafters` defines one :class:`Family`;
:mod:`~dflash_staged.model.drafters.registry` lists them, and nothing outside a family's folder tests
for a family by name):

* **Names.** ``name`` is ``[drafter] architecture``; ``architecture`` is what ``config.json``'s
  ``architectures`` holds (the serving runtimes dispatch on it); ``also_reads`` are other names a
  released checkpoint of the family may carry.
* **Options** (``[drafter.options]``, :attr:`DraftModelConfig.options`): the family's own settings.
  :meth:`Family.options` fills the defaults and refuses an unknown key or a bad value in one line;
  :meth:`Family.write_config` puts them into ``config.json`` where the runtimes read them, and
  :meth:`Family.read_config` reads them back, refusing a file that lacks a field the family needs.
* **Layout.** A block is ``[anchor, MASK x (B-1)]`` at positions ``a..a+B-1``. Block row ``r`` is a
  proposal for ``r >= first_row`` and predicts the token at ``a + r + (1 - first_row)``: DFlash's rows
  1..B-1 predict ``a+1..a+B-1`` (the anchor row predicts nothing), DSpark's rows 0..B-1 predict
  ``a+1..a+B`` (the anchor comes first and every row is supervised). :meth:`Family.proposals` is the
  number of proposals a block makes; a verify step checks that many drafts plus the anchor.
* **Modules.** :meth:`Family.build` adds the family's modules and buffers to the drafter, and
  :meth:`Family.build_layer` to each decoder layer; :meth:`Family.reset_parameters` initialises them
  after the backbone's init. :meth:`Family.after_layer` runs after every decoder layer on the
  block rows ``[..., B, H]`` with the pass's ``state`` (a dict: ``block_tokens [..., B]`` when known,
  anything the family records for its objective); the default leaves the rows alone.
* **Objective.** :attr:`Family.objective` is None for the DFlash objective
  (:mod:`dflash_staged.train.objective`, which draws the anchors either way), or a function of a
  :class:`FamilyBatch` returning ``(loss sum, FamilyRows)``: the differentiable weighted sum over its
  rows and what the standard statistics and the family's own (``stats``, :meth:`Family.metrics`)
  are made of. ``needs_target``: the family learns from the target's
  distribution, so a store without the target's last layer is refused before the first step.
* **Decoding.** :meth:`Family.walk` turns a block's proposal logits ``[n, V]`` and final-normed
  states ``[n, H]`` into drafts and their proposal distribution (None: the DFlash v1 rule of
  :mod:`dflash_staged.evaluate.speculative`).
* **Draft vocabulary.** ``draft_vocab_refused`` is None for a family whose head may cover a subset of
  the target's vocabulary (:mod:`dflash_staged.model.drafters.vocab`), else the reason it cannot.
* **Memory.** :meth:`Family.memory` gives the extra bytes the family's training adds: fixed (its
  tables' gradients and optimizer state are counted with the parameters) and per drafter row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.target_dist import TopK


class FamilyBatch(NamedTuple):
    """What the dispatching objective hands a family's own objective for one microbatch."""

    drafter: Any
    taps: torch.Tensor  # [T, K, H] the tapped layers (noise added)
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T]
    cu: torch.Tensor  # [N+1]
    anchors: torch.Tensor  # [A] sorted packed indices
    last: torch.Tensor | None  # [T, H] the target's last layer (before its final norm), or None
    target_norm: Any  # the target's final norm, or None
    attention: Any  # "sdpa" | "flex" | callable (the backbone's forward_train)
    step: int  # the optimizer step (0-based) and the run's length, for the family's schedules
    total_steps: int
    loss_chunk: int
    generator: torch.Generator | None
    gamma: float  # train.gamma: the position weights' decay
    topk: TopK | None = None  # the target's top-k over the T positions, without `last`


class FamilyRows(NamedTuple):
    """What a family's objective returns for one microbatch, beside its differentiable loss sum: the
    standard statistics' inputs over its ``[A, P]`` proposal rows, and its own scalar sums."""

    weight_sum: torch.Tensor  # the rows' summed position weights
    main_sum: torch.Tensor  # the weighted loss (detached) the metrics call "loss"
    hits: torch.Tensor  # [A, P] bool: the drafter's top-1 (as decoded) is the data's label
    valid: torch.Tensor  # [A, P] bool: the row has a label (and counts)
    target_hits: torch.Tensor | None  # [A, P] bool: ... is the target's argmax
    alpha: torch.Tensor | None  # [A, P] sum min(p, q): the row's acceptance rate at T = 1
    extra: dict[str, torch.Tensor]  # the family's scalar sums (its ``stats`` keys)


@dataclass
class Family:
    """One drafter family (see the module contract); subclasses override what differs from DFlash."""

    name: str
    architecture: str
    also_reads: tuple[str, ...] = ()
    first_row: int = 1
    needs_target: bool = False
    forced_causal: bool | None = None  # every layer causal (True) or bidirectional within the block
    # Why the family cannot take a draft vocabulary (``[drafter] draft_vocab_size``); None: it can
    draft_vocab_refused: str | None = None
    stats: tuple[str, ...] = ()  # the family's own scalar sums (its objective's ``extra``)
    defaults: dict[str, Any] = field(default_factory=dict)
    objective: Any = None

    # -- options and config.json -------------------------------------------------------------------
    def options(self, given: dict[str, Any] | None, dcfg=None) -> dict[str, Any]:
        """The family's options: ``given`` over the defaults; an unknown key is refused."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            known = ", ".join(sorted(self.defaults)) or "none"
            raise DflashError(
                f"drafter.options.{unknown[0]}: not an option of architecture {self.name!r} (its options: "
                f"{known})"
            )
        out = {**self.defaults, **given}
        for k, v in given.items():
            d = self.defaults[k]
            if isinstance(d, bool) or isinstance(v, bool):
                ok = isinstance(d, bool) and isinstance(v, bool)
            elif isinstance(d, float):
                ok = isinstance(v, (int, float))
                out[k] = float(v) if ok else v
            else:
                ok = isinstance(v, type(d))
            if not ok:
                raise DflashError(
                    f"drafter.options.{k}={v!r}: expected {type(d).__name__} (architecture {self.name!r})"
                )
        if dcfg is not None:
            self.fit(set(given), out, dcfg)
        self.check(out, dcfg)
        return out

    def fit(self, given: set[str], opts: dict[str, Any], dcfg) -> None:
        """Scale down, in ``opts``, the defaults (keys not in ``given``) that cannot fit this drafter's
        dimensions (``dcfg``); a value the user gave is checked, never changed. ``dflash plan`` says which
        (:func:`dflash_staged.model.run_drafter.fitted_options`)."""

    def check(self, opts: dict[str, Any], dcfg) -> None:
        """Refuse option values the family cannot use (one line naming the option)."""

    def write_config(self, dcfg, d: dict[str, Any], dflash: dict[str, Any]) -> None:
        """Add the family's fields to ``config.json`` (``d``, top level) and to its ``dflash_config``."""

    def read_config(self, d: dict[str, Any], source: str) -> dict[str, Any]:
        """The family's options from a ``config.json`` (``d``); a missing required field is refused."""
        return {}

    # -- layout and modules ------------------------------------------------------------------------
    def proposals(self, block_size: int) -> int:
        return block_size - self.first_row

    def build(self, drafter) -> None:
        """Add the family's modules to ``drafter`` (after the backbone's)."""

    def build_layer(self, layer, dcfg) -> None:
        """Add the family's modules to one decoder layer."""

    def reset_parameters(self, drafter) -> None:
        """Initialise the family's modules (after the backbone's init)."""

    def after_layer(self, drafter, index: int, x: torch.Tensor, state: dict) -> torch.Tensor:
        return x

    # -- decoding and memory -----------------------------------------------------------------------
    def walk(self, drafter, logits, hidden, anchor, temperature: float = 0.0, generator=None, **opts):
        """``(drafts [n], q)`` from a block's proposal rows: ``q`` None when greedy, else the proposal
        the drafts were drawn from, dense ``[n, V]`` or ``(ids [n, K], probs [n, K])``. The base
        returns None: the DFlash v1 rule of :mod:`dflash_staged.evaluate.speculative`. ``opts``: the
        block's ``state`` (what :meth:`after_layer` recorded) and the family's decoding options; a
        family refuses an option it does not know."""
        return None

    def metrics(self, stats: dict) -> dict:
        """The family's metrics for ``metrics.jsonl`` from the step's summed stats (its ``stats`` keys
        and the standard ones)."""
        return {}

    def memory(self, dcfg, opts: dict[str, Any], checkpointing: bool, act: int) -> tuple[int, int]:
        """(fixed bytes, bytes per drafter row) the family adds to a training step, beyond its
        parameters (counted with the backbone's); ``act``: bytes of an activation element."""
        return 0, 0


def need_field(d: dict[str, Any], name: str, source: str, family: str, where: dict | None = None):
    """``d[name]`` (or ``where[name]``), or one line naming the field a ``family`` checkpoint lacks."""
    src = d if where is None else where
    if name not in src or src[name] is None:
        raise DflashError(
            f"{source}: a {family} drafter needs the field {name!r} in config.json, and it is missing; "
            "the file is incomplete or of another family"
        )
    return src[name]

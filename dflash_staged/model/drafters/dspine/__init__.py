"""DSpine (Tencent, autumn 2026; training code in SpecForge ``specforge/algorithms/dspine/`` and
``specforge/modeling/draft/dspine.py``): the block backbone, causal within the block, with adjacent
causal injection after every layer and a refined candidate path (:mod:`.injection`), trained against
the target's frozen distribution (:mod:`.objective`).

* **Layout** as DFlash's: the anchor row, then rows 1..B-1 the proposals; every layer is causal within
  the block (``is_causal: true``), SpecForge's ``causal_block=True``.
* **Options** (``[drafter.options]``; defaults SpecForge's ``DSpineConfig``): ``transfer_rank`` 1024
  (at most the hidden size and the vocabulary less one; the default is lowered to fit, and plan says
  so), ``message_size`` 512, ``top_k`` 16, ``ce_weight`` 0.1, ``alignment_weight`` 0.5,
  ``alignment_warmup_steps`` 146, ``replacement_layers`` 3, ``replacement_probability`` 0.5,
  ``replacement_hold_ratio`` 1/6, ``replacement_end_ratio`` 1/3, ``candidate_mass_threshold`` 1e-4.
* **config.json** as SpecForge exports it: ``architectures: ["DSpineDraftModel"]``, the DFlash fields,
  and ``dspine_config`` holding every option. Tensors: the backbone's, ``injection.readouts.{i}``,
  ``injection.writes.{i}``, ``injection.{message,receiver_gate,predecessor_gate}.weight``,
  ``injection.bias``, and the buffers ``transfer_codes`` and ``transfer_ready``.
* **Decoding**: the refined candidate path (:func:`~.injection.refined_walk`).
"""

from __future__ import annotations

import math

import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.dspine.injection import AdjacentInjection, refined_walk, transfer_space
from dflash_staged.model.drafters.dspine.objective import dspine_objective
from dflash_staged.model.drafters.family import Family, need_field

INTS = ("transfer_rank", "message_size", "top_k", "alignment_warmup_steps", "replacement_layers")


class DSpine(Family):
    def fit(self, given, opts, dcfg) -> None:
        if "transfer_rank" not in given:  # SpecForge's 1024 on a target narrower than that
            opts["transfer_rank"] = min(opts["transfer_rank"], dcfg.hidden_size, dcfg.vocab_size - 1)
        if "top_k" not in given:
            opts["top_k"] = min(opts["top_k"], dcfg.vocab_size)

    def check(self, opts, dcfg) -> None:
        def bad(key, why):
            raise DflashError(f"drafter.options.{key}={opts[key]!r}: {why}")

        for key in INTS:
            if opts[key] < (0 if key in ("alignment_warmup_steps", "replacement_layers") else 1):
                bad(key, "out of range")
        if dcfg is not None:
            if not opts["transfer_rank"] <= min(dcfg.hidden_size, dcfg.vocab_size - 1):
                bad(
                    "transfer_rank",
                    f"must be at most the hidden size {dcfg.hidden_size} (and the vocabulary - 1)",
                )
            if opts["top_k"] > dcfg.vocab_size:
                bad("top_k", f"must be at most the vocabulary {dcfg.vocab_size}")
        if not 0 <= opts["ce_weight"] <= 1:
            bad("ce_weight", "must lie in [0, 1]")
        if opts["alignment_weight"] < 0:
            bad("alignment_weight", "must be >= 0")
        if not 0 <= opts["replacement_probability"] <= 1:
            bad("replacement_probability", "must lie in [0, 1]")
        if not 0 <= opts["replacement_hold_ratio"] < opts["replacement_end_ratio"] <= 1:
            bad("replacement_hold_ratio", "needs 0 <= replacement_hold_ratio < replacement_end_ratio <= 1")
        if not 0 <= opts["candidate_mass_threshold"] < 1:
            bad("candidate_mass_threshold", "must lie in [0, 1)")
        for key, v in opts.items():
            if not math.isfinite(v):
                bad(key, "must be finite")

    def write_config(self, dcfg, d, dflash) -> None:
        d["dspine_config"] = dict(dcfg.options)

    def read_config(self, d, source):
        given = need_field(d, "dspine_config", source, "DSpine")
        missing = sorted(set(self.defaults) - set(given))
        if missing:
            need_field(given, missing[0], source, "DSpine")
        return {"options": {k: given[k] for k in self.defaults}}

    def build(self, drafter) -> None:
        c, o = drafter.dcfg, drafter.dcfg.options
        drafter.injection = AdjacentInjection(
            c.hidden_size, c.num_hidden_layers, o["transfer_rank"], o["message_size"], o["replacement_layers"]
        )
        drafter.register_buffer("transfer_codes", torch.zeros(c.vocab_size, o["transfer_rank"]))
        drafter.register_buffer("transfer_ready", torch.tensor(False))

    @torch.no_grad()
    def reset_parameters(self, drafter) -> None:
        drafter.injection.reset_parameters()
        if drafter.lm_head_weight.device.type == "meta":
            return
        try:
            codes, directions = transfer_space(drafter.lm_head_weight, drafter.dcfg.options["transfer_rank"])
        except ValueError as e:
            raise DflashError(f"drafter.options.transfer_rank: {e}; lower it") from None
        drafter.transfer_codes.copy_(codes)
        for readout in drafter.injection.readouts:
            readout.weight.copy_(directions.T)
        drafter.transfer_ready.fill_(True)

    def after_layer(self, drafter, index, x, state):
        inj, codes = drafter.injection, drafter.transfer_codes
        pre = x
        x = inj(x, index, state["block_tokens"], codes, state.get("replace"))
        record = state.setdefault("record", {})
        record["pre"] = pre
        record.setdefault("features", []).append(inj.feature(x, index))
        return x

    def walk(self, drafter, logits, hidden, anchor, temperature=0.0, generator=None, **opts):
        state = opts.pop("state", None)
        if opts:
            raise DflashError(f"dflash eval: {sorted(opts)[0]} is not a decoding option of a DSpine drafter")
        pre = state["record"]["pre"][drafter.first_row :]
        drafts, cand, probs = refined_walk(drafter, logits, pre, anchor, temperature, generator)
        return drafts, ((cand, probs) if temperature > 0 else None)

    def metrics(self, stats) -> dict:
        w = float(stats["weight_sum"].clamp_min(1e-12))
        names = ("ce", "l1", "refinement", "alignment")
        out = {f"dspine_{n}": float(stats[f"dspine_{n}_sum"]) / w for n in names}
        out["dspine_coverage"] = float(stats["dspine_covered"]) / max(1.0, float(stats["dspine_counted"]))
        return out

    def memory(self, dcfg, opts, checkpointing, act):
        """The transfer codes (fp32, fixed); a row: each layer's features, the injection's message and
        gate and its input, the last layer's rows before injection and the refined state (the
        refinement's candidate head rows live in the loss chunk, recomputed in the backward)."""
        r, m, H, L = opts["transfer_rank"], opts["message_size"], dcfg.hidden_size, dcfg.num_hidden_layers
        per_row = (L * (2 * r + 3 * m + H) + H) * act + 2 * H * 4
        return dcfg.vocab_size * r * 4, per_row


FAMILY = DSpine(
    name="dspine",
    architecture="DSpineDraftModel",
    draft_vocab_refused="its transfer space and refined candidates are built over the full head, and no "
    "reference or engine maps a DSpine draft vocabulary",
    needs_target=True,
    forced_causal=True,
    defaults={
        "transfer_rank": 1024,
        "message_size": 512,
        "top_k": 16,
        "ce_weight": 0.1,
        "alignment_weight": 0.5,
        "alignment_warmup_steps": 146,
        "replacement_layers": 3,
        "replacement_probability": 0.5,
        "replacement_hold_ratio": 1 / 6,
        "replacement_end_ratio": 1 / 3,
        "candidate_mass_threshold": 1e-4,
    },
    objective=dspine_objective,
    stats=(
        "dspine_ce_sum",
        "dspine_l1_sum",
        "dspine_refinement_sum",
        "dspine_alignment_sum",
        "dspine_covered",
        "dspine_counted",
    ),
)

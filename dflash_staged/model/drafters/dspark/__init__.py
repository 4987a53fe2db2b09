"""DSpark (DeepSeek and PKU; reference ``deepseek-ai/DeepSpec`` ``deepspec/modeling/dspark/``): the block
backbone, a Markov head and a confidence head (:mod:`.heads`), trained by :mod:`.objective`.

* **Layout.** The anchor row comes first and every row is a proposal: row ``k`` (0..B-1) predicts the
  token at ``a + k + 1``, so a block of ``B`` verifies ``B`` drafts (DFlash's block of ``B``
  verifies ``B - 1``). ``config.json`` says so explicitly (``sample_from_anchor: true``): a drafter
  trained in one layout and served in the other accepts almost nothing, without an error. Attention
  is bidirectional within the block (``is_causal: false``) over the context before the anchor.
* **Options** (``[drafter.options]``; defaults DeepSpec's Qwen3 recipe and SpecForge's weights):
  ``markov_rank`` (256; 0 = no Markov head), ``markov_head_type`` (``vanilla``, ``gated``, ``rnn``),
  ``confidence_head`` (true), ``confidence_head_with_markov`` (true), and the objective's
  ``ce_weight`` 0.1, ``l1_weight`` 0.9, ``confidence_weight`` 1.0.
* **config.json**: ``architectures: ["Qwen3DSparkModel"]`` (DeepSpec's class; vLLM's and SGLang's
  DSpark models), at the top level as they read them: ``block_size``, ``target_layer_ids``,
  ``mask_token_id``, ``num_target_layers``, ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``, and
  ``num_anchors`` (DeepSpec's class requires it; it is its training sampler's, 512 in its recipe);
  ``dflash_config`` repeats the DFlash fields for loaders of the DFlash family. Tensors: the
  backbone's, ``markov_head.*`` and ``confidence_head.proj.{weight,bias}``; as for every family here,
  not the target's embedding and head (vLLM and SGLang take them from the target; DeepSpec's class
  copies them from the target before training, ``initialize_embeddings_and_head``).
* **Decoding** (:func:`~.heads.markov_walk`): rows left to right, each with the Markov bias of the
  previous draft, greedy or sampled at ``T`` from ``softmax(logits / T)``; with
  ``confidence_threshold`` > 0 (``dflash eval --confidence-threshold``) the block is cut before the
  first row whose predicted acceptance is below it, as DeepSpec's evaluator schedules verification.
"""

from __future__ import annotations

import torch

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.dspark.heads import VARIANTS, ConfidenceHead, MarkovHead, markov_walk
from dflash_staged.model.drafters.dspark.objective import dspark_objective
from dflash_staged.model.drafters.family import Family, need_field

CONFIG_FIELDS = {
    "markov_rank": "markov_rank",
    "markov_head_type": "markov_head_type",
    "enable_confidence_head": "confidence_head",
    "confidence_head_with_markov": "confidence_head_with_markov",
}
NUM_ANCHORS = 512  # written for DeepSpec's class, which requires the field (its own training sampler's)


class DSpark(Family):
    def check(self, opts, dcfg) -> None:
        def bad(key, why):
            raise DflashError(f"drafter.options.{key}={opts[key]!r}: {why}")

        if opts["markov_rank"] < 0:
            bad("markov_rank", "must be >= 0 (0 = no Markov head)")
        if opts["markov_head_type"] not in VARIANTS:
            bad("markov_head_type", f"use one of {', '.join(VARIANTS)}")
        if opts["confidence_head"] and opts["confidence_head_with_markov"] and not opts["markov_rank"]:
            bad("confidence_head_with_markov", "needs a Markov head (markov_rank > 0), or set it to false")
        for key in ("ce_weight", "l1_weight", "confidence_weight"):
            if opts[key] < 0:
                bad(key, "must be >= 0")
        if dcfg is not None and any(t != "full_attention" for t in dcfg.layer_types):
            raise DflashError("drafter.layer_types: a dspark drafter's layers are all full_attention")

    def write_config(self, dcfg, d, dflash) -> None:
        o = dcfg.options
        d.update({name: o[key] for name, key in CONFIG_FIELDS.items()})
        d.update(
            block_size=dcfg.block_size,
            target_layer_ids=list(dcfg.target_layer_ids),
            mask_token_id=dcfg.mask_token_id,
            sample_from_anchor=True,
            num_anchors=NUM_ANCHORS,
        )

    def read_config(self, d, source):
        if d.get("sample_from_anchor") is False:
            raise DflashError(
                f"{source}: sample_from_anchor is false, but a DSpark drafter's first block row is a "
                "proposal (the anchor-first layout): this checkpoint was trained in DFlash's layout"
            )
        rank = int(need_field(d, "markov_rank", source, "DSpark"))
        conf = bool(need_field(d, "enable_confidence_head", source, "DSpark"))
        opts = {
            "markov_rank": rank,
            "markov_head_type": need_field(d, "markov_head_type", source, "DSpark") if rank else "vanilla",
            "confidence_head": conf,
            "confidence_head_with_markov": bool(
                need_field(d, "confidence_head_with_markov", source, "DSpark") if conf else False
            ),
        }
        dfl = d["dflash_config"] = dict(d.get("dflash_config") or {})
        for name in ("target_layer_ids", "mask_token_id"):  # top level in DeepSpec's and vLLM's files
            dfl.setdefault(name, need_field(d, name, source, "DSpark"))
        return {"options": opts}

    def build(self, drafter) -> None:
        c, o = drafter.dcfg, drafter.dcfg.options
        if o["markov_rank"]:
            drafter.markov_head = MarkovHead(
                c.vocab_size, o["markov_rank"], c.hidden_size, o["markov_head_type"], c.draft_vocab_size
            )
        if o["confidence_head"]:
            width = c.hidden_size + (o["markov_rank"] if o["confidence_head_with_markov"] else 0)
            drafter.confidence_head = ConfidenceHead(width)

    def reset_parameters(self, drafter) -> None:
        if getattr(drafter, "markov_head", None) is not None:
            drafter.markov_head.reset_parameters()

    def walk(self, drafter, logits, hidden, anchor, temperature=0.0, generator=None, **opts):
        threshold = float(opts.pop("confidence_threshold", 0.0) or 0.0)
        opts.pop("state", None)
        if opts:
            raise DflashError(f"dflash eval: {sorted(opts)[0]} is not a decoding option of a DSpark drafter")
        drafts, rows, conf = markov_walk(drafter, logits, hidden, anchor, temperature, generator)
        n = drafts.numel()
        if threshold > 0 and conf is not None:
            low = (conf.sigmoid() < threshold).nonzero()
            n = int(low[0, 0]) if low.numel() else n
        if temperature > 0:
            return drafts[:n], torch.softmax(rows[:n].float() / temperature, -1)
        return drafts[:n], None

    def metrics(self, stats) -> dict:
        w = float(stats["weight_sum"].clamp_min(1e-12))
        out = {"dspark_ce": float(stats["dspark_ce_sum"]) / w, "dspark_l1": float(stats["dspark_l1_sum"]) / w}
        if float(stats["dspark_confidence_sum"]):
            out["dspark_confidence"] = float(stats["dspark_confidence_sum"]) / w
            out["dspark_confidence_err"] = float(stats["dspark_confidence_err_sum"]) / w
        return out

    def memory(self, dcfg, opts, checkpointing, act):
        """The Markov latent and embedding, the confidence features a row (the V x r tables are
        parameters); the loss chunk's recompute holds the Markov bias beside the logits."""
        r = opts["markov_rank"]
        per_row = (3 * r + dcfg.hidden_size + (4 * r if opts["markov_head_type"] == "rnn" else 0)) * 4
        return 0, per_row


FAMILY = DSpark(
    name="dspark",
    architecture="Qwen3DSparkModel",
    also_reads=("DSparkDraftModel",),
    first_row=0,
    needs_target=True,
    forced_causal=False,
    defaults={
        "markov_rank": 256,
        "markov_head_type": "vanilla",
        "confidence_head": True,
        "confidence_head_with_markov": True,
        "ce_weight": 0.1,
        "l1_weight": 0.9,
        "confidence_weight": 1.0,
    },
    objective=dspark_objective,
    stats=("dspark_ce_sum", "dspark_l1_sum", "dspark_confidence_sum", "dspark_confidence_err_sum"),
)

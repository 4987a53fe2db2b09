"""DFlash2 (z-lab's ``DFlash2DraftModel``): the backbone with in-block convolutions around every
sublayer and the candidate selector after the head (:mod:`.modules` holds both and their contract).

Its four settings are ``[drafter]`` fields (``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k``; they predate the families' ``[drafter.options]``) and sit in
``config.json``'s ``dflash_config``. Its objective is the DFlash one plus the selector term
(:mod:`dflash_staged.train.objective.selector`, for any drafter with a ``selector``)."""

from __future__ import annotations

from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.dflash2.modules import CandidateSelector, GroupedConv
from dflash_staged.model.drafters.family import Family

FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CONV_ROW_ELEMS = 4  # a layer's convolutions keep about 4 x (2 x taps + 1) x hidden a row


class DFlash2(Family):
    def check(self, opts, dcfg) -> None:
        if dcfg is None:
            return
        rules = (
            (
                1 <= dcfg.conv_kernel_size <= dcfg.block_size,
                f"conv_kernel_size={dcfg.conv_kernel_size} must lie in 1..block_size={dcfg.block_size}",
            ),
            (
                dcfg.conv_group_size >= 1 and dcfg.hidden_size % dcfg.conv_group_size == 0,
                f"conv_group_size={dcfg.conv_group_size} must divide hidden_size={dcfg.hidden_size}",
            ),
            (dcfg.selector_rank >= 1, f"selector_rank={dcfg.selector_rank} must be >= 1"),
            (
                1 <= dcfg.selector_top_k <= dcfg.vocab_size,
                f"selector_top_k={dcfg.selector_top_k} must lie in 1..vocab_size={dcfg.vocab_size}",
            ),
        )
        for ok, msg in rules:
            if not ok:
                raise DflashError(f"drafter config: {msg}")

    def write_config(self, dcfg, d, dflash) -> None:
        dflash.update({k: getattr(dcfg, k) for k in FIELDS})

    def read_config(self, d, source):
        dfl = d.get("dflash_config") or {}
        if any(k not in dfl for k in FIELDS):
            raise DflashError(f"{source}: a DFlash2DraftModel needs {', '.join(FIELDS)} in dflash_config")
        return {k: int(dfl[k]) for k in FIELDS}

    def build(self, drafter) -> None:
        c = drafter.dcfg
        drafter.candidate_selector = CandidateSelector(
            c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k
        )

    def build_layer(self, layer, dcfg) -> None:
        layer.attention_conv = GroupedConv(dcfg.hidden_size, dcfg.conv_kernel_size, dcfg.conv_group_size)
        layer.mlp_conv = GroupedConv(dcfg.hidden_size, dcfg.conv_kernel_size, dcfg.conv_group_size)

    def reset_parameters(self, drafter) -> None:
        for m in drafter.modules():
            if isinstance(m, (GroupedConv, CandidateSelector)):
                m.reset_parameters()

    def walk(self, drafter, logits, hidden, anchor, temperature=0.0, generator=None, **opts):
        drafts, ids, probs = drafter.candidate_selector.walk(
            logits, hidden, anchor, temperature=temperature, generator=generator
        )
        return drafts, ((ids, probs) if temperature > 0 else None)

    def memory(self, dcfg, opts, checkpointing, act):
        """Four convolutions a layer (their saved inputs and kernels), and the selector's candidates."""
        conv = CONV_ROW_ELEMS * (2 * dcfg.conv_kernel_size + 1) * dcfg.hidden_size * act
        return 0, conv * (1 if checkpointing else dcfg.num_hidden_layers) + selector_row_bytes(dcfg)


def selector_row_bytes(c) -> int:
    """The selector a row: the candidates' fp32 codebook rows, their scores and gradients."""
    return 3 * c.selector_top_k * c.selector_rank * 4


FAMILY = DFlash2(
    name="dflash2",
    architecture="DFlash2DraftModel",
    draft_vocab_refused="its candidate selector picks among the full vocabulary before any draft-to-target "
    "mapping (z-lab's reference and the serving engines)",
)

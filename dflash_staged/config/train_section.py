"""The ``[train]`` section of the config (:mod:`.schema` holds the others): every field with its
meaning and default, and the checks of its values."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_staged.config.checks import _check

ATTENTION_CHOICES = ("auto", "flex", "sdpa")  # train.attention
# train.loss terms (dflash_staged/train/objective/terms/ defines each); all but "ce" need the target's
# distribution, hence its last layer in the store ([target] store_last_layer = true)
LOSS_TERMS = ("ce", "ce_target", "kl", "rkl", "jsd", "tv", "lk", "lk_alpha")
TARGET_TERMS = tuple(t for t in LOSS_TERMS if t != "ce")


@dataclass
class TrainConfig:
    lr: float = 6e-4  # peak learning rate (AdamW)
    warmup_ratio: float = 0.04  # share of the steps spent warming the learning rate up linearly
    lr_schedule: str = "cosine"  # cosine (to 0) | wsd (warmup, stable, then linear decay to 0)
    decay_ratio: float = 0.2  # wsd: share of the steps spent decaying
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 = no clipping
    grad_accum: int = 4  # shards (planned jobs) each rank takes per optimizer step
    microbatch_tokens: int = 16384  # tokens per forward/backward: a shard is split into such microbatches
    # Drafter rows (anchors x block size) per forward/backward, the drafter's activation memory:
    # 0 = derived from the device's memory (train.memory; no cap on CPU).
    microbatch_rows: int = 0
    # Recompute each drafter layer in the backward instead of keeping its activations (less memory).
    activation_checkpointing: bool = False
    num_anchors: int = 512  # most draft blocks (anchors) drawn per sequence each time it is trained on
    gamma: float = 7.0  # loss weight decay over a block: offset k weighs exp(-(k-1)/gamma)
    noise_std: float = 0.0  # std of the Gaussian noise added to the target's features; 0 = none
    noise_schedule: str = "constant"  # constant | linear | cosine (decay to 0 over training)
    buffer_capacity: int = 8  # shards each rank holds read and verified ahead of its steps
    # Shards ready before a step; with grad_accum >= 2 also from 2+ buckets (or a full buffer).
    min_ready: int = 4
    checkpoint_every: int = 100  # steps between checkpoints (each releases the shards it covers)
    keep_checkpoints: int = 2  # most recent checkpoints kept on disk
    log_every: int = 10  # host-synchronising metrics (loss, accuracy) every N steps on CUDA
    loss_chunk: int = 4096  # positions per chunk in the LM-head + loss
    # Attention in training: "flex" (block-sparse flex_attention, CUDA), "sdpa" (dense masks), or
    # "auto" = flex on CUDA, sdpa elsewhere. See dflash_staged/model/drafters/flex.py.
    attention: str = "auto"
    # bf16 autocast of the drafter's forward on a CPU (fp32 master weights; the head and the loss stay fp32):
    # "off", "on" (refused on a CPU without AMX or AVX-512 BF16, where it would be emulated slowly) or
    # "auto" (on where /proc/cpuinfo lists amx_bf16 or avx512_bf16). CUDA always uses bf16 autocast.
    cpu_bf16: str = "off"
    # Loss weight per block offset: "decay" (exp(-(k-1)/gamma)) or "dpace" (D-PACE: detached weights
    # from the drafter's own probability of each label, smoothed by dpace_alpha; see train/objective.py).
    position_weights: str = "decay"
    dpace_alpha: float = 0.5
    # DFlash2 only: weight of the selector's top-k cross-entropy, 0 for the first selector_warmup_ratio
    # of the steps, then ramped linearly over selector_ramp_ratio; with selector_stop_gradient the
    # selector term trains only the selector (the backbone learns from the DFlash term alone).
    selector_alpha: float = 1.0
    selector_warmup_ratio: float = 0.0
    selector_ramp_ratio: float = 0.0
    selector_stop_gradient: bool = False
    seed: int = 0  # seeds the drafter's initial weights, the anchors drawn and the order shards are drawn in
    # The objective: a weighted mix of terms, e.g. { ce = 0.1, tv = 0.9 }. "ce": cross-entropy on the
    # data's next token; the others learn the target's own next-token distribution, recomputed from
    # its last layer in the store ([target] store_last_layer = true), or read from its top-k
    # log-probabilities ([target] store_topk; the tail's mass as one bucket): "ce_target" (the
    # target's argmax as the label), "kl" (forward KL to the target), "rkl" (reverse KL), "jsd", "tv" (total
    # variation, 1 - sum min(p, q)), "lk" (the LK paper's hybrid: lambda KL + (1 - lambda) TV, lambda =
    # exp(-lk_eta x the row's acceptance)) and "lk_alpha" (-log acceptance). See train/objective/.
    loss: dict[str, float] = field(default_factory=lambda: {"ce": 1.0})
    distill_temperature: float = 1.0  # both distributions at this temperature in kl/rkl/jsd/tv/lk terms
    lk_eta: float = 3.0  # "lk": how fast the blend moves from KL to TV as acceptance grows
    # DFlash2: the selector term's label: "data" (the next token) or "target" (the target's argmax).
    selector_labels: str = "data"
    # With the target's top-k log-probabilities in the store ([target] store_topk): use its first
    # target_topk (the most likely) of them; 0 = all stored. One store of top-256 serves 16 and 64.
    target_topk: int = 0

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"train.lr={self.lr}: must be > 0")
        _check(0 <= self.warmup_ratio < 1, f"train.warmup_ratio={self.warmup_ratio}: use a value in [0, 1)")
        _check(
            self.lr_schedule in ("cosine", "wsd"),
            f"train.lr_schedule={self.lr_schedule!r}: use cosine or wsd",
        )
        _check(
            0 < self.decay_ratio <= 1 and self.warmup_ratio + self.decay_ratio <= 1,
            f"train.decay_ratio={self.decay_ratio}: use a value in (0, 1 - warmup_ratio]",
        )
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"train.betas={self.betas}: give two values in [0, 1)",
        )
        _check(self.grad_clip >= 0, "train.grad_clip must be >= 0 (0 disables clipping)")
        _check(self.grad_accum >= 1, f"train.grad_accum={self.grad_accum}: must be >= 1")
        _check(self.microbatch_tokens >= 1, "train.microbatch_tokens must be >= 1")
        _check(self.microbatch_rows >= 0, "train.microbatch_rows must be >= 0 (0 = from the device's memory)")
        _check(self.num_anchors >= 1, f"train.num_anchors={self.num_anchors}: must be >= 1")
        _check(self.gamma > 0, f"train.gamma={self.gamma}: must be > 0")
        _check(self.noise_std >= 0, "train.noise_std must be >= 0")
        _check(
            self.noise_schedule in ("constant", "linear", "cosine"),
            f"train.noise_schedule={self.noise_schedule!r}: use constant, linear or cosine",
        )
        _check(self.buffer_capacity >= 1, "train.buffer_capacity must be >= 1")
        _check(
            1 <= self.min_ready <= self.buffer_capacity,
            f"train.min_ready={self.min_ready} must be between 1 and train.buffer_capacity="
            f"{self.buffer_capacity}: lower min_ready or raise the capacity",
        )
        _check(self.checkpoint_every >= 1, "train.checkpoint_every must be >= 1")
        _check(self.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1")
        _check(self.log_every >= 1, "train.log_every must be >= 1")
        _check(self.loss_chunk >= 1, "train.loss_chunk must be >= 1")
        _check(
            self.position_weights in ("decay", "dpace"),
            f"train.position_weights={self.position_weights!r}: use decay or dpace",
        )
        _check(0 <= self.dpace_alpha <= 1, f"train.dpace_alpha={self.dpace_alpha}: use a value in [0, 1]")
        _check(self.selector_alpha >= 0, f"train.selector_alpha={self.selector_alpha}: must be >= 0")
        _check(
            0 <= self.selector_warmup_ratio
            and 0 <= self.selector_ramp_ratio
            and self.selector_warmup_ratio + self.selector_ramp_ratio <= 1,
            "train.selector_warmup_ratio and selector_ramp_ratio must be >= 0 and sum to at most 1",
        )
        _check(
            self.attention in ATTENTION_CHOICES,
            f"train.attention={self.attention!r}: use one of {', '.join(ATTENTION_CHOICES)}",
        )
        _check(
            self.cpu_bf16 in ("off", "on", "auto"), f"train.cpu_bf16={self.cpu_bf16!r}: use off, on or auto"
        )
        bad = sorted(set(self.loss) - set(LOSS_TERMS))
        _check(
            not bad,
            f"train.loss.{bad[0] if bad else ''}: unknown loss term; use some of {', '.join(LOSS_TERMS)}",
        )
        _check(
            all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in self.loss.values()
            )
            and sum(self.loss.values()) > 0,
            f"train.loss={self.loss}: give each term a weight >= 0, not all 0, e.g. {{ ce = 0.1, tv = 0.9 }}",
        )
        self.loss = {k: float(v) for k, v in self.loss.items()}
        _check(
            self.distill_temperature > 0, f"train.distill_temperature={self.distill_temperature}: must be > 0"
        )
        _check(self.lk_eta >= 0, f"train.lk_eta={self.lk_eta}: must be >= 0")
        _check(self.target_topk >= 0, f"train.target_topk={self.target_topk}: must be >= 0 (0 = all stored)")
        _check(
            self.selector_labels in ("data", "target"),
            f"train.selector_labels={self.selector_labels!r}: use data or target",
        )

    @property
    def target_terms(self) -> list[str]:
        """The loss terms (weight > 0) that need the target's distribution."""
        return [k for k, v in self.loss.items() if v > 0 and k in TARGET_TERMS]

    @property
    def needs_target(self) -> bool:
        """Whether training needs the target's distribution in the store (its last layer or top-k)."""
        return bool(self.target_terms) or self.selector_labels == "target"

"""Drafter memory: the row budget splits a step without changing it, bounds the activations a
microbatch keeps, and the estimate (dflash_staged.train.memory) agrees with what autograd saves,
down to one layer at the Qwen3-8B recipe's shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_staged.config import TrainConfig
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.dflash2 import selector_row_bytes
from dflash_staged.train import memory
from dflash_staged.train.loop import microbatches
from dflash_staged.train.objective import anchor_counts, dflash_loss, sample_anchors

from helpers import make_drafter

B = 8


def drafter(hidden=256, inter=768, layers=2, heads=4, kv=2, head_dim=64, vocab=300, block=B, device="cpu"):
    return make_drafter(layers, heads, kv, block, 3, 0, vocab, hidden, inter, head_dim, device)


def shard(lengths, hidden=256, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return SimpleNamespace(
        hidden=torch.randn(T, 3, hidden, generator=g),
        input_ids=torch.randint(0, vocab - 1, (T,), generator=g),
        loss_mask=(torch.rand(T, generator=g) < 0.9).float(),
        cu_seqlens=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()),
    )


def saved_bytes(fn) -> int:
    """Bytes autograd saves for the backward while ``fn`` runs (nothing is stored: forward only), each
    saved storage counted once (a tensor saved by two ops, as a layer's normed input by q, k and v,
    is kept once)."""
    n, seen, held = [0], set(), []

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            held.append(t)  # alive until the end, so no later tensor reuses its address
            n[0] += t.untyped_storage().nbytes()
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        fn()
    return n[0]


def forward_saved(m, batch, anchors_per_seq: int) -> tuple[int, int]:
    """(saved bytes, rows) of one forward_train over ``batch``."""
    anchors = sample_anchors(batch.loss_mask, batch.cu_seqlens, B, anchors_per_seq, torch.Generator())
    n = saved_bytes(
        lambda: m.forward_train(batch.hidden.to(m.param_dtype), batch.input_ids, batch.cu_seqlens, anchors)
    )
    return n, anchors.numel() * B


def test_a_step_split_by_rows_has_the_same_loss_and_gradients():
    m, b = drafter(hidden=64, inter=128), shard([40, 24, 64, 16, 30, 50], hidden=64)
    every = 1000  # every candidate is an anchor: the anchors do not depend on the split

    def run(mbs):
        m.zero_grad(set_to_none=True)
        loss = wsum = 0.0
        for mb in mbs:
            part, st = dflash_loss(m, mb, every, 4.0, torch.Generator(), 0.0, 64, denom=1.0)
            part.backward()
            loss, wsum = loss + st["loss_sum"], wsum + st["weight_sum"]
        return loss / wsum, {n: p.grad / wsum for n, p in m.named_parameters() if p.grad is not None}

    rows = [c * B for c in anchor_counts(b.loss_mask, b.cu_seqlens, every)]
    whole = microbatches(b, 10_000)
    split = microbatches(b, 10_000, max_rows=max(rows) + 8, rows=rows)
    assert len(whole) == 1 and len(split) >= 4
    for mb in split:  # each microbatch within the budget (no sequence is over it alone)
        got = sum(c * B for c in anchor_counts(mb["loss_mask"], mb["cu_seqlens"], every))
        assert got <= max(rows) + 8
    (l1, g1), (l2, g2) = run(whole), run(split)
    assert torch.allclose(l1, l2, rtol=1e-5)
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-4, atol=1e-7), n


def test_anchor_counts_are_what_sample_anchors_draws():
    b = shard([40, 3, 64, 1, 30])
    for k in (1, 5, 1000):
        anchors = sample_anchors(b.loss_mask, b.cu_seqlens, B, k, torch.Generator().manual_seed(k))
        seq = torch.bucketize(anchors, b.cu_seqlens[1:], right=True)
        assert torch.bincount(seq, minlength=5).tolist() == anchor_counts(b.loss_mask, b.cu_seqlens, k)


def test_the_row_budget_bounds_the_saved_activations_of_a_microbatch():
    m = drafter()
    b = shard([48] * 16)
    t = TrainConfig(microbatch_tokens=16 * 48, num_anchors=16)  # the context term: this shard's tokens
    est = memory.estimate(m, t, torch.device("cpu"))
    rows = [c * B for c in anchor_counts(b.loss_mask, b.cu_seqlens, t.num_anchors)]
    budget = 3 * t.num_anchors * B
    bound = 1.2 * (est.per_row * budget + est.context)
    per_mb = []
    for mb in microbatches(b, t.microbatch_tokens, budget, rows):
        mb = SimpleNamespace(**mb)
        per_mb.append(forward_saved(m, mb, t.num_anchors))
    assert len(per_mb) >= 5 and all(r <= budget for _, r in per_mb)
    assert all(n <= bound for n, _ in per_mb), (per_mb, bound)
    whole, _ = forward_saved(m, b, t.num_anchors)
    assert whole > 2 * bound  # without the budget the same shard keeps far more


@pytest.mark.parametrize(
    "geometry,arch",
    [
        ((256, 768, 2, 4, 2, 64), "dflash"),
        ((512, 1536, 2, 8, 2, 64), "dflash"),
        ((256, 1024, 3, 4, 1, 64), "dflash"),
        ((256, 768, 2, 4, 2, 64), "dflash2"),
    ],
)
def test_the_estimate_per_row_agrees_with_saved_tensors(geometry, arch):
    hidden, inter, layers, heads, kv, hd = geometry
    extra = dict(architecture="dflash2", conv_group_size=16) if arch == "dflash2" else {}
    m = make_drafter(layers, heads, kv, B, 3, 0, 300, hidden, inter, hd, "cpu", **extra)
    est = memory.estimate(m, TrainConfig(), torch.device("cpu"))
    # the drafter's own rows: the selector's and the head's gradient buffer come after forward_train
    want = est.per_row - (selector_row_bytes(m.dcfg) if arch == "dflash2" else 0) - hidden * 4
    b = shard([128] * 8, hidden=hidden)
    (n1, r1), (n2, r2) = forward_saved(m, b, 16), forward_saved(m, b, 64)
    measured = (n2 - n1) / (r2 - r1)  # bytes a row, context and fixed terms cancelled
    assert abs(measured - want) <= 0.2 * want, (measured, want)


@pytest.mark.parametrize(
    "arch,opts",
    [
        ("dspark", {"markov_rank": 64}),
        ("dspark", {"markov_rank": 64, "markov_head_type": "rnn"}),
        ("dspine", {"transfer_rank": 64, "message_size": 64}),
    ],
)
@pytest.mark.parametrize("hidden", [256, 512])
def test_a_family_objectives_bytes_a_row_agree_with_saved_tensors(arch, opts, hidden):
    """DSpark's and DSpine's whole objective (backbone, heads, injection; their loss chunks are
    recomputed in the backward, so only their inputs stay): the estimate a row within 20%."""
    from dflash_staged.model.drafters.family import FamilyBatch
    from dflash_staged.model.target.weights import FinalNorm

    m = make_drafter(
        2, hidden // 64, 2, B, 2, 0, 300, hidden, 3 * hidden, 64, "cpu", architecture=arch, options=opts
    )
    est = memory.estimate(m, TrainConfig(), torch.device("cpu"), target_logits=True)
    b = shard([128] * 8, hidden=hidden)
    norm = FinalNorm(torch.ones(hidden), 1e-6)

    def run(k):
        a = sample_anchors(b.loss_mask, b.cu_seqlens, B, k, torch.Generator())
        fb = FamilyBatch(
            m, b.hidden[:, :2], b.input_ids, b.loss_mask, b.cu_seqlens, a, b.hidden[:, 2], norm, "sdpa",
            0, 100, 4096, torch.Generator(), 4.0,
        )  # fmt: skip
        return saved_bytes(lambda: m.family.objective(fb)), a.numel() * B

    (n1, r1), (n2, r2) = run(16), run(64)
    measured = (n2 - n1) / (r2 - r1)
    assert abs(measured - est.per_row) <= 0.2 * est.per_row, (measured, est.per_row)


def test_activation_checkpointing_keeps_less_and_changes_nothing():
    m, b = drafter(hidden=64, inter=128), shard([40, 24, 64], hidden=64)

    def step(ckpt):
        m.activation_checkpointing = ckpt
        m.zero_grad(set_to_none=True)
        loss, _ = dflash_loss(m, vars(b), 1000, 4.0, torch.Generator(), 0.0, 64)
        loss.backward()
        kept = forward_saved(m, b, 1000)[0]
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, kept

    (l1, g1, k1), (l2, g2, k2) = step(False), step(True)
    m.activation_checkpointing = False
    assert torch.allclose(l1, l2) and all(torch.allclose(g1[n], g2[n], atol=1e-6) for n in g1)
    assert k2 < k1 / 2


def test_a_budget_below_one_sequence_and_a_device_too_small_are_refused():
    m = drafter(hidden=64, inter=128)
    t = TrainConfig(num_anchors=64, microbatch_rows=100)
    est = memory.estimate(m, t, torch.device("cpu"))
    with pytest.raises(DflashError, match=r"train.microbatch_rows=100 is below one sequence's 512 rows"):
        memory.row_budget(est, t, B)
    small = memory.MemoryEstimate(est.fixed, est.per_row, est.context, est.loss, device_bytes=est.fixed * 2)
    with pytest.raises(
        DflashError, match="set train.activation_checkpointing = true, or lower train.num_anchors"
    ):
        memory.row_budget(small, TrainConfig(num_anchors=64), B)
    assert memory.row_budget(est, TrainConfig(), B) == 0  # CPU: no cap unless one is set


def test_one_layer_at_the_qwen3_8b_recipe_shapes(capsys):
    """Hidden 4096, MLP 12288, 32 heads of 128, 8 KV heads, bf16: autograd's bytes a row agree with
    the estimate; then the recipe's peak (5 layers, vocab 151,936, 512 anchors x 16) per device."""
    torch.manual_seed(0)
    m = drafter(4096, 12288, 1, 32, 8, 128, vocab=512).to(torch.bfloat16)
    m.requires_grad_(True)
    est = memory.estimate(m, TrainConfig(), torch.device("cuda"), device_bytes=0)  # bf16 activations
    b = shard([64, 64], hidden=4096, vocab=512)
    (n1, r1), (n2, r2) = forward_saved(m, b, 4), forward_saved(m, b, 12)
    measured = (n2 - n1) / (r2 - r1)
    want = est.per_row - 4096 * 2  # forward_train's rows: the head's gradient buffer comes after it
    assert abs(measured - want) <= 0.2 * want, (measured, want)
    del m
    recipe = drafter(4096, 12288, 5, 32, 8, 128, vocab=151936, block=16, device="meta")  # shapes only
    report = []
    for target in (False, True):  # with a loss on the target's distribution: its logits in the head too
        for ckpt in (False, True):
            for gib in (80, 141):
                t = TrainConfig(activation_checkpointing=ckpt)
                e = memory.estimate(
                    recipe, t, torch.device("cuda"), device_bytes=gib * 10**9, target_logits=target
                )
                report.append(
                    (target, ckpt, gib, e.max_rows, e.peak(512 * 16) / 2**30, e.per_row / 2**20, e.loss)
                )
    with capsys.disabled():
        for target, ckpt, gib, rows, peak, mib, loss in report:
            print(
                f"\nQwen3-8B drafter{', target logits' if target else ''}, activation_checkpointing={ckpt}, "
                f"{gib} GB device: {mib:.2f} MiB a row, loss chunk {loss / 2**30:.1f} GiB, "
                f"row budget {rows:,}, peak at 8,192 rows (512 anchors x 16) {peak:.1f} GiB"
            )
    assert all(rows >= 512 * 16 for _, ckpt, gib, rows, *_ in report if gib == 141 or ckpt)
    plain, with_target = report[0], report[4]  # no checkpointing, 80 GB
    assert with_target[6] == plain[6] * memory.TARGET_LOSS_BUFFERS / memory.LOSS_BUFFERS  # the head's chunk
    assert with_target[3] < plain[3]  # fewer rows fit beside the target's logits


def test_flex_padding_and_the_row_cap_are_in_the_estimate():
    """On CUDA flex pads the rows to a power of two and keeps q, k, v and the output for the padding
    too (about 6 GiB at 66K rows on the Qwen3-8B recipe); a microbatch never holds more rows than keep
    the padded q's offsets below 2**31; the row budget leaves room for the padding."""
    recipe = drafter(4096, 12288, 5, 32, 8, 128, vocab=151936, block=16, device="meta")
    t = TrainConfig(activation_checkpointing=True)
    gpu = memory.estimate(recipe, t, torch.device("cuda"), device_bytes=141 * 10**9)
    cpu = memory.estimate(recipe, t, torch.device("cpu"))
    assert cpu.pad_row == 0 and cpu.padded(66_000) == 66_000
    assert gpu.padded(66_000) == 65_536 * 2 and gpu.padded(65_536) == 65_536
    extra = gpu.peak(66_000) - (gpu.fixed + gpu.context + gpu.loss + 66_000 * gpu.per_row)
    assert 5.5 * 2**30 < extra < 7 * 2**30  # 5 layers x (2 x 4096 + 2 x 1024) x 2 bytes a padding row
    assert gpu.row_cap == 2**18 and (gpu.row_cap * 32 * 128) < 2**31 <= 2 * gpu.row_cap * 32 * 128
    rows = gpu.max_rows
    assert 0 < rows <= gpu.row_cap
    room = int(gpu.device_bytes * memory.USABLE)
    assert gpu.peak(rows) <= room  # the padding it will get fits too
    big = memory.estimate(recipe, t, torch.device("cuda"), device_bytes=10**13)  # no memory limit to speak of
    assert big.max_rows == big.row_cap

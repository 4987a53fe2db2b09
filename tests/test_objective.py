"""The training objective's rules: anchor candidates, normalisation over the optimizer step, per-block tau."""

import torch

from dflash_staged.config import TrainConfig
from dflash_staged.model.drafters.backbone import DFlashDrafter
from dflash_staged.train.distributed import Dist
from dflash_staged.train.loop import forward_backward
from dflash_staged.train.objective import (
    block_acceptance,
    block_labels,
    dflash_loss,
    sample_anchors,
    training_tau,
)
from dflash_staged.train.optim import Optimizer
from dflash_staged.train.trained_drafter import DrafterModel

from helpers import make_drafter, one_by_one, packed_batch


def test_candidates_reach_the_end_and_skip_unsupervised_next_tokens():
    # sequence 0: positions 0..9; sequence 1: positions 10..14 (its first token supervised)
    lm = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1])
    cu = torch.tensor([0, 10, 15])
    anchors = sample_anchors(
        lm, cu, block_size=8, num_anchors=100, generator=torch.Generator().manual_seed(0)
    )
    # 3: next token unsupervised; 9: last of its sequence (the next supervised token is another
    # sequence's); 11: next unsupervised; 14: last. 5..8 and 13 are anchors although a block of 8 runs
    # past the end: the old rule (a whole block inside) allowed none of sequence 0's after 2.
    assert anchors.tolist() == [1, 2, 5, 6, 7, 8, 10, 13]
    labels, valid = block_labels(torch.arange(15), lm, cu, anchors, 8)
    assert valid[:, 0].all()  # every block has a label at offset 1
    assert valid[anchors.tolist().index(8)].tolist() == [True] + [False] * 6  # 9 is the end


def test_per_block_tau_from_hand_built_hits():
    hits = torch.tensor(
        [[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool
    )
    valid = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool
    )
    accepted, blocks = block_acceptance(hits, valid)
    # rows: 2 (a miss at 3 ends the run), 0, 2 (labels past the end do not count), 3 (an unsupervised
    # label neither breaks the run nor counts), and the last row has no label: not a block
    assert (int(accepted), int(blocks)) == (7, 4)
    assert training_tau(accepted, blocks) == 1 + 7 / 4
    # per-offset accuracies multiplied out (what training tau used to be) misstate it here
    acc = [(hits & valid)[:, k].sum().item() / max(1, valid[:, k].sum().item()) for k in range(4)]
    implied = 1 + sum(torch.tensor(acc[: k + 1]).prod().item() for k in range(4))
    assert abs(implied - training_tau(accepted, blocks)) > 0.1


def test_loss_stats_count_blocks_as_decoding_would():
    m = make_drafter(block=5).eval()
    b = packed_batch([30, 12, 27], loss_mask_p=0.8, seed=2)
    _, stats = dflash_loss(m, b, num_anchors=8, gamma=4.0, generator=torch.Generator().manual_seed(3))
    anchors = sample_anchors(b["loss_mask"], b["cu_seqlens"], 5, 8, torch.Generator().manual_seed(3))
    with torch.no_grad():
        pred = one_by_one(m, b, anchors).argmax(-1)
    labels, valid = block_labels(b["input_ids"], b["loss_mask"], b["cu_seqlens"], anchors, 5)
    want = 0
    for row in range(len(anchors)):  # the leading run of hits, skipping labels that do not count
        for k in range(4):
            if not valid[row, k]:
                continue
            if pred[row, k] != labels[row, k]:
                break
            want += 1
    assert int(stats["accepted"]) == want and int(stats["blocks"]) == len(anchors)


def _grads(drafter, mbs, normalise_per_microbatch=False):
    m = DFlashDrafter(drafter.dcfg, drafter.embed_weight, drafter.lm_head_weight)
    m.load_state_dict(drafter.state_dict())
    t = TrainConfig(num_anchors=10_000, grad_clip=0.0, attention="sdpa")
    model = DrafterModel(m, t, torch.device("cpu"), rank=0)
    optim = Optimizer(model.params, t, Dist(torch.device("cpu")))
    if normalise_per_microbatch:  # the old rule: each microbatch's weighted mean, microbatches averaged
        for mb in mbs:
            loss, _ = dflash_loss(m, mb, t.num_anchors, t.gamma, model.anchor_gen)
            (loss / len(mbs)).backward()
        optim.reduce_gradients()
    else:
        stats = forward_backward(model, mbs, torch.device("cpu"), model.knobs(0, 1))
        optim.reduce_gradients(stats["weight_sum"])
    return {n: p.grad.clone() for n, p in model.params.items()}


def _split(b, cut):
    """Two microbatches: sequences [0, cut) and [cut, N)."""
    cu = b["cu_seqlens"]
    out = []
    for s, e in ((0, cut), (cut, cu.numel() - 1)):
        a, z = int(cu[s]), int(cu[e])
        out.append(
            {
                "hidden": b["hidden"][a:z],
                "input_ids": b["input_ids"][a:z],
                "loss_mask": b["loss_mask"][a:z],
                "cu_seqlens": cu[s : e + 1] - a,
            }
        )
    return out


def test_a_step_over_mixed_microbatches_equals_one_microbatch():
    drafter = make_drafter(block=4)
    b = packed_batch([41, 6, 9], loss_mask_p=0.8, seed=7)  # one long microbatch, one short one
    mixed = _grads(drafter, _split(b, 1))
    whole = _grads(drafter, [b])
    for n in whole:
        torch.testing.assert_close(mixed[n], whole[n], atol=1e-6, rtol=1e-5, msg=n)
    # ... and both are the gradient of the step's weighted mean loss
    m = DFlashDrafter(drafter.dcfg, drafter.embed_weight, drafter.lm_head_weight)
    m.load_state_dict(drafter.state_dict())
    loss, _ = dflash_loss(m, b, 10_000, TrainConfig().gamma)
    loss.backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(whole[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)
    # the old rule weighs the short microbatch's labels more: a different gradient
    old = _grads(drafter, _split(b, 1), normalise_per_microbatch=True)
    assert max((old[n] - whole[n]).abs().max() / whole[n].abs().max() for n in whole) > 0.05

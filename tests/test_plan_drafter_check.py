"""`dflash plan` checks the whole drafter before anything is written (issue 50, item 3): a family or a loss
that needs the target's distribution when the config stores neither slice, a DSpark logit transform no
engine serves, a stored top-k the loss cannot use; a default that does not fit the target is scaled, and
said."""

import pytest

from helpers import cli, write_config, write_dataset


def plan_with(tmp_path, extra):
    data = write_dataset(tmp_path / "data.jsonl", n=8)
    cfg = write_config(tmp_path / "cfg.toml", extra)
    man = tmp_path / "manifest"
    code, out = cli("plan", "--config", cfg, "--data", data, "--manifest", man)
    return code, out, man, cfg


REFUSED = [
    (
        '[drafter]\narchitecture = "dspark"\n',
        ["drafter.architecture = 'dspark'", "store_last_layer = true", "store_topk"],
    ),
    ("[train]\nloss = { kl = 1.0 }\n", ["train.loss", "store_last_layer = true", "store_topk", "ce = 1.0"]),
    (
        '[drafter]\narchitecture = "dspark"\noutput_multiplier = 2.0\n[target]\nstore_last_layer = true\n',
        ["'dspark'", "output_multiplier"],
    ),
    (
        "[train]\nloss = { kl = 1.0 }\ntarget_topk = 32\n[target]\nstore_topk = 8\n",
        ["train.target_topk = 32", "top-8", "store_topk = 32"],
    ),
    (
        "[train]\nloss = { kl = 1.0 }\ndistill_temperature = 2.0\n[target]\nstore_topk = 8\n",
        ["train.distill_temperature = 2", "topk_temperature = 1"],
    ),
    ('[drafter]\narchitecture = "dspine"\n[drafter.options]\ntransfer_rank = 4096\n', ["transfer_rank=4096"]),
    ("[drafter]\nmask_token_id = 999999\n", ["drafter.mask_token_id=999999"]),
]


@pytest.mark.parametrize("extra,words", REFUSED, ids=lambda v: v if isinstance(v, str) else None)
def test_plan_refuses_a_drafter_that_cannot_train_before_writing_anything(tmp_path, extra, words):
    code, out, man, cfg = plan_with(tmp_path, extra)
    assert code == 1, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {cfg}"), out
    assert all(w in lines[0] for w in words), (words, out)
    assert not man.exists()


def test_plan_scales_a_default_that_does_not_fit_and_says_so(tmp_path):
    """DSpine's transfer_rank default (SpecForge's 1024) on the 128-wide tiny target: lowered to 128, said
    by plan, and the drafter the trainer builds from that plan uses it."""
    from dflash_staged.config import load_config
    from dflash_staged.model.run_drafter import run_drafter_config
    from dflash_staged.model.target.dims import target_dims

    code, out, man, cfg = plan_with(
        tmp_path, '[drafter]\narchitecture = "dspine"\n[target]\nstore_last_layer = true\n'
    )
    assert code == 0, out
    assert "note: drafter.options.transfer_rank: the default 1024 does not fit this target; using 128" in out
    c = load_config(cfg)
    dcfg = run_drafter_config(c, target_dims(c.target), [1, 2], 0)
    assert dcfg.options["transfer_rank"] == 128 and dcfg.options["message_size"] == 512


def test_a_given_option_is_checked_never_changed():
    from dflash_staged.errors import DflashError

    from helpers import make_drafter

    with pytest.raises(DflashError, match="transfer_rank=200: must be at most the hidden size"):
        make_drafter(architecture="dspine", options={"transfer_rank": 200})

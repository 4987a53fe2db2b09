"""The drafter families' registry and what it refuses: one family's checkpoint warm-starting or resuming
another's run, unknown options, a config.json of an unknown architecture; and a fifth family touching
only its folder and one registry line."""

from __future__ import annotations

import pytest
import torch

from dflash_staged.config import TrainConfig
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters import registry
from dflash_staged.model.drafters.config import DraftModelConfig
from dflash_staged.model.drafters.family import Family
from dflash_staged.model.drafters.weights import save_drafter
from dflash_staged.train.trained_drafter import DrafterModel, warm_start

from helpers import make_drafter

SPARK = dict(architecture="dspark", options={"markov_rank": 4})


def test_the_registry_names_the_four_families_and_refuses_others():
    assert list(registry.FAMILIES) == ["dflash", "dflash2", "dspark", "dspine"]
    with pytest.raises(DflashError, match="drafter.architecture='eagle3': use one of 'dflash', 'dflash2'"):
        make_drafter(architecture="eagle3")
    d = make_drafter().dcfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(
        DflashError, match=r"not a drafter this project trains; expected \[\"DFlashDraftModel\"\]"
    ):
        DraftModelConfig.from_dict(d, "x/config.json")


def test_options_are_the_familys_own():
    with pytest.raises(
        DflashError, match="drafter.options.markov_rank: not an option of architecture 'dflash'"
    ):
        make_drafter(options={"markov_rank": 4})
    with pytest.raises(DflashError, match="drafter.options.markov_head_type='lstm': use one of vanilla"):
        make_drafter(architecture="dspark", options={"markov_head_type": "lstm"})
    with pytest.raises(DflashError, match="confidence_head_with_markov.*needs a Markov head"):
        make_drafter(architecture="dspark", options={"markov_rank": 0})
    assert make_drafter(**SPARK).dcfg.options["l1_weight"] == 0.9  # the defaults filled


def test_warm_starting_from_another_family_is_refused_naming_both(tmp_path):
    save_drafter(make_drafter(**SPARK), tmp_path / "spark")
    with pytest.raises(
        DflashError, match=r"it is a dspark drafter \(Qwen3DSparkModel\) and this run trains a dflash"
    ):
        warm_start(make_drafter(), tmp_path / "spark")
    fresh = make_drafter(**SPARK, seed=3)
    warm_start(fresh, tmp_path / "spark")  # the same family: every weight copied
    assert torch.equal(fresh.markov_head.markov_w2.weight, make_drafter(**SPARK).markov_head.markov_w2.weight)


def test_a_resume_with_another_family_is_refused_naming_both():
    spark = DrafterModel(make_drafter(**SPARK), TrainConfig(), torch.device("cpu"), 0)
    plain = DrafterModel(make_drafter(), TrainConfig(), torch.device("cpu"), 0)
    with pytest.raises(DflashError, match=r"holds a \['Qwen3DSparkModel'\] drafter and this run trains a"):
        plain.load_state_dict(spark.state_dict())
    spark.load_state_dict(spark.state_dict())  # its own: fine


def test_a_fifth_family_is_its_folder_and_one_registry_line(monkeypatch):
    """A family that only overrides the layout (every row a proposal, as DSpark) runs through the shared
    backbone, config.json, the memory estimate and eval with nothing else touched."""
    from dflash_staged.evaluate.speculative import DrafterProposer

    fifth = Family(name="fifth", architecture="FifthDraftModel", first_row=0, defaults={"knob": 1})
    monkeypatch.setitem(registry.FAMILIES, "fifth", fifth)
    d = make_drafter(architecture="fifth", options={"knob": 2})
    assert d.dcfg.to_dict()["architectures"] == ["FifthDraftModel"] and d.proposals == d.block_size
    assert DraftModelConfig.from_dict(d.dcfg.to_dict()).architecture == "fifth"
    ctx = torch.randn(7, 3, d.dcfg.hidden_size)
    assert DrafterProposer(d).propose(ctx, torch.arange(8)).shape == (d.block_size,)

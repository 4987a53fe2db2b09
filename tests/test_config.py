import pytest

from dflash_staged.config import Config, ConfigError, config_from_dict, dflash_target_layers, load_config


def test_tap_rule():
    assert dflash_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_target_layers(64, 5) == [1, 16, 31, 46, 61]
    assert dflash_target_layers(6, 1) == [3]


def test_tiny_config_loads():
    cfg = load_config("configs/tiny.toml")
    assert cfg.target.model == "tiny:qwen3"


@pytest.mark.parametrize(
    "body,needle",
    [
        ("[data]\nmax_len = 'x'\n", "data.max_len: expected integer"),
        ("[data]\nbogus = 1\n", "data.bogus: unknown key"),
        ("[nope]\n", "unknown section [nope]"),
        ("[train]\nbetas = [0.9]\n", "train.betas"),
        ("[data\n", "invalid TOML"),
        (
            "[drafter]\nnum_hidden_layers = 2\nlayer_types = ['full_attention']\n",
            "drafter.layer_types has 1 entries for 2",
        ),
        ("[drafter]\nnum_hidden_layers = 1\nlayer_types = ['local']\n", "drafter.layer_types has ['local']"),
        (
            "[drafter]\nnum_hidden_layers = 1\nlayer_types = ['sliding_attention']\n",
            "drafter.sliding_window=0",
        ),
        ("[train]\nattention = 'dense'\n", "train.attention='dense': use one of auto, flex, sdpa"),
    ],
)
def test_bad_config(tmp_path, body, needle):
    p = tmp_path / "c.toml"
    p.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def _extract(tmp_path, body):
    p = tmp_path / "c.toml"
    p.write_text("[extract]\n" + body)
    return load_config(p).extract


def test_lease_bounds_default_to_the_lease(tmp_path):
    """collective_timeout_s and registration_liveness_s follow lease_s unless set; extract gets one."""
    from dflash_staged.extract.options import options_from

    e = _extract(tmp_path, "lease_s = 42\n")
    assert (e.collective_timeout_s, e.registration_liveness_s) == (0.0, 0.0)  # the snapshot keeps "derived"
    assert e.collective_timeout == e.registration_liveness == 42.0
    opts = options_from("m", tmp_path, "cpu", e)
    assert (opts.lease_s, opts.collective_timeout_s) == (42.0, 42.0)
    old = Config().to_dict()  # a snapshot planned before the two settings existed
    for key in ("collective_timeout_s", "registration_liveness_s"):
        del old["extract"][key]
    old["extract"]["lease_s"] = 7.0
    e = config_from_dict(old).extract
    assert e.collective_timeout == e.registration_liveness == 7.0


def test_lease_bounds_set_explicitly_win(tmp_path):
    from dflash_staged.extract.options import options_from

    e = _extract(tmp_path, "lease_s = 42\ncollective_timeout_s = 900\nregistration_liveness_s = 5.5\n")
    assert (e.lease_s, e.collective_timeout, e.registration_liveness) == (42.0, 900.0, 5.5)
    assert options_from("m", tmp_path, "cpu", e).collective_timeout_s == 900.0


@pytest.mark.parametrize(
    "body,needle",
    [
        (
            "collective_timeout_s = -1\n",
            "extract.collective_timeout_s=-1.0: must be > 0, or 0 (the default) to use extract.lease_s",
        ),
        ("registration_liveness_s = -0.5\n", "extract.registration_liveness_s=-0.5: must be > 0"),
        ("registration_liveness_s = 'long'\n", "extract.registration_liveness_s: expected number"),
        ("collective_timeout_s = inf\n", "extract.collective_timeout_s: inf is not a finite number"),
    ],
)
def test_bad_lease_bounds_are_one_clear_line(tmp_path, body, needle):
    with pytest.raises(ConfigError) as e:
        _extract(tmp_path, body)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_manifest_planned_before_new_settings_replans_the_same(tmp_path):
    """Re-planning the same config over a manifest whose snapshot lacks settings added since is a no-op."""
    from test_manifest import fake_inputs

    from dflash_staged.manifest import Manifest

    samples, plan = fake_inputs()
    with Manifest.create(
        tmp_path / "m", config=Config(), samples=samples, plan=plan, data_path="d", data_hash="h"
    ) as m:
        old = m.meta["config"]
        del old["extract"]["collective_timeout_s"], old["extract"]["registration_liveness_s"]
        m.set_meta("config", old)
        made = m.manifest_id
    samples, plan = fake_inputs()
    with Manifest.create(
        tmp_path / "m", config=Config(), samples=samples, plan=plan, data_path="d", data_hash="h"
    ) as m:
        assert m.manifest_id == made and m.config.extract.registration_liveness == 300.0

import pytest

from dflash_staged.config import ConfigError, dflash_target_layers, load_config


def test_tap_rule():
    assert dflash_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_target_layers(64, 5) == [1, 16, 31, 46, 61]
    assert dflash_target_layers(6, 1) == [3]


def test_tiny_config_loads():
    cfg = load_config("configs/tiny.toml")
    assert cfg.target.model == "tiny:qwen3"


@pytest.mark.parametrize("body,needle", [
    ("[data]\nmax_len = 'x'\n", "data.max_len: expected integer"),
    ("[data]\nbogus = 1\n", "data.bogus: unknown key"),
    ("[nope]\n", "unknown section [nope]"),
    ("[train]\nbetas = [0.9]\n", "train.betas"),
    ("[data\n", "invalid TOML"),
    ("[drafter]\nnum_hidden_layers = 2\nlayer_types = ['full_attention']\n", "drafter.layer_types has 1 entries for 2"),
    ("[drafter]\nnum_hidden_layers = 1\nlayer_types = ['local']\n", "drafter.layer_types has ['local']"),
    ("[drafter]\nnum_hidden_layers = 1\nlayer_types = ['sliding_attention']\n", "drafter.sliding_window=0"),
    ("[train]\nattention = 'dense'\n", "train.attention='dense': use one of auto, flex, sdpa"),
])
def test_bad_config(tmp_path, body, needle):
    p = tmp_path / "c.toml"
    p.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert needle in str(e.value) and str(p) in str(e.value)

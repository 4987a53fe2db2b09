"""FP8 hidden states in the store (issue 43): the quantisation against a hand computation, the shard
format (sizes equal to the files, the bytes read back as written), the refusals, and the trainer's
dequantization on its device."""

from __future__ import annotations

import pytest
import torch

from dflash_staged.config import ConfigError, load_config
from dflash_staged.store import ShardStore, StoreMeta, StoreMismatchError, bytes_per_token
from dflash_staged.store.fp8 import FP8, FP8_MAX, dequantize, quantize
from dflash_staged.train.loop import microbatches

from helpers import cli, write_config


def bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at each element's magnitude (3 mantissa bits; the subnormal step below 2^-6)."""
    s = scale[..., None]
    return s * torch.maximum((x / torch.where(s > 0, s, 1)).abs() * 2**-4, torch.tensor(2.0**-10))


def test_round_trip_by_hand():
    # one row by hand: amax 3.0 -> scale 3/448; 1.0 -> 149.33 in e4m3 = 144 (step 16 in [128, 256)) + ...
    x = torch.tensor([[[3.0, 1.0, -0.5, 0.0]]])
    q, s = quantize(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (1, 1)
    assert float(s) == pytest.approx(3.0 / 448)
    scaled = (x / s[..., None])[0, 0]
    assert scaled.tolist() == pytest.approx([448.0, 149.333, -74.667, 0.0], rel=1e-4)
    assert q.float()[0, 0].tolist() == [448.0, 144.0, -72.0, 0.0]  # nearest e4m3 values
    y = dequantize(q, s, torch.float32)
    assert y[0, 0, 0] == pytest.approx(3.0) and y[0, 0, 3] == 0.0
    assert y[0, 0, 1] == pytest.approx(144 * 3 / 448)


@pytest.mark.parametrize("magnitude", [1e4, 1.0, 1e-4])
def test_error_within_half_a_step_at_every_magnitude(magnitude):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 256, generator=g) * magnitude
    x[5, 1, 17] = 40 * magnitude  # an outlier sets its row's scale
    q, s = quantize(x.to(torch.bfloat16))
    xb = x.to(torch.bfloat16).float()
    err = (dequantize(q, s, torch.float32) - xb).abs()
    assert bool((err <= bound(xb, s) * (1 + 1e-6)).all())
    assert float((s * FP8_MAX - xb.abs().amax(-1)).abs().max()) <= 1e-6 * 40 * magnitude  # scale = amax/448


def test_zero_rows_exact_and_non_finite_refused():
    x = torch.randn(4, 2, 8)
    x[1, 0] = 0
    q, s = quantize(x)
    assert float(s[1, 0]) == 0.0 and bool((dequantize(q, s, torch.float32)[1, 0] == 0).all())
    x[2, 1, 3] = float("inf")
    with pytest.raises(ValueError, match="inf or a NaN"):
        quantize(x)


def meta(fp8: bool, **kw) -> StoreMeta:
    d = dict(manifest_id="m", target_id="t", layer_ids=[1, 2], hidden_size=64, logical_dtype="bfloat16")
    return StoreMeta(**d, store_dtype="float8_e4m3fn" if fp8 else "target", **kw)


def shard_args(T=37, K=2, H=64):
    g = torch.Generator().manual_seed(1)
    hidden = (torch.randn(T, K, H, generator=g) * 3).to(torch.bfloat16)
    return hidden, torch.arange(T) % 50, torch.ones(T, dtype=torch.uint8), torch.tensor([0, 20, T]), [7, 8]


def test_fp8_shard_sizes_equal_the_files_and_read_back_exactly(tmp_path):
    store = ShardStore.create_or_open(tmp_path / "s8", meta(True))
    full = ShardStore.create_or_open(tmp_path / "s16", meta(False))
    hidden, ids, mask, cu, sids = shard_args()
    info = store.write_shard(0, 3, hidden, ids, mask, cu, sids)
    info16 = full.write_shard(0, 3, hidden, ids, mask, cu, sids)
    files = sum(f.stat().st_size for f in store.shard_path(0, 3).rglob("c.*"))
    assert info.nbytes == files == store.estimate_nbytes(37, 2)
    assert store.bytes_per_token == bytes_per_token(2, 64, 2, 0, "float8_e4m3fn") == 2 * (64 + 4) + 5
    assert info.nbytes / info16.nbytes < 0.55
    got = store.read_shard(0, 3, info.checksum)
    q, s = quantize(hidden)
    assert got.hidden.dtype == FP8 and torch.equal(got.hidden.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.hidden_scale, s)
    # pre-quantized states (extract's path: quantized on its device) give the very same shard
    again = store.write_shard(0, 4, q, ids, mask, cu, sids, hidden_scale=s)
    assert again.checksum == info.checksum
    # the trainer's microbatches carry the scales; dequantized they are the states within the bound
    mb = microbatches(got, 1000)[0]
    y = dequantize(mb["hidden"], mb["hidden_scale"], torch.bfloat16).float()
    assert bool(((y - hidden.float()).abs() <= bound(hidden.float(), s) * 1.01 + 1e-2).all())


def test_one_store_one_precision(tmp_path):
    ShardStore.create_or_open(tmp_path / "s", meta(False))
    with pytest.raises(StoreMismatchError, match="store_dtype='target'.*store_dtype='float8_e4m3fn'"):
        ShardStore.create_or_open(tmp_path / "s", meta(True))


def test_unknown_store_dtype_is_one_line(tmp_path):
    cfg = write_config(tmp_path / "c.toml", '[extract]\nstore_dtype = "fp4"\n')
    with pytest.raises(ConfigError, match="extract.store_dtype='fp4': use one of 'target', 'float8_e4m3fn'"):
        load_config(cfg)
    code, out = cli("plan", "--config", cfg, "--data", tmp_path / "none.jsonl", "--manifest", tmp_path / "m")
    assert code != 0 and "store_dtype" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1 and not (tmp_path / "m").exists()

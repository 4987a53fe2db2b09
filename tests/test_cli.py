"""The command line's own parsing: --set, sizes, and the --nproc relaunch."""

import pytest

from dflash_staged.cli import parse_sets, parse_size, without_option
from dflash_staged.errors import DflashError


def test_without_option_drops_both_spellings():
    # Regression: `--nproc=2` crashed the torchrun relaunch (args.index("--nproc") found nothing).
    args = ["train", "--manifest", "m", "--nproc=2", "--out", "r"]
    assert without_option(args, "--nproc") == ["train", "--manifest", "m", "--out", "r"]
    assert without_option(["--nproc", "2", "--x"], "--nproc") == ["--x"]
    assert without_option(["--nprocs=3"], "--nproc") == ["--nprocs=3"]  # another option, kept


def test_parse_sets_and_sizes():
    assert parse_sets(["train.lr=1e-3", "drafter.block_size=8", "train.keep_shards=true"]) == \
        {"train": {"lr": 1e-3, "keep_shards": True}, "drafter": {"block_size": 8}}
    with pytest.raises(DflashError, match="SECTION.KEY=VALUE"):
        parse_sets(["lr=1"])
    assert parse_size("512M") == 512 * 2**20 and parse_size("1.5T") == int(1.5 * 2**40) and parse_size("1000") == 1000
    with pytest.raises(DflashError, match="cannot read size"):
        parse_size("lots")

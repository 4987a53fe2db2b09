"""The command line's own parsing: --set, sizes, and the --nproc relaunch."""

import pytest
from click.testing import CliRunner

from dflash_staged.cli import main, parse_sets, without_option
from dflash_staged.errors import DflashError
from dflash_staged.sizes import parse_size

from helpers import TINY


def test_without_option_drops_both_spellings():
    # Regression: `--nproc=2` crashed the torchrun relaunch (args.index("--nproc") found nothing).
    args = ["train", "--manifest", "m", "--nproc=2", "--out", "r"]
    assert without_option(args, "--nproc") == ["train", "--manifest", "m", "--out", "r"]
    assert without_option(["--nproc", "2", "--x"], "--nproc") == ["--x"]
    assert without_option(["--nprocs=3"], "--nproc") == ["--nprocs=3"]  # another option, kept


def test_parse_sets_and_sizes():
    assert parse_sets(["train.lr=1e-3", "drafter.block_size=8", "train.keep_shards=true"]) == {
        "train": {"lr": 1e-3, "keep_shards": True},
        "drafter": {"block_size": 8},
    }
    with pytest.raises(DflashError, match="SECTION.KEY=VALUE"):
        parse_sets(["lr=1"])
    assert (
        parse_size("512M") == 512 * 2**20
        and parse_size("1.5T") == int(1.5 * 2**40)
        and parse_size("1000") == 1000
    )
    assert parse_size("200GiB") == parse_size("200gb") == 200 * 2**30 and parse_size("0") == 0
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("lots")


BAD_SIZES = {
    "-1G": "negative",
    "-0.5": "negative",
    "infG": "not a finite",
    "inf": "not a finite",
    "nan": "not a finite",
    "NaNT": "not a finite",
    "1e300T": "more than",
    "12Q": "cannot read",
    "": "cannot read",
    "G": "cannot read",
    "0.0001K": "less than one byte",
}


@pytest.mark.parametrize(
    "command",
    [
        ["extract", "--manifest", "m", "--store", "s"],
        ["pipeline", "--config", "c", "--data", "d", "--workdir", "w"],
        [
            "node",
            "--config",
            "c",
            "--data",
            "d",
            "--workdir",
            "w",
            "--extract-gpus",
            "0",
            "--train-gpus",
            "1",
        ],
    ],
)
def test_every_size_flag_refuses_bad_sizes_in_one_line(command):
    """Regression: `--window-bytes -1G` was taken (every claim then saw a full window on an empty one:
    extraction never started), and `infG` / `nan` escaped as an OverflowError / ValueError traceback."""
    for value, why in BAD_SIZES.items():
        res = CliRunner().invoke(main, command + ["--window-bytes", value])
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (value, res.output)
        last = res.output.strip().splitlines()[-1]
        assert last.startswith("Error: Invalid value for '--window-bytes'"), (value, res.output)
        assert why in last, (value, res.output)
        assert "Traceback" not in res.output
    for flag in ("--window", "--train-ranks") if command[0] == "extract" else ("--window",):
        res = CliRunner().invoke(main, command + [flag, "0"])
        assert res.exit_code == 2 and f"Invalid value for '{flag}'" in res.output, res.output
    if command[0] == "node":
        res = CliRunner().invoke(main, command + ["--hidden-size", "-4"])
        assert res.exit_code == 2 and "Invalid value for '--hidden-size'" in res.output, res.output


def test_window_bytes_zero_means_no_limit_and_reaches_extract(tmp_path):
    """0 (no limit) is kept, and the launchers pass it on over the config's extract.window_bytes (they
    dropped a 0); a size reaches extract in bytes."""
    for value, want in (("0", "0"), ("1.5K", "1536"), (None, None)):
        size = ["--window-bytes", value] if value else []
        res = CliRunner().invoke(
            main,
            [
                "pipeline",
                "--config",
                TINY,
                "--data",
                tmp_path / "d.jsonl",
                "--workdir",
                tmp_path / "w",
                "--dry-run",
                *size,
            ],
        )
        assert res.exit_code == 0, res.output
        line = next(x for x in res.output.splitlines() if " extract " in x)
        assert (f"--window-bytes {want}" in line) if want else ("--window-bytes" not in line), line
        assert "--trainer-coming" in line, line  # extract waits for the trainer started beside it

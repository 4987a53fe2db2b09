"""dflash data show: samples rendered as plan renders them, loss tokens marked (text, colour, HTML, a
browser)."""

import json
import re
import shutil
import subprocess
import tempfile

import pytest

from dflash_staged.manifest import Manifest

from helpers import ROOT, TINY, cli, write_config, write_dataset

EXTRA = "[data]\nmin_loss_tokens = 1\nmax_len = 64\n"
ANSWER = "paris is the answer, the data says so."


def records():
    conv = [
        {"role": "user", "content": "what is the capital of france"},
        {"role": "assistant", "content": ANSWER},
    ]
    return [
        {"messages": conv},
        {
            "conversations": [
                {"from": "human", "value": "why"},
                {"from": "gpt", "value": "the model is fast."},
            ]
        },
        {"input_ids": list(range(10, 20)), "loss_mask": [0] * 4 + [1] * 6},
        {"messages": [conv[0], {"role": "assistant", "content": "one two three " * 30}]},
    ]  # truncated to 64


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records()) + "\n")
    return p, write_config(tmp_path / "cfg.toml", EXTRA)


def test_text_view_marks_the_loss_and_reports_the_whole_file(tmp_path, data):
    p, cfg = data
    code, out = cli("data", "show", "--config", cfg, "--data", p, "-n", 2, "--no-color")
    assert code == 0, out
    assert f"[[{ANSWER}<|im_end|>]]" in out and "[[the model is fast.<|im_end|>]]" in out
    assert "what is the capital of france" in out and "[[what" not in out and "line/row 3" not in out
    assert "JSONL, 2 messages + 1 conversations (from/value) + 1 token ids" in out
    assert "truncated to 64: 1" in out
    # the whole-file figures agree with what plan puts in the manifest
    code, plan_out = cli("plan", "--config", cfg, "--data", p, "--manifest", tmp_path / "m")
    assert code == 0, plan_out
    with Manifest.open(tmp_path / "m", readonly=True) as m:
        n = len(m.sample_lengths())
        tokens = int(m.sample_lengths().sum())
        loss = sum(int(m.sample(i)[1].sum()) for i in range(n))
        longest = int(m.sample_lengths().max())
    assert f"tokens: {tokens:,}; loss tokens: {loss:,} ({loss / tokens:.1%})" in out
    assert f"max {longest}," in out and "samples: 4 of 4 records" in out


def test_chosen_lines_colour_and_html(tmp_path, data):
    p, cfg = data
    p.write_text(p.read_text() + json.dumps(records()[2]) + "\n")  # line 5 is blank, 6 a sample
    code, out = cli("data", "show", "--config", cfg, "--data", p, "--line", 3, "--row", 5, "--color")
    assert code == 0, out
    assert "line/row 3: 10 tokens, 6 carry the loss" in out and "line/row 1:" not in out
    assert "not samples (blank, bad or skipped; see the counts above): line/row 5" in out
    assert "\x1b[" in out and "[[" not in out
    page = tmp_path / "show.html"
    code, out = cli("data", "show", "--config", cfg, "--data", p, "--html", page)
    assert code == 0 and f"wrote {page} (3 sample(s))" in out, out
    html = page.read_text()
    assert f"<span class='loss'>{ANSWER}&lt;|im_end|&gt;</span>" in html
    assert "<span class='ctx'>&lt;|im_start|&gt;user\nwhat is the capital of france" in html
    assert not list(tmp_path.glob("*.tmp*")) and not list(tmp_path.glob(".show*"))


def test_a_line_past_the_end_is_one_line_and_exit_1(tmp_path):
    p = write_dataset(tmp_path / "d.jsonl", n=200)
    code, out = cli("data", "show", "--config", TINY, "--data", p, "--line", 2, "--line", 500)
    assert code == 1 and out == f"error: {p}: line 500 is past the end (the file has 200 lines)\n", out


def test_bad_record_is_one_line(tmp_path, data):
    p, cfg = data
    p.write_text(p.read_text() + json.dumps({"conversations": [{"from": "robot", "value": "x"}]}) + "\n")
    code, out = cli("data", "show", "--config", cfg, "--data", p)
    assert (
        code == 1 and out.count("\n") == 1 and f"{p}:6: field conversations[0].from: unknown role" in out
    ), out
    code, out = cli("data", "show", "--config", cfg, "--data", p, "--skip-bad", "--no-color")
    assert code == 0 and "skipped: 1 bad" in out and "e.g. " in out, out


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)"
)
def test_html_page_in_a_headless_browser_shows_the_loss(tmp_path):
    import numpy as np
    from PIL import Image

    page, shot = tmp_path / "show.html", tmp_path / "shot.png"
    cfg = write_config(tmp_path / "cfg.toml", "[data]\nmin_loss_tokens = 1\n")
    code, out = cli(
        "data",
        "show",
        "--config",
        cfg,
        "--data",
        ROOT / "demo" / "data" / "train.jsonl",
        "-n",
        2,
        "--html",
        page,
    )
    assert code == 0, out
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                "--window-size=1000,700",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    px = np.asarray(Image.open(shot).convert("RGB"))
    loss_bg = int((px == (183, 240, 177)).all(axis=-1).sum())  # .loss background #b7f0b1
    assert loss_bg > 1000, loss_bg  # the loss tokens are visibly highlighted
    assert re.search(r"loss tokens: [\d,]+ \(\d+\.\d%\)", page.read_text())

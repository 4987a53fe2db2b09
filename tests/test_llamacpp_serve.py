"""A drafter of each served family, trained here, exported by llama.cpp's converter and served by a real
``llama-server`` (built from the pinned source by ``dflash serve build``; ``.ci/run`` builds it and sets
``DFLASH_REQUIRE_LLAMA_CPP=1``, so there a missing build fails instead of skipping).

The target is the planted tiny Qwen3 (``tests/served.py``); both sides decode the same token-id prompts:
``dflash serve eval`` through the server, ``dflash eval`` (``run_eval``) in process.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from dflash_staged.errors import DflashError

from served import fitted_checkpoint, prompts, save_served_target, served_target

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def served(tmp_path_factory, llama_bin):
    root = tmp_path_factory.mktemp("served")
    tdir = save_served_target(root / "target")
    ps = prompts(3)
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p.tolist()}) + "\n" for p in ps))
    return {"root": root, "target_dir": tdir, "target": served_target(tdir), "prompts": ps, "file": path}


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_served_tau_equals_dflash_eval_step_for_step(served, family):
    """Greedy through llama-server: the outputs equal the server's plain greedy decoding, and every
    prompt's verify steps commit what ``dflash eval``'s do (tolerance: 90% of steps identical, pooled tau
    within 0.02; measured here: every step)."""
    from dflash_staged.evaluate.report import run_eval
    from dflash_staged.serve.evaluate import agreement, serve_eval

    root = served["root"] / family
    ckpt = fitted_checkpoint(
        root / "ckpt", family, served["target"], served["target_dir"], served["prompts"], NEW_TOKENS
    )
    rep = serve_eval(
        ckpt, served["target_dir"], served["file"], root / "serve", NEW_TOKENS, quiet=True, kind="cpu"
    )
    (run,) = rep["runs"]
    assert run["lossless"] == {"identical_prompts": 3, "prompts": 3}
    ev = run_eval(ckpt, str(served["target_dir"]), served["file"], NEW_TOKENS, device="cpu", quiet=True)
    a = agreement(run["per_prompt"], ev["per_prompt"])
    assert [r["tokens"] for r in run["per_prompt"]] == [r["tokens"] for r in ev["per_prompt"]]
    steps = ([r["accepted"] for r in run["per_prompt"]], [r["accepted"] for r in ev["per_prompt"]])
    assert a["identical_step_share"] >= 0.9, steps
    assert abs(a["tau_difference"]) <= 0.02, a
    assert run["tau"] > 2.0, run["tau"]  # the fitted drafter is accepted: not a comparison of rejections
    assert (root / "serve" / "logs" / "plain-f32.log").is_file()
    assert (root / "serve" / "serve_eval.json").is_file()


def test_server_is_stopped_on_every_exit_path(served, llama_bin, tmp_path):
    """An error inside the block, and the server's own death, each end with no server left running."""
    from dflash_staged.serve.llamacpp.convert import convert
    from dflash_staged.serve.llamacpp.server import LlamaServer

    gguf = convert(served["target_dir"], served["root"] / "target-f32.gguf", "f32", quiet=True)
    srv = LlamaServer(llama_bin, gguf, tmp_path / "a.log")
    with pytest.raises(RuntimeError), srv:
        pid = srv.proc.pid
        assert srv.complete([5, 6, 7], 4)["tokens"]
        raise RuntimeError("the caller failed")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with LlamaServer(llama_bin, gguf, tmp_path / "b.log") as srv:
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        with pytest.raises(DflashError, match="llama-server died"):
            srv.complete([5, 6, 7], 4)
    assert (tmp_path / "a.log").read_text(errors="replace").count("llama-server") >= 1


def test_unservable_drafters_are_refused_in_one_line(served, tmp_path):
    from dflash_staged.model.drafters.weights import read_drafter_config
    from dflash_staged.serve.evaluate import llama_spec_type

    ckpt = served["root"] / "dspark" / "ckpt"
    if not ckpt.is_dir():
        pytest.skip("needs the dspark checkpoint of the test above")
    dcfg = read_drafter_config(ckpt)
    assert llama_spec_type(dcfg, "x") == "draft-dspark"
    dcfg.options["markov_head_type"] = "gated"
    with pytest.raises(DflashError, match="vanilla"):
        llama_spec_type(dcfg, "x")
    dcfg.architecture = "dspine"
    with pytest.raises(DflashError, match="no serving engine"):
        llama_spec_type(dcfg, "x")


def test_a_killed_command_takes_its_server_with_it(served, llama_bin, tmp_path):
    """``kill -9`` of the process that started llama-server: the kernel kills the server too (no orphan
    holding the port and the cores)."""
    import subprocess
    import sys
    import time

    from dflash_staged.procs import HOST, pid_alive
    from dflash_staged.serve.llamacpp.convert import convert

    gguf = convert(served["target_dir"], served["root"] / "target-f32.gguf", "f32", quiet=True)
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from dflash_staged.serve.llamacpp.server import LlamaServer\n"
        f"s = LlamaServer(Path({str(llama_bin)!r}), Path({str(gguf)!r}), Path({str(tmp_path / 's.log')!r}))\n"
        "s.__enter__()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server = int(p.stdout.readline())
    assert pid_alive(HOST, server, None)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 10
    while pid_alive(HOST, server, None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(HOST, server, None)


def test_export_command_and_q8_0_serving(served, tmp_path):
    """``dflash serve export`` writes the GGUF files with llama.cpp's converter and the server line; at q8_0
    (llama.cpp's defaults: f16 caches, flash attention) the drafter still serves losslessly."""
    from click.testing import CliRunner

    from dflash_staged.cli import main
    from dflash_staged.serve.evaluate import serve_eval

    ckpt = served["root"] / "dflash2" / "ckpt"
    if not ckpt.is_dir():
        ckpt = fitted_checkpoint(
            tmp_path / "ckpt",
            "dflash2",
            served["target"],
            served["target_dir"],
            served["prompts"],
            NEW_TOKENS,
        )
    args = ["serve", "export", "--drafter", str(ckpt), "--target", str(served["target_dir"])]
    r = CliRunner().invoke(
        main, [*args, "--out", str(tmp_path / "gguf"), "--outtype", "q8_0", "--with-target"]
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "gguf" / "drafter-q8_0.gguf").is_file() and (
        tmp_path / "gguf" / "target-q8_0.gguf"
    ).is_file()
    assert "--spec-type draft-dflash --spec-draft-n-max 7" in r.output
    rep = serve_eval(
        ckpt,
        served["target_dir"],
        served["file"],
        tmp_path / "serve",
        NEW_TOKENS,
        outtypes=("q8_0",),
        n_max=[3, 7],
        quiet=True,
        kind="cpu",
    )
    assert [(x["kv_cache"], x["flash_attn"], x["n_max"]) for x in rep["runs"]] == [
        ("f16", "auto", 3),
        ("f16", "auto", 7),
    ]
    for run in rep["runs"]:
        assert run["lossless"] == {"identical_prompts": 3, "prompts": 3}
        assert run["tau"] > 1.5 and run["step_ms"]["drafter"] > 0
    assert [x["n_max"] for x in rep["recommended"]] in ([3], [7])

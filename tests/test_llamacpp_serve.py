"""A drafter of each served family, trained here, exported by llama.cpp's converter and served by a real
``llama-server`` (built from the pinned source by ``dflash serve build``; ``.ci/run`` builds it and sets
``DFLASH_REQUIRE_LLAMA_CPP=1``, so there a missing build fails instead of skipping).

The target is the planted tiny Qwen3 (``tests/served.py``); both sides decode the same token-id prompts:
``dflash serve eval`` through the server, ``dflash eval`` (``run_eval``) in process.
"""

from __future__ import annotations

import json
import os
import platform
import signal
from pathlib import Path

import pytest
import torch

from dflash_staged.config import load_config
from dflash_staged.errors import DflashError

from served import fitted_checkpoint, judge_steps, prompts, save_served_target, served_target

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def served(tmp_path_factory, llama_bin):
    root = tmp_path_factory.mktemp("served")
    tdir = save_served_target(root / "target")
    ps = prompts(3)
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p.tolist()}) + "\n" for p in ps))
    return {"root": root, "target_dir": tdir, "target": served_target(tdir), "prompts": ps, "file": path}


def fitted(served, family: str, draft_vocab: int = 0):
    """The module's drafter of ``family`` fitted to the planted target (trained once, then reused); with
    ``draft_vocab`` > 0, over a draft vocabulary of that many rows."""
    ckpt = served["root"] / (f"{family}-v{draft_vocab}" if draft_vocab else family) / "ckpt"
    if not (ckpt / "config.json").is_file():
        args = (served["target"], served["target_dir"], served["prompts"], NEW_TOKENS)
        fitted_checkpoint(ckpt, family, *args, draft_vocab=draft_vocab)
    return ckpt


@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_served_tau_equals_dflash_eval_step_for_step(served, family):
    """Greedy through llama-server: the outputs equal the server's plain greedy decoding and ``dflash
    eval``'s, and every served verify step but each prompt's final (truncated) one commits what the same
    drafter commits in this process at that position, except where the drafter is at a near tie
    (``judge_steps``: a 1e-3 perturbation of its weights changes the step; test_regenerate_server measures
    the kernels' disagreement on this CPU far below that). Stated bound: at most one near-tie step a
    prompt. Measured on an AMD EPYC: every step identical, 3-10 of 117 positions near ties by that test."""
    from dflash_staged.evaluate.report import run_eval
    from dflash_staged.serve.evaluate import serve_eval
    from dflash_staged.serve.report import agreement

    root = served["root"] / family
    ckpt = fitted(served, family)
    rep = serve_eval(
        ckpt,
        served["target_dir"],
        served["file"],
        root / "serve",
        NEW_TOKENS,
        quiet=True,
        kind="cpu",
    )
    (run,) = rep["runs"]
    assert run["lossless"] == {"identical_prompts": 3, "prompts": 3}
    assert run["repack"] == "on" and run["baseline"]["repack"] == "on"
    ev = run_eval(ckpt, str(served["target_dir"]), served["file"], NEW_TOKENS, device="cpu", quiet=True)
    assert [r["tokens"] for r in run["per_prompt"]] == [r["tokens"] for r in ev["per_prompt"]]
    for prompt, r in zip(served["prompts"], run["per_prompt"]):
        same, tie, wide = judge_steps(ckpt, served["target"], prompt, r["tokens"], r["accepted"])
        assert wide == [] and len(tie) <= 1, (r["line"], r["accepted"], tie, wide)
        assert len(same) >= len(r["accepted"]) - 2
    a = agreement(run["per_prompt"], ev["per_prompt"])
    assert a["final_steps_excluded"] == 3 and a["steps"] >= 15
    assert run["tau"] > 2.0, run["tau"]  # the fitted drafter is accepted: not a comparison of rejections
    assert (root / "serve" / "serve_eval.json").is_file()


DRAFT_VOCAB = 256  # of the target's 2,048 ids: every token of the prompts and their continuations inside


def test_a_dspark_drafter_with_a_draft_vocabulary_serves_step_for_step(served):
    """A DSpark drafter whose head is 256 of the target's 2,048 rows (``lm_head.weight`` + ``d2t``):
    llama.cpp's converter writes its ``d2t`` as absolute target ids (its own range and uniqueness checks
    passed), the server maps each draft row back through it, the outputs equal plain greedy decoding and
    ``dflash eval``'s, and every served step commits what ``dflash eval``'s drafter commits there (the
    judge of the test above, the same bounds)."""
    from safetensors import safe_open

    from dflash_staged.evaluate.report import run_eval
    from dflash_staged.model.drafters.vocab import ids_of
    from dflash_staged.serve.evaluate import serve_eval

    ckpt = fitted(served, "dspark", DRAFT_VOCAB)
    assert json.loads((ckpt / "config.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert f.get_slice("lm_head.weight").get_shape() == [DRAFT_VOCAB, 128]
        assert f.get_slice("markov_head.markov_w2.weight").get_shape() == [DRAFT_VOCAB, 16]
        ids = ids_of(f.get_tensor("d2t"))
    out = served["root"] / f"dspark-v{DRAFT_VOCAB}" / "serve"
    rep = serve_eval(ckpt, served["target_dir"], served["file"], out, NEW_TOKENS, quiet=True, kind="cpu")
    conversion = (out / "gguf" / "drafter-f32.gguf.log").read_text()
    assert f"d2t,{' ' * 26} --> I64, shape = {{{DRAFT_VOCAB}}}" in conversion, conversion[-2000:]
    (run,) = rep["runs"]
    server_log = Path(run["log"]).read_text(errors="replace")  # (token pieces: bytes)
    assert f"DFlash using d2t mapping (draft_vocab_size = {DRAFT_VOCAB})" in server_log
    assert run["lossless"] == {"identical_prompts": 3, "prompts": 3}
    ev = run_eval(ckpt, str(served["target_dir"]), served["file"], NEW_TOKENS, device="cpu", quiet=True)
    assert [r["tokens"] for r in run["per_prompt"]] == [r["tokens"] for r in ev["per_prompt"]]
    inside = set(ids.tolist())
    for prompt, r in zip(served["prompts"], run["per_prompt"]):
        assert set(r["tokens"]) <= inside  # every output token a draft could have proposed
        same, tie, wide = judge_steps(ckpt, served["target"], prompt, r["tokens"], r["accepted"])
        assert wide == [] and len(tie) <= 1, (r["line"], r["accepted"], tie, wide)
        assert len(same) >= len(r["accepted"]) - 2
    assert run["tau"] > 2.0, run["tau"]  # drafts mapped back to the right target ids are accepted


def test_a_dflash_drafter_with_a_draft_vocabulary_is_refused_for_llama_cpp(tmp_path):
    """llama.cpp's converter writes ``d2t`` only for DSpark: ``dflash serve eval`` and ``serve export`` of
    a DFlash drafter with a draft vocabulary stop in one line before building or converting anything
    (no llama.cpp build needed)."""
    from click.testing import CliRunner

    from dflash_staged.cli import main
    from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
    from dflash_staged.model.drafters.weights import save_drafter
    from dflash_staged.model.target.tiny import MASK, VOCAB

    from served import LAYERS

    cfg = load_config("configs/tiny.toml")
    cfg.drafter.dtype, cfg.drafter.architecture, cfg.drafter.draft_vocab_size = "float32", "dflash", 64
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(VOCAB, 128, generator=g), torch.randn(VOCAB, 128, generator=g)
    ids = torch.randperm(VOCAB, generator=g)[:64].sort().values
    dcfg = DraftModelConfig.from_config(cfg, 128, VOCAB, 6, LAYERS, MASK)
    ckpt = save_drafter(DFlashDrafter(dcfg, embed, head, ids), tmp_path / "ckpt")
    runs = {
        "eval": ["--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "eval"), "--kind", "cpu"],
        "export": ["--out", str(tmp_path / "export")],
    }
    for cmd, rest in runs.items():
        args = ["serve", cmd, "--drafter", str(ckpt), "--target", str(tmp_path / "target"), *rest]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "draft_vocab_size=64" in lines[0]
        assert "only for DSpark" in lines[0], lines
    assert not (tmp_path / "eval").exists() and not (tmp_path / "export").exists()


def test_the_planted_target_has_no_near_tie_on_the_served_prompts(served):
    """What the token-for-token checks above rest on: every greedy step of the planted target on the
    served prompts has its top two logits at least 5e-4 of their spread apart (measured: 7.5e-4 at the
    least), far above the kernels' disagreement (about 2e-6, test_regenerate_server)."""
    from planted import greedy_continuation

    for p in served["prompts"]:
        out = greedy_continuation(served["target"], p, NEW_TOKENS)
        with torch.inference_mode():
            logits, _, _ = served["target"].forward_with_taps(out[None])
        steps = logits[0, p.numel() - 1 : -1]
        top = steps.topk(2, -1).values
        assert float(((top[:, 0] - top[:, 1]) / steps.std(-1)).min()) > 5e-4


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
        with pytest.raises(DflashError, match="llama-server died \\(killed by SIGKILL\\)"):
            srv.complete([5, 6, 7], 4)


def test_unservable_drafters_are_refused_in_one_line():
    from types import SimpleNamespace

    from dflash_staged.serve.evaluate import llama_spec_type

    dcfg = SimpleNamespace(architecture="dspark", options={"markov_rank": 16, "markov_head_type": "vanilla"})
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


@pytest.mark.slow  # 30-70 s: the default suite's 12 minutes; CI runs it (.ci/run)
def test_export_command_and_q8_0_serving(served, tmp_path):
    """``dflash serve export`` writes the GGUF files with llama.cpp's converter and the server line; at q8_0
    (llama.cpp's defaults: f16 caches, flash attention) the drafter still serves losslessly."""
    from click.testing import CliRunner

    from dflash_staged.cli import main
    from dflash_staged.serve.evaluate import serve_eval

    ckpt = fitted(served, "dflash2")
    args = ["serve", "export", "--drafter", str(ckpt), "--target", str(served["target_dir"])]
    r = CliRunner().invoke(
        main, [*args, "--out", str(tmp_path / "gguf"), "--outtype", "q8_0", "--with-target"]
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "gguf" / "drafter-q8_0.gguf").is_file() and (
        tmp_path / "gguf" / "target-q8_0.gguf"
    ).is_file()
    assert "--spec-type draft-dflash --spec-draft-n-max 7 --spec-draft-p-min 0" in r.output
    assert ("--no-repack" in r.output) == (platform.machine() == "x86_64")
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
        assert run["repack"] in ("on", "off after SIGSEGV while loading")  # the report says which


def wrapper(llama_bin, dir, before: str):
    """A ``llama-server`` in ``dir/bin`` that runs the shell lines ``before`` (with ``$*`` its arguments),
    then the real server: a crash of llama.cpp's, planted where this CPU has none."""
    (dir / "bin").mkdir(parents=True)
    w = dir / "bin" / "llama-server"
    w.write_text(f'#!/bin/sh\n{before}\nLD_LIBRARY_PATH={llama_bin} exec {llama_bin}/llama-server "$@"\n')
    w.chmod(0o755)
    return dir / "bin"


SEGV_UNLESS_NO_REPACK = (
    'case " $* " in *" --no-repack "*) ;; '
    '*) echo "load_tensors: AMX model buffer size = 1.00 MiB"; kill -SEGV $$ ;; esac'
)


def test_a_crash_while_repacking_is_retried_once_without_it_and_reported(
    served, llama_bin, tmp_path, monkeypatch
):
    """llama.cpp's AMX repacking segfaults on some Xeons while it loads (llama.cpp #20824): the server is
    started once more with --no-repack, said in one line, and serve eval's report records it for the
    baseline and for every run; a server that crashes without repacking too is one line naming SIGSEGV."""
    from dflash_staged.serve.llamacpp import build as llama_build
    from dflash_staged.serve.llamacpp.convert import convert
    from dflash_staged.serve.llamacpp.server import LlamaServer

    bin_dir = wrapper(llama_bin, tmp_path / "amx", SEGV_UNLESS_NO_REPACK)
    gguf = convert(served["target_dir"], served["root"] / "target-f32.gguf", "f32", quiet=True)
    said: list[str] = []
    with LlamaServer(bin_dir, gguf, tmp_path / "s.log", say=said.append) as srv:
        assert srv.repack == "off after SIGSEGV while loading" and "--no-repack" in srv.command(1)
        assert srv.complete([5, 6, 7], 4)["tokens"]
    assert len(said) == 1 and "killed by SIGSEGV while loading" in said[0] and "--no-repack" in said[0]

    ckpt = fitted(served, "dflash")
    monkeypatch.setattr(llama_build, "build", lambda kind, quiet=False: bin_dir)
    rep = serve_eval_quiet(ckpt, served, tmp_path / "serve")
    (run,) = rep["runs"]
    assert run["baseline"]["repack"] == "off after SIGSEGV while loading"
    assert run["repack"] == "off (after SIGSEGV while loading in an earlier server)"
    assert run["lossless"] == {"identical_prompts": 3, "prompts": 3}

    always = wrapper(llama_bin, tmp_path / "always", "kill -SEGV $$")
    with pytest.raises(DflashError, match="killed by SIGSEGV before it was ready even with --no-repack"):
        with LlamaServer(always, gguf, tmp_path / "a.log", say=said.append):
            pass


def serve_eval_quiet(ckpt, served, out):
    from dflash_staged.serve.evaluate import serve_eval

    return serve_eval(ckpt, served["target_dir"], served["file"], out, NEW_TOKENS, quiet=True, kind="cpu")


def test_an_illegal_instruction_names_the_cpu_the_build_was_made_for(served, llama_bin, tmp_path):
    from dflash_staged.serve.llamacpp.convert import convert
    from dflash_staged.serve.llamacpp.server import LlamaServer

    bin_dir = wrapper(llama_bin, tmp_path / "other-cpu", "kill -ILL $$")
    (bin_dir.parent / "CPU.json").write_text(json.dumps({"model": "Xeon of the future", "isa": ["avx10_9"]}))
    gguf = convert(served["target_dir"], served["root"] / "target-f32.gguf", "f32", quiet=True)
    with pytest.raises(DflashError) as e:
        with LlamaServer(bin_dir, gguf, tmp_path / "s.log"):
            pass
    msg = str(e.value)
    assert "killed by SIGILL before it was ready" in msg and "code -4" not in msg
    assert "made for Xeon of the future, whose avx10_9 this host lacks" in msg and "dflash serve build" in msg


def test_a_checkpoint_saved_again_within_the_second_is_converted_again(served, tmp_path):
    """The GGUF cache is keyed by content: new weights of the same size and whole-second mtime (a checkpoint
    re-saved within a second) are converted again, never served stale."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_staged.serve.llamacpp.convert import convert

    ckpt = tmp_path / "ckpt"
    shutil.copytree(served["target_dir"], ckpt)
    out = tmp_path / "t.gguf"
    convert(ckpt, out, "f32", quiet=True)
    first = out.read_bytes()
    weights = next(ckpt.glob("*.safetensors"))
    st = weights.stat()
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and int(weights.stat().st_mtime) == int(st.st_mtime)
    convert(ckpt, out, "f32", quiet=True)
    assert out.read_bytes() != first
    mtime = out.stat().st_mtime_ns
    convert(ckpt, out, "f32", quiet=True)  # nothing changed: the cached file is kept
    assert out.stat().st_mtime_ns == mtime

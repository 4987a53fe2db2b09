"""The CLI's surface as a newcomer meets it (issue 50, items 7 and 8): commands listed in pipeline order,
help on every option without Sphinx markup, ``--help`` without torch, and the one-line messages of the
smaller cases (eval's chat line, the launcher's closing lines, ``memory`` offline, the missing manifest)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import click
from click.testing import CliRunner

from dflash_staged.cli import main

from helpers import ROOT, cli, env

PIPELINE_ORDER = [
    "regenerate",
    "data",
    "plan",
    "memory",
    "extract",
    "train",
    "pipeline",
    "node",
    "status",
    "plot",
    "eval",
    "serve",
]
MARKUP = re.compile(r"``|:(class|mod|func|meth|data|attr|exc):`")


def commands(cmd: click.Command = main, path: tuple[str, ...] = ()):
    """(path, command) of the group and of every command and subcommand under it."""
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from commands(sub, (*path, name))


def help_text(path: tuple[str, ...]) -> str:
    r = CliRunner().invoke(main, [*path, "--help"], terminal_width=80)
    assert r.exit_code == 0, r.output
    return r.output


def listed(text: str) -> list[tuple[str, str]]:
    """(name, short help) of each line of a group's ``Commands:`` section."""
    section = text.split("Commands:\n", 1)[1]
    return [tuple(line.split(None, 1)) for line in section.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- item 7
def test_commands_are_listed_in_pipeline_order_each_on_one_line():
    rows = listed(help_text(()))
    assert [name for name, _ in rows] == PIPELINE_ORDER
    assert [name for name, _ in listed(help_text(("serve",)))] == ["build", "export", "eval"]
    for path, cmd in commands():
        if isinstance(cmd, click.Group):
            for name, short in listed(help_text(path)):
                assert not short.endswith("..."), f"{' '.join(path)} {name}: cut short: {short!r}"


def test_every_option_has_help_and_no_help_shows_markup():
    missing, marked = [], []
    for path, cmd in commands():
        where = "dflash " + " ".join(path)
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip():
                missing.append(f"{where} {p.opts[0]}")
        text = help_text(path)  # the command's docstring, its options' help and its commands' short help
        marked += [f"{where}: {line.strip()}" for line in text.splitlines() if MARKUP.search(line)]
    assert not missing, "options without help:\n" + "\n".join(missing)
    assert not marked, "Sphinx markup in --help:\n" + "\n".join(marked)
    assert MARKUP.search("see :func:`x`") and MARKUP.search("even by ``kill -9``")  # the check sees it


def test_help_imports_no_torch():
    """Every --help of the tree, in one fresh interpreter, imports none of the heavy packages."""
    code = (
        "import json, sys, click\n"
        "from dflash_staged.cli import main\n"
        "def walk(c, path):\n"
        "    yield path\n"
        "    for n, s in (c.commands.items() if isinstance(c, click.Group) else ()):\n"
        "        yield from walk(s, path + [n])\n"
        "for path in walk(main, []):\n"
        "    try:\n"
        "        main.main(path + ['--help'], prog_name='dflash', standalone_mode=False)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('torch', 'transformers', 'numpy', 'zarr', 'safetensors', 'matplotlib')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "Commands:" in r.stdout and "--manifest" in r.stdout  # the help texts were printed
    assert json.loads(r.stdout.splitlines()[-1]) == []


# ---------------------------------------------------------------------------------------------- item 8
def test_eval_chat_line_reads_well_with_and_without_options(tmp_path):
    from dflash_staged.evaluate.prompts import chat_line, chat_options

    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"chat": {"kwargs": {}, "template": None}}))
    chat, source = chat_options(tmp_path, "tiny:qwen3")
    line = chat_line(chat.template_path, chat.kwargs, source)
    assert line == f"chat template: the tokenizer's; options: none (from the checkpoint's record, {state})"
    chat, source = chat_options(tmp_path / "none", "tiny:qwen3", {"enable_thinking": False})
    line = chat_line(chat.template_path, chat.kwargs, source)
    assert line == (
        "chat template: the tokenizer's; options: {\"enable_thinking\": false} (from the tokenizer's "
        "defaults (the checkpoint records none) + --chat-template-kwargs)"
    )


def test_eval_report_names_the_drafters_block_and_its_drafts_a_step():
    """A DSpark block of 4 drafts 4 tokens a step (its rows are all drafts); DFlash's block of 4 drafts 3."""
    import torch
    from test_evaluate import tiny_target

    from dflash_staged.evaluate.report import _decode_all, format_report
    from dflash_staged.evaluate.sampling import SamplingSettings
    from dflash_staged.evaluate.speculative import DrafterProposer

    from helpers import make_drafter

    target = tiny_target()
    for arch, drafts in (("dspark", 4), ("dflash", 3)):
        torch.manual_seed(0)
        d = make_drafter(
            architecture=arch, block=4, k_taps=2, hidden=target.hidden_size, vocab=target.vocab_size,
            **({"options": {"markov_rank": 4}} if arch == "dspark" else {}),
        )  # fmt: skip
        prompts = [(1, torch.randint(4, 100, (7,)).tolist())]
        run = _decode_all(target, DrafterProposer(d.eval()), prompts, 12, [], SamplingSettings(), False, True)
        assert (run["block_size"], run["drafts_per_step"]) == (4, drafts)
        assert len(run["accept_length_histogram"]) == drafts + 1 and 1 <= run["tau"] <= drafts + 1
        run["chat"] = {"kwargs": {}, "template": None, "from": "x"}
        text = format_report(run)
        assert f"(block 4: {drafts} drafts a step, " in text and "{}" not in text, text


def test_pipeline_prints_the_time_lines_once(monkeypatch):
    """extract closes with its four time lines; the launcher's summary does not repeat them (and prints
    them when extract could not)."""
    from dflash_staged.launch.supervise import run_side_by_side

    lines = [
        "time (last 9 s): a",
        "time (whole run): b",
        "bottleneck (last 9 s): c",
        "bottleneck (whole run): d",
    ]
    monkeypatch.setattr("dflash_staged.launch.monitor.format_balance", lambda b: lines)
    said = "import sys; print('\\n'.join('extract: ' + x for x in sys.argv[1:]))"
    quiet = [sys.executable, "-c", "pass"]
    for extract, launch_says in (([sys.executable, "-c", said, *lines], False), (quiet, True)):
        out = io.StringIO()
        assert run_side_by_side(None, extract, quiet, status_every=3600, out=out) == 0
        said_lines = [x for x in out.getvalue().splitlines() if not x.startswith("[launch] starting")]
        for line in lines:
            assert sum(x.endswith(line) for x in said_lines) == 1, said_lines
        assert ("[launch] time (whole run): b" in said_lines) == launch_says, said_lines


def test_memory_offline_suggests_target_dims(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dflash_staged", "memory", "--config", "configs/qwen3-8b.toml"],
        cwd=ROOT,
        env={**env(), "HF_HOME": str(tmp_path / "hf")},  # nothing downloaded, nothing cached
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: target.model='Qwen/Qwen3-8B'"), r.stderr
    assert "--target-dims LAYERS,HIDDEN,VOCAB" in r.stderr and "Traceback" not in r.stderr


def test_no_manifest_hint_names_what_plan_requires(tmp_path):
    code, out = cli("status", "--manifest", tmp_path / "none")
    assert code == 1 and out.count("\n") == 1, out
    assert f"run `dflash plan --config CONFIG.toml --data DATA --manifest {tmp_path / 'none'}` first" in out
    assert not (tmp_path / "none").exists()

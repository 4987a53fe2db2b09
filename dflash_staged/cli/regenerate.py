"""``dflash regenerate``: the command line of :mod:`dflash_staged.regenerate` (in process on --devices, or
through OpenAI-compatible servers with --server)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_staged.cli.options import parse_json_object
from dflash_staged.errors import user_errors
from dflash_staged.regenerate.flags import server_flags, server_options


@click.command(short_help="Answer the prompts with the target: the data to train on.")
@click.option(
    "--prompts",
    "prompts_path",
    required=True,
    type=click.Path(path_type=Path),
    help='JSONL conversations ({"messages": [...]}); assistant turns are replaced.',
)
@click.option(
    "--target",
    "target_spec",
    required=True,
    help="Target: model directory, hub id or tiny:qwen3; or a dflash config TOML (its [target]).",
)
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path), help="Output JSONL.")
@click.option(
    "--devices", default="cpu", show_default=True, help="One worker per device: cuda:0,cuda:1 or cpu,cpu."
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Length cap of each answer.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="0 = greedy; > 0 samples.",
)
@click.option(
    "--top-p",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Nucleus sampling at --temperature > 0 (1 = off).",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Top-k sampling at --temperature > 0 (0 = off).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Conversations answered together in one batch (grouped by length).",
)
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the sampling."
)
@click.option(
    "--chat-template-kwargs",
    "chat_kwargs",
    default=None,
    metavar="JSON",
    help="Options of the chat template, e.g. '{\"enable_thinking\": false}' (over a TOML target's [data]).",
)
@click.option(
    "--chat-template",
    "chat_template",
    type=click.Path(path_type=Path),
    default=None,
    help="A Jinja chat template file replacing the tokenizer's (or the TOML's [data] one).",
)
@server_flags
@user_errors
def regenerate(
    prompts_path,
    target_spec,
    out_path,
    devices,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    batch_size,
    seed,
    chat_kwargs,
    chat_template,
    **server_flags_given,
):
    """Answer every conversation with the target itself: the data DFlash trains on (resumable).

    With a config TOML as --target, its [data] chat options apply, so the answers are rendered the
    way `dflash plan` will render them. With --server, servers that already serve the target answer,
    for example:

    \b
      vllm serve Qwen/Qwen3-8B --port 8000
      python -m sglang.launch_server --model-path Qwen/Qwen3-8B --port 30000
      llama-server -m qwen3-8b.gguf --port 8080 -np 8 -c 32768

    Each server must first answer, serve the target (per /v1/models) and give the project's prompt
    tokens; a killed run or a restarted server loses nothing answered (rerun to go on)."""
    from dflash_staged.chat import ChatOptions
    from dflash_staged.config import load_config, target_from_spec
    from dflash_staged.extract.options import parse_devices
    from dflash_staged.regenerate.command import run_regenerate
    from dflash_staged.regenerate.options import GenOptions

    chat = (
        ChatOptions.from_config(load_config(target_spec).data)
        if target_spec.endswith(".toml")
        else ChatOptions()
    )
    chat.override(parse_json_object(chat_kwargs, "--chat-template-kwargs"), chat_template)
    o = GenOptions(
        target=target_from_spec(target_spec),
        out=out_path,
        devices=parse_devices(devices),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        chat=chat,
    )
    run_regenerate(prompts_path, o, batch_size=batch_size, server=server_options(**server_flags_given))

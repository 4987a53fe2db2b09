"""The command-line options of ``dflash regenerate``'s path through servers: ``--server`` and the options
that apply with it (:func:`server_flags`, a click decorator), and the
:class:`~dflash_staged.regenerate.options.ServerOptions` they give (:func:`server_options`). Importing this
module loads click only, so ``dflash --help`` stays light."""

from __future__ import annotations

import click

FLAGS = [
    click.option(
        "--server",
        "servers",
        default=None,
        metavar="URL[,URL...]",
        help="Answer through these OpenAI-compatible servers (vLLM, SGLang, llama-server) instead of "
        "in-process workers; conversations are spread across them.",
    ),
    click.option(
        "--concurrency",
        type=click.IntRange(min=1),
        default=None,
        help="With --server: conversations in flight per server [default: llama-server's slots, SGLang's "
        "max running requests, else 64].",
    ),
    click.option(
        "--api-key-env",
        "api_key_env",
        default=None,
        metavar="NAME",
        help="With --server: the environment variable holding the servers' API key (never printed).",
    ),
    click.option(
        "--served-model",
        "served_model",
        default=None,
        metavar="NAME",
        help="With --server: the served model name to request, when the server names the target otherwise.",
    ),
    click.option(
        "--max-attempts",
        type=click.IntRange(min=1),
        default=8,
        show_default=True,
        help="With --server: tries of a request (429, 5xx, dropped connection) before its conversation is "
        "skipped.",
    ),
    click.option(
        "--server-wait",
        "server_wait",
        type=click.FloatRange(min=0.0),
        default=600.0,
        show_default=True,
        help="With --server: seconds a server that stopped answering (a restart) is waited for before its "
        "work goes to the others.",
    ),
    click.option(
        "--allow-skipped",
        is_flag=True,
        help="With --server: write the output without the conversations that kept failing (they are "
        "listed in OUT.skipped.jsonl).",
    ),
]


def server_flags(f):
    """The options of :data:`FLAGS` on command ``f``, in this order in its help."""
    for option in reversed(FLAGS):
        f = option(f)
    return f


def server_options(servers, concurrency, api_key_env, served_model, max_attempts, server_wait, allow_skipped):
    """The flags' ServerOptions; None without ``--server`` (the in-process path), which refuses the flags
    that only a server run reads."""
    if not servers:
        given = {
            "--concurrency": concurrency is not None,
            "--api-key-env": api_key_env is not None,
            "--served-model": served_model is not None,
            "--max-attempts": max_attempts != 8,
            "--server-wait": server_wait != 600.0,
            "--allow-skipped": bool(allow_skipped),
        }
        used = [flag for flag, on in given.items() if on]
        if used:
            from dflash_staged.errors import DflashError

            raise DflashError(
                f"{used[0]} applies only with --server URL; add --server, or leave {used[0]} out"
            )
        return None
    from dflash_staged.regenerate.options import ServerOptions

    return ServerOptions(
        urls=[u for u in servers.split(",") if u.strip()],
        concurrency=concurrency,
        api_key_env=api_key_env,
        served_model=served_model,
        max_attempts=max_attempts,
        server_wait_s=server_wait,
        allow_skipped=allow_skipped,
    )

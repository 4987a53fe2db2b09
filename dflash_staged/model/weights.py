"""Drafter checkpoints in the reference DFlash format, and the target's frozen embedding/head.

Contract:

* **Checkpoint** = a directory with ``config.json`` (:meth:`DraftModelConfig.to_dict`:
  ``architectures: ["DFlashDraftModel"]``, the Qwen3 fields, ``block_size``,
  ``num_target_layers``, ``dflash_config: {target_layer_ids, mask_token_id}``,
  ``dtype``) and ``model.safetensors`` holding exactly the drafter parameters under
  the reference names (``layers.{i}.self_attn.q_proj.weight``, ..., ``fc.weight``,
  ``hidden_norm.weight``, ``norm.weight``), in the dtype ``config.json`` declares
  (transformers casts to that dtype on load, so anything else would change the
  weights). No target embedding or LM head is stored. The reference class
  (z-lab ``dflash.model.DFlashDraftModel.from_pretrained``) loads it and agrees
  (``tests/test_drafter_reference.py``); SGLang and vLLM read the same fields.
  There is no ``auto_map``/``dflash.py`` (that code is the reference's, not ours),
  so ``AutoModel(..., trust_remote_code=True)`` needs that file copied in.
* :func:`save_drafter` writes it with :func:`dflash_staged.fsutil.atomic_dir`: an existing
  checkpoint of the same name is replaced only after the new one is complete.
* :func:`load_embed_and_head` reads only the two target tensors (``[V, H]`` each):
  from the safetensors files of a local directory or a hub repo (only the needed
  shard files are downloaded; ``HF_HUB_OFFLINE`` is honoured), from a GGUF file
  (dequantised), or from a tiny target built in code. Tied embeddings (no LM head
  tensor, or ``tie_word_embeddings``) give the embedding for both. Multimodal
  Qwen3.5 checkpoints keep the text weights under ``model.language_model.*``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash_staged.model.drafter import DFlashDrafter, DraftModelConfig
from dflash_staged.dtypes import torch_dtype
from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "model.text_model.embed_tokens.weight",
               "embed_tokens.weight", "transformer.wte.weight")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight",
              "model.lm_head.weight")


# -- drafter checkpoints ---------------------------------------------------------------------------
def drafter_state_dict(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The parameters under their reference names, cast to ``dtype``, contiguous, on CPU."""
    return {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in drafter.state_dict().items()}


def write_drafter_files(drafter: DFlashDrafter, dir: Path, dtype: str | None = None) -> None:
    """``config.json`` + ``model.safetensors`` into the existing directory ``dir``; weights in ``dtype``
    (default: the config's ``dtype``), which is also what ``config.json`` declares."""
    from safetensors.torch import save_file
    name = dtype or drafter.dcfg.dtype
    torch_dt = torch_dtype(name, "checkpoint dtype")
    (Path(dir) / CONFIG_NAME).write_text(DraftModelConfig(**{**drafter.dcfg.__dict__, "dtype": name}).to_json())
    save_file(drafter_state_dict(drafter, torch_dt), str(Path(dir) / WEIGHTS_NAME), metadata={"format": "pt"})


def save_drafter(drafter: DFlashDrafter, dir: str | Path, dtype: str | None = None) -> Path:
    """Write a reference-format drafter checkpoint directory ``dir`` atomically (replacing an old one)."""
    with atomic_dir(Path(dir), replace=True) as tmp:
        write_drafter_files(drafter, tmp, dtype)
        os.chmod(tmp, 0o755)
    return Path(dir)


def read_drafter_config(dir: str | Path) -> DraftModelConfig:
    path = Path(dir) / CONFIG_NAME
    try:
        text = path.read_text()
    except OSError as e:
        raise DflashError(f"{path}: cannot read the drafter config ({e.strerror}); is {dir} a drafter "
                          "checkpoint directory?") from None
    return DraftModelConfig.from_json(text, str(path))


def _weight_files(dir: Path) -> list[Path]:
    index = dir / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [dir / f for f in files]
    if (dir / WEIGHTS_NAME).exists():
        return [dir / WEIGHTS_NAME]
    found = sorted(dir.glob("*.safetensors"))
    if not found:
        raise DflashError(f"{dir}: no {WEIGHTS_NAME} (nor any *.safetensors); the checkpoint is incomplete")
    return found


def load_drafter(dir: str | Path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32) -> DFlashDrafter:
    """Rebuild a drafter from a reference-format checkpoint (ours or a released one).

    Parameters are loaded in ``dtype`` (default fp32, for training and CPU use;
    ``None`` = the dtype ``config.json`` declares). The frozen tensors are moved to
    ``device`` with their own dtype.
    """
    from safetensors.torch import load_file

    dir = Path(dir)
    dcfg = read_drafter_config(dir)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(dir):
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types
            raise DflashError(f"{f}: cannot read safetensors ({e}); the checkpoint is damaged") from None
    drafter = DFlashDrafter(dcfg, embed_weight, lm_head_weight)
    expected = set(drafter.state_dict())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise DflashError(f"{dir}: weights do not match config.json: missing {missing[:5]}, unexpected "
                          f"{extra[:5]}; the checkpoint is not a DFlash drafter of this shape")
    for k, v in state.items():
        want = tuple(drafter.state_dict()[k].shape)
        if tuple(v.shape) != want:
            raise DflashError(f"{dir}: tensor {k} has shape {tuple(v.shape)}, config.json implies {want}")
    drafter.load_state_dict(state)
    target_dtype = dtype or torch_dtype(dcfg.dtype)
    for p in drafter.parameters():
        p.data = p.data.to(target_dtype)
    return drafter.to(device)


# -- the target's embedding and LM head ------------------------------------------------------------
def _tied(config: dict) -> bool:
    text = config.get("text_config") or {}
    if "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return bool(config.get("tie_word_embeddings", False))


def _pick(names: list[str], candidates: tuple[str, ...]) -> str | None:
    have = set(names)
    return next((c for c in candidates if c in have), None)


def _select(keys: list[str], config: dict, where: str) -> tuple[str, str]:
    embed = _pick(keys, EMBED_NAMES)
    if embed is None:
        raise DflashError(f"{where}: no embedding tensor (looked for {', '.join(EMBED_NAMES[:3])}, ...); "
                          "is this a causal LM checkpoint?")
    head = None if _tied(config) else _pick(keys, HEAD_NAMES)
    return embed, head or embed


def _read_tensors(files: dict[str, Path], names: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    out = {}
    for name in names:
        with safe_open(str(files[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _from_safetensors_dir(dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import safe_open
    config = json.loads((dir / CONFIG_NAME).read_text()) if (dir / CONFIG_NAME).exists() else {}
    index = dir / INDEX_NAME
    if index.exists():
        files = {k: dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    else:
        files = {}
        for f in sorted(dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                files.update({k: f for k in h.keys()})
        if not files:
            raise DflashError(f"{dir}: no safetensors weights; the target must be stored as safetensors "
                              "(or set target.gguf_file)")
    embed, head = _select(list(files), config, str(dir))
    t = _read_tensors(files, {embed, head})
    return t[embed], t[head]


def _from_hub(repo: str, revision: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def get(fname: str) -> Path:
        return Path(hf_hub_download(repo, fname, revision=revision))

    try:
        config = json.loads(get(CONFIG_NAME).read_text())
        try:
            weight_map = json.loads(get(INDEX_NAME).read_text())["weight_map"]
        except EntryNotFoundError:
            weight_map = None
        if weight_map is None:
            path = get(WEIGHTS_NAME)
            return _from_safetensors_dir(path.parent)
        embed, head = _select(list(weight_map), config, repo)
        files = {n: get(weight_map[n]) for n in {embed, head}}
    except DflashError:
        raise
    except Exception as e:
        raise DflashError(f"target.model={repo!r}: cannot fetch the embedding/LM head files ({e}); check the "
                          "hub id, the network, or unset HF_HUB_OFFLINE to allow downloads") from None
    t = _read_tensors(files, {embed, head})
    return t[embed], t[head]


def _from_gguf(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    if "token_embd.weight" not in tensors:
        raise DflashError(f"{path}: no token_embd.weight tensor; is this a language model GGUF?")

    def load(name: str) -> torch.Tensor:
        t = tensors[name]
        arr = dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(
            [int(n) for n in reversed(t.shape)])

    embed = load("token_embd.weight")
    return embed, load("output.weight") if "output.weight" in tensors else embed


def load_embed_and_head(target_cfg, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head ``[V, H]`` without building the target."""
    model = target_cfg.model
    if model.startswith("tiny:"):
        from dflash_staged.model.tiny import build_tiny_model
        m = build_tiny_model(model.split(":", 1)[1], seed=target_cfg.seed)
        embed, head = m.get_input_embeddings().weight.detach(), m.get_output_embeddings().weight.detach()
    elif target_cfg.gguf_file:
        path = Path(model) / target_cfg.gguf_file if Path(model).is_dir() else Path(target_cfg.gguf_file)
        if not path.exists():
            raise DflashError(f"target.gguf_file={target_cfg.gguf_file!r}: {path} does not exist")
        embed, head = _from_gguf(path)
    elif Path(model).is_dir():
        embed, head = _from_safetensors_dir(Path(model))
    elif Path(model).exists() or model.startswith((".", "/", "~")):
        raise DflashError(f"target.model={model!r} is not a model directory; give a directory with config.json "
                          "and safetensors weights, a hub id, or 'tiny:qwen3'")
    else:
        embed, head = _from_hub(model)
    if embed.shape[1] != head.shape[1]:
        raise DflashError(f"target.model={model!r}: embedding {tuple(embed.shape)} and LM head "
                          f"{tuple(head.shape)} disagree on the hidden size")
    same = head is embed
    embed = embed.to(device=device, dtype=dtype or embed.dtype)
    return embed, embed if same else head.to(device=device, dtype=dtype or head.dtype)


# -- the mask token --------------------------------------------------------------------------------
def validate_mask_token(mask_token_id: int, tokenizer, vocab_size: int) -> int:
    """Resolve and check ``drafter.mask_token_id`` (-1 = ``len(tokenizer)``).

    Valid: an unused embedding row (``len(tokenizer) <= id < vocab_size``, as the
    released drafters use), or a special token of the tokenizer; in the latter case
    the data must never contain it (:func:`check_mask_absent`).
    """
    n = len(tokenizer)
    mid = n if mask_token_id == -1 else mask_token_id
    if mask_token_id == -1 and n >= vocab_size:
        raise DflashError(f"drafter.mask_token_id=-1 means len(tokenizer)={n}, but the target vocabulary has only "
                          f"{vocab_size} rows: set drafter.mask_token_id to a special token id the data never "
                          "contains")
    if not 0 <= mid < vocab_size:
        raise DflashError(f"drafter.mask_token_id={mid} is outside the target vocabulary 0..{vocab_size - 1}; use "
                          f"an unused row (len(tokenizer)={n} <= id < {vocab_size}) or a special token id")
    if mid >= n:
        return mid
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
                if getattr(t, "special", False)}
    if mid not in special:
        raise DflashError(f"drafter.mask_token_id={mid} is an ordinary token ({tokenizer.convert_ids_to_tokens(mid)!r})"
                          f"; use an unused row (len(tokenizer)={n} <= id < {vocab_size}) or a special token the "
                          "data never contains")
    return mid


def check_mask_absent(input_ids: torch.Tensor, mask_token_id: int, where: str = "data") -> None:
    """Raise if the tokenized data contains the mask token (it would be trained on as a label)."""
    if bool((torch.as_tensor(input_ids) == mask_token_id).any()):
        raise DflashError(f"{where}: contains the mask token id {mask_token_id}; pick another "
                          "drafter.mask_token_id (a special token the data never uses) or clean the data")

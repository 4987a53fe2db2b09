"""Drafter checkpoints in the reference DFlash format, and the drafter's mask token.

Contract:

* **Checkpoint** = a directory with ``config.json`` (:meth:`DraftModelConfig.to_dict`:
  ``architectures: ["DFlashDraftModel"]``, the Qwen3 fields, ``block_size``,
  ``num_target_layers``, ``dflash_config: {target_layer_ids, mask_token_id}``,
  ``dtype``) and ``model.safetensors`` holding exactly the drafter parameters under
  the reference names (``layers.{i}.self_attn.q_proj.weight``, ..., ``fc.weight``,
  ``hidden_norm.weight``, ``norm.weight``), in the dtype ``config.json`` declares
  (transformers casts to that dtype on load, so anything else would change the
  weights). No target embedding or LM head is stored, except with a draft vocabulary
  (``draft_vocab_size``): then ``lm_head.weight`` (the target's rows of it) and ``d2t``
  (:mod:`dflash_staged.model.drafters.vocab`), which vLLM and llama.cpp need; loading takes the rows
  from the target again. The reference class
  (z-lab ``dflash.model.DFlashDraftModel.from_pretrained``) loads it and agrees
  (``tests/test_drafter_reference.py``); SGLang and vLLM read the same fields.
  There is no ``auto_map``/``dflash.py`` (that code is the reference's, not ours),
  so ``AutoModel(..., trust_remote_code=True)`` needs that file copied in.
* :func:`save_drafter` writes it with :func:`dflash_staged.fsutil.atomic_dir`: an existing
  checkpoint of the same name is replaced only after the new one is complete.
* The target's frozen embedding and LM head are read by
  :func:`dflash_staged.model.target.weights.load_embed_and_head`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash_staged.dtypes import torch_dtype
from dflash_staged.errors import DflashError
from dflash_staged.fsutil import atomic_dir
from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


# -- drafter checkpoints ---------------------------------------------------------------------------
def drafter_state_dict(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The parameters (and a family's saved buffers) under their reference names, floating-point ones
    cast to ``dtype``, contiguous, on CPU."""
    return {
        k: v.detach().to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in drafter.state_dict().items()
    }


def write_drafter_files(drafter: DFlashDrafter, dir: Path, dtype: str | None = None) -> None:
    """``config.json`` + ``model.safetensors`` into the existing directory ``dir``; weights in ``dtype``
    (default: the config's ``dtype``), which is also what ``config.json`` declares."""
    from safetensors.torch import save_file

    name = dtype or drafter.dcfg.dtype
    torch_dt = torch_dtype(name, "checkpoint dtype")
    (Path(dir) / CONFIG_NAME).write_text(
        DraftModelConfig(**{**drafter.dcfg.__dict__, "dtype": name}).to_json()
    )
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
        raise DflashError(
            f"{path}: cannot read the drafter config ({e.strerror}); is {dir} a drafter checkpoint directory?"
        ) from None
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


def load_drafter(
    dir: str | Path,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
) -> DFlashDrafter:
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
        raise DflashError(
            f"{dir}: weights do not match config.json: missing {missing[:5]}, unexpected "
            f"{extra[:5]}; the checkpoint is not a DFlash drafter of this shape"
        )
    for k, v in state.items():
        want = tuple(drafter.state_dict()[k].shape)
        if tuple(v.shape) != want:
            raise DflashError(f"{dir}: tensor {k} has shape {tuple(v.shape)}, config.json implies {want}")
    drafter.load_state_dict(state)
    if dcfg.draft_vocab_size:  # the head's rows again from the target itself (checks the table too)
        from dflash_staged.model.drafters.vocab import ids_of

        drafter.set_draft_vocab(ids_of(state["d2t"]), lm_head_weight)
    target_dtype = dtype or torch_dtype(dcfg.dtype)
    for p in drafter.parameters():
        p.data = p.data.to(target_dtype)
    return drafter.to(device)


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
        raise DflashError(
            f"drafter.mask_token_id=-1 means len(tokenizer)={n}, but the target vocabulary has only "
            f"{vocab_size} rows: set drafter.mask_token_id to a special token id the data never "
            "contains"
        )
    if not 0 <= mid < vocab_size:
        raise DflashError(
            f"drafter.mask_token_id={mid} is outside the target vocabulary 0..{vocab_size - 1}; use "
            f"an unused row (len(tokenizer)={n} <= id < {vocab_size}) or a special token id"
        )
    if mid >= n:
        return mid
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {
        i
        for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
        if getattr(t, "special", False)
    }
    if mid not in special:
        raise DflashError(
            f"drafter.mask_token_id={mid} is an ordinary token ({tokenizer.convert_ids_to_tokens(mid)!r})"
            f"; use an unused row (len(tokenizer)={n} <= id < {vocab_size}) or a special token the "
            "data never contains"
        )
    return mid


def check_mask_absent(input_ids: torch.Tensor, mask_token_id: int, where: str = "data") -> None:
    """Raise if the tokenized data contains the mask token (it would be trained on as a label)."""
    if bool((torch.as_tensor(input_ids) == mask_token_id).any()):
        raise DflashError(
            f"{where}: contains the mask token id {mask_token_id}; pick another "
            "drafter.mask_token_id (a special token the data never uses) or clean the data"
        )

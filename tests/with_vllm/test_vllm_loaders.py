"""Checkpoints as the trainer writes them, loaded by the real vLLM's drafter classes, and one served by the
real ``vllm.LLM``. Skipped without vLLM (the replay of its loaders, ``tests/engines/vllm.py``, runs then;
a folder named ``tests/vllm`` would import as a namespace package "vllm" where vLLM is not installed, so
the guard asks for vLLM's own files).

* **Loaders.** For each family vLLM has a class for (DFlash, DFlash2, DSpark) and each option that changes
  the checkpoint's keys or shapes: a tiny drafter written by ``save_checkpoint`` (``config.json`` and
  ``model.safetensors`` by the trainer's own ``write_drafter_files``, the trainer's tensors in
  ``trainer/``); vLLM's config for it (``EngineArgs.create_engine_config``, as ``LLM`` builds it), its
  model class (``initialize_model``, as its drafter is built) and ``load_weights`` fed by vLLM's own
  checkpoint iterator (``DefaultModelLoader.get_all_weights``). Asserted: vLLM reads exactly the keys of
  ``model.safetensors`` (never the trainer's), raises on none, every parameter is filled from them with
  equal values and shapes (the fused ``qkv_proj`` and ``gate_up_proj`` as the concatenation of their
  parts), and the only parameters left are the target's shared embedding and head and the mask
  embedding vLLM takes from it. vLLM's CPU (V1) model runner refuses DFlash2 and DSpark; that check is
  recorded (and asserted), not applied, so their classes load here as on a GPU.
* **Serving.** A DFlash drafter fitted to the planted tiny target (``tests/planted.py``) and written as the
  trainer writes it (``trainer/`` present: the regression test for vLLM reading
  ``trainer_state.safetensors``) served by ``dflash serve eval --engine vllm``'s code without its baseline
  engine (one engine a module); the outputs are compared with plain greedy decoding of the target in
  this process (its margins are planted wide, so float32 kernels cannot flip a token), and the steps
  with this project's own speculative decode of the same checkpoint (``dflash eval``'s).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # not installed (a namespace package "vllm" is not vLLM)
    pytest.skip("vLLM is not installed in this environment (.venv-vllm has it)", allow_module_level=True)
pytest.importorskip("vllm")

import torch  # noqa: E402

from dflash_staged.model.drafters.backbone import DFlashDrafter, DraftModelConfig  # noqa: E402
from dflash_staged.model.drafters.engines import serving_problems  # noqa: E402
from dflash_staged.model.drafters.weights import write_drafter_files  # noqa: E402
from dflash_staged.train.checkpoint import TrainerState, save_checkpoint  # noqa: E402

SHARED = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}  # the target's, in vLLM
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
D2 = dict(architecture="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)
SPARK = dict(markov_rank=8, markov_head_type="vanilla")
V1_REFUSES = {
    "dflash": [],
    "dflash2": ["DFlash candidate-head drafts"],
    "dspark": ["dspark speculative decoding"],
}
CASES = {  # name -> (DraftModelConfig fields, outcome)
    "dflash": ({}, "ok"),
    "dflash-1-layer-3-taps": (dict(num_hidden_layers=1, target_layer_ids=[1, 3, 4]), "ok"),
    "dflash-mha": (dict(num_key_value_heads=4), "ok"),
    "dflash2": (D2, "ok"),
    "dflash2-kernel-3": (dict(D2, conv_kernel_size=3), "ok"),
    "dflash2-group-16-rank-16": (dict(D2, conv_group_size=16, selector_rank=16, selector_top_k=8), "ok"),
    "dspark": (dict(architecture="dspark", options=SPARK), "ok"),
    "dspark-no-confidence": (dict(architecture="dspark", options={**SPARK, "confidence_head": False}), "ok"),
    "dspark-confidence-hidden": (
        dict(architecture="dspark", options={**SPARK, "confidence_head_with_markov": False}),
        "ok",
    ),
    "dspark-rank-0": (
        dict(architecture="dspark", options={"markov_rank": 0, "confidence_head_with_markov": False}),
        "ok",
    ),
    "dspark-gated": (dict(architecture="dspark", options={**SPARK, "markov_head_type": "gated"}), "refused"),
    "dspark-rnn": (dict(architecture="dspark", options={**SPARK, "markov_head_type": "rnn"}), "refused"),
}


def tiny(**fields) -> DFlashDrafter:
    """A float32 drafter for the tiny target (hidden 128, 6 layers, vocabulary 2048): 2 layers, block 4."""
    base = dict(
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=2048,
        block_size=4,
        num_target_layers=6,
        target_layer_ids=[1, 4],
        mask_token_id=3,
        dtype="float32",
    )
    g = torch.Generator().manual_seed(0)
    dcfg = DraftModelConfig(**{**base, **fields})
    return DFlashDrafter(dcfg, torch.randn(2048, 128, generator=g), torch.randn(2048, 128, generator=g))


def write_as_trainer(drafter: DFlashDrafter, run_dir, step: int = 8):
    """The checkpoint ``step`` of ``run_dir`` as the trainer writes it (``trainer/`` with master weights)."""
    params = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    state = TrainerState(
        values={"step": step, "chat": None},
        tensors={f"master.{n}": p.detach().float().clone() for n, p in params.items()},
    )
    ckpt = save_checkpoint(
        run_dir, step, write_drafter=lambda d: write_drafter_files(drafter, d), state=state, keep=1
    )
    assert (ckpt / "trainer" / "trainer_state.safetensors").is_file()
    return ckpt


@pytest.fixture(scope="module")
def target_config_dir(tmp_path_factory):
    from dflash_staged.model.target.tiny import tiny_config

    d = tmp_path_factory.mktemp("target")
    tiny_config("qwen3").save_pretrained(d)
    yield d
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def vllm_config(target_dir, ckpt, dcfg, monkeypatch):
    """vLLM's config as ``LLM`` builds it, and what its V1 (CPU) model runner would refuse."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from dflash_staged.serve.vllm.report import speculative_config

    refused: list[str] = []
    monkeypatch.setattr(
        VllmConfig,
        "_validate_v1_model_runner",
        lambda self: refused.extend(self._get_v1_model_runner_unsupported_features()),
    )
    args = EngineArgs(
        model=str(target_dir),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config=speculative_config(dcfg, str(ckpt), "real"),
    )
    return args.create_engine_config(), refused


def load_into_vllm(vc):
    """(vLLM's drafter model, the checkpoint's tensors as vLLM's loader read them): built and loaded as
    vLLM builds its drafter, every parameter first filled with NaN."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    dmc = vc.speculative_config.draft_model_config
    with set_current_vllm_config(vc):
        if not ps.model_parallel_is_initialized():
            port = 29500 + os.getpid() % 1000
            ps.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
            ps.initialize_model_parallel(1, 1)
        model = initialize_model(vc, model_config=dmc)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        read: dict[str, torch.Tensor] = {}

        def weights():
            for name, w in get_model_loader(vc.load_config).get_all_weights(dmc, model):
                read[name] = w.clone()
                yield name, w

        model.load_weights(weights())
    return model, read


def sources(param: str) -> list[str]:
    """The checkpoint keys a vLLM parameter is loaded from (``model.`` added, stacked projections fused)."""
    name = param if param.startswith("lm_head") else param.removeprefix("model.")
    for fused, parts in STACKED.items():
        if f".{fused}." in name:
            return [name.replace(fused, p) for p in parts]
    return [name]


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_s_drafter_class_loads_the_trainer_s_checkpoint(name, target_config_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    fields, want = CASES[name]
    drafter = tiny(**fields)
    dcfg = drafter.dcfg
    ckpt = write_as_trainer(drafter, tmp_path / "run")
    saved = load_file(str(ckpt / "model.safetensors"))
    vc, v1_refuses = vllm_config(target_config_dir, ckpt, dcfg, monkeypatch)
    assert v1_refuses == V1_REFUSES[dcfg.family.name]
    named = [x for x in serving_problems(dcfg) if "vLLM" in x.split(": ", 1)[0]]
    if want == "refused":
        with pytest.raises((ValueError, KeyError)) as e:
            load_into_vllm(vc)
        assert "markov_head" in str(e.value), e.value
        assert named and "vanilla" in named[0], named  # the trainer's line names vLLM
        return
    model, read = load_into_vllm(vc)
    assert set(read) == set(saved), "vLLM read other tensors than model.safetensors'"
    used, left = set(), set()
    for pname, p in model.named_parameters():
        keys = sources(pname)
        if p.numel() == 0:  # markov_rank = 0: vLLM's zero-width Markov head
            continue
        if not all(k in saved for k in keys):
            left.add(pname)
            assert torch.isnan(p).all(), f"{pname}: filled, but from no checkpoint key"
            continue
        want_t = torch.cat([saved[k] for k in keys]) if len(keys) > 1 else saved[keys[0]]
        assert tuple(p.shape) == tuple(want_t.shape), (pname, tuple(p.shape), tuple(want_t.shape))
        assert torch.equal(p.detach().cpu(), want_t), f"{pname}: other values than {keys}"
        used |= set(keys)
    assert used == set(saved), f"checkpoint keys no vLLM parameter took: {sorted(set(saved) - used)}"
    assert left <= SHARED, f"vLLM parameters nothing loaded: {sorted(left - SHARED)}"


def test_vllm_has_no_dspine_class():
    from vllm.model_executor.models.registry import ModelRegistry

    archs = set(ModelRegistry.get_supported_archs())
    assert {"DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel"} <= archs
    assert not {a for a in archs if "DSpine" in a}
    spine = tiny(architecture="dspine", options={"transfer_rank": 8, "message_size": 8, "top_k": 4})
    assert any("vLLM" in line for line in serving_problems(spine.dcfg))


def test_the_trainer_s_checkpoint_serves_in_vllm_losslessly(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate
    from dflash_staged.model.drafters.weights import load_drafter
    from dflash_staged.serve.vllm.evaluate import serve_eval_vllm

    from planted import greedy_continuation, planted_target
    from served import LAYERS, fitted_checkpoint, prompts

    tmp = tmp_path_factory.mktemp("served")
    target = planted_target(LAYERS)
    target.model.save_pretrained(tmp / "target")
    ps, n = prompts(4), 24
    fitted = fitted_checkpoint(tmp / "fit", "dflash", target, tmp / "target", ps, n)
    embed, head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    drafter = load_drafter(fitted, embed, head, device="cpu", dtype=torch.float32)
    write_as_trainer(drafter, tmp / "run", step=100)
    (tmp / "p.jsonl").write_text("".join(json.dumps({"input_ids": p.tolist()}) + "\n" for p in ps))
    ours = []
    for line, p in enumerate(ps, 1):  # dflash eval's decode of the same checkpoint
        out = speculative_generate(target, DrafterProposer(drafter), p, n, [2])
        ours.append(
            {"line": line, "accepted": list(out.accepted), "tau": sum(out.accepted) / len(out.accepted)}
        )
    (tmp / "eval.json").write_text(json.dumps({"per_prompt": ours}))
    rep = serve_eval_vllm(
        tmp / "run", str(tmp / "target"), tmp / "p.jsonl", tmp / "out", n,
        baseline=False, compare=tmp / "eval.json", log=False, quiet=True,
    )  # fmt: skip
    (run,) = rep["runs"]
    for rec, p in zip(run["per_prompt"], ps):
        plain = greedy_continuation(target, p, n)[len(p) :].tolist()
        if 2 in plain:
            plain = plain[: plain.index(2) + 1]
        assert rec["tokens"] == plain, rec["line"]
    c = run["counters"]
    assert c["drafts"] >= run["steps"] - len(ps) and c["tau"] >= run["tau"] - 1e-9
    assert run["tau"] > 2.5, run["tau"]
    a = run["agreement"]
    assert a["identical_step_share"] >= 0.9, a
    print(
        f"vLLM tau {run['tau']} (counters {c['tau']}), dflash eval {a['tau_eval']}; {a['identical_steps']}",
        end="",
    )
    print(f"/{a['steps']} steps identical")

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
* **Draft vocabulary** (``draft_vocab_size``, DFlash and DSpark: ``lm_head.weight [N, H]`` and ``d2t``
  in ``model.safetensors``). Its ``N`` (100) is not a multiple of vLLM's vocabulary padding (64), so
  its ``ParallelLMHead`` rows (and DSpark's ``markov_w2``'s) are 128: the rows past ``N`` are zeroed
  by their loader, and its logits are cut to ``N``. Asserted besides: vLLM's ``draft_id_to_target_id`` is
  our ``d2t``, it marks the drafter as having its own head (``has_own_lm_head``: the target's is
  not shared), and it maps draft ids back to ours: DFlash's ``compute_logits`` puts our logits at
  the vocabulary's target ids and ``-inf`` elsewhere, DSpark's ``map_draft_to_target`` gives our ids
  (its Markov head ``markov_w1 [V, r]``, ``markov_w2 [N, r]``).
* **Serving.** A DFlash drafter fitted to the planted tiny target (``tests/planted.py``) and written as the
  trainer writes it (``trainer/`` present: the regression test for vLLM reading
  ``trainer_state.safetensors``) served by ``dflash serve eval --engine vllm``'s code without its baseline
  engine (one engine a module); the outputs are compared with plain greedy decoding of the target in
  this process (its margins are planted wide, so float32 kernels cannot flip a token), and the steps
  with this project's own speculative decode of the same checkpoint (``dflash eval``'s). The same for
  one fitted over a draft vocabulary (300 rows, chosen from the tokens it is fitted on, so every
  token of the decode is inside); its engine's log (vLLM at INFO) must say the drafter keeps its own
  ``lm_head`` and never that it shares the target's.
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
VOCAB_N = 100  # a draft vocabulary's rows: not a multiple of vLLM's padding (64)
PADDED = {"lm_head.weight", "model.markov_head.markov_w2.weight"}  # ParallelLMHead: rows padded to 64
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
    "dflash-draft-vocab": (dict(draft_vocab_size=VOCAB_N), "ok"),
    "dspark-draft-vocab": (dict(architecture="dspark", options=SPARK, draft_vocab_size=VOCAB_N), "ok"),
}


def tiny(**fields) -> DFlashDrafter:
    """A float32 drafter for the tiny target (hidden 128, 6 layers, vocabulary 2048): 2 layers, block 4;
    with ``draft_vocab_size``, over that many distinct target ids drawn from the whole vocabulary."""
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
    embed, head = torch.randn(2048, 128, generator=g), torch.randn(2048, 128, generator=g)
    n = dcfg.draft_vocab_size
    ids = torch.randperm(2048, generator=g)[:n].sort().values if n else None
    return DFlashDrafter(dcfg, embed, head, ids)


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
    vLLM builds its drafter, every parameter first filled with NaN (an integer one, ``d2t``'s, with its
    dtype's least value: :func:`unfilled`)."""
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
                p.fill_(float("nan") if p.is_floating_point() else torch.iinfo(p.dtype).min)
        read: dict[str, torch.Tensor] = {}

        def weights():
            for name, w in get_model_loader(vc.load_config).get_all_weights(dmc, model):
                read[name] = w.clone()
                yield name, w

        model.load_weights(weights())
    return model, read


def unfilled(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` still holds :func:`load_into_vllm`'s fill."""
    return torch.isnan(t) if t.is_floating_point() else t == torch.iinfo(t.dtype).min


def sources(param: str) -> list[str]:
    """The checkpoint keys a vLLM parameter is loaded from (``model.`` added, stacked projections fused,
    ``d2t`` renamed)."""
    if param == "draft_id_to_target_id":
        return ["d2t"]
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
            assert unfilled(p).all(), f"{pname}: filled, but from no checkpoint key"
            continue
        want_t = torch.cat([saved[k] for k in keys]) if len(keys) > 1 else saved[keys[0]]
        if pname in PADDED and p.shape[0] > want_t.shape[0]:  # a draft vocabulary's rows padded to 64,
            n = want_t.shape[0]  # the padding zeroed by the head's loader
            assert p.shape[0] == -(-n // 64) * 64 and not p[n:].any(), (pname, tuple(p.shape))
            p = p[:n]
        assert tuple(p.shape) == tuple(want_t.shape), (pname, tuple(p.shape), tuple(want_t.shape))
        assert torch.equal(p.detach().cpu(), want_t), f"{pname}: other values than {keys}"
        used |= set(keys)
    assert used == set(saved), f"checkpoint keys no vLLM parameter took: {sorted(set(saved) - used)}"
    assert left <= SHARED, f"vLLM parameters nothing loaded: {sorted(left - SHARED)}"


@pytest.mark.parametrize("name", ["dflash-draft-vocab", "dspark-draft-vocab"])
def test_vllm_maps_a_draft_vocabulary_back_to_our_target_ids(name, target_config_dir, tmp_path, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    drafter = tiny(**CASES[name][0])
    dcfg, N = drafter.dcfg, VOCAB_N
    ids = drafter.to_target(torch.arange(N))
    assert dcfg.draft_vocab_size == N and not torch.equal(ids, torch.arange(N))  # (not a prefix)
    ckpt = write_as_trainer(drafter, tmp_path / "run")
    assert json.loads((ckpt / "config.json").read_text())["draft_vocab_size"] == N
    vc, _ = vllm_config(target_config_dir, ckpt, dcfg, monkeypatch)
    assert vc.speculative_config.draft_model_config.hf_config.draft_vocab_size == N
    model, read = load_into_vllm(vc)
    with set_current_vllm_config(vc):  # as vLLM's loader does next (the CPU's linear kernels)
        process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))
    assert torch.equal(read["d2t"], drafter.d2t) and read["d2t"].dtype == torch.int64
    assert torch.equal(model.draft_id_to_target_id.detach(), drafter.d2t)
    assert model.has_own_lm_head, "vLLM would share the target's head (all 2048 rows) with the drafter"
    assert model.lm_head.org_vocab_size == N and model.logits_processor.vocab_size == N
    assert torch.equal(model.lm_head.weight.detach()[:N], drafter.lm_head_weight)
    h = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = drafter.logits(h)  # [5, N]: the rows of the draft vocabulary
        if dcfg.family.name == "dspark":
            r = dcfg.options["markov_rank"]
            mh = model.model.markov_head
            assert tuple(mh.markov_w1.weight.shape) == (2048, r)
            assert mh.markov_w2.org_vocab_size == N and tuple(mh.markov_w2.weight[:N].shape) == (N, r)
            assert torch.equal(mh.markov_w2.weight[:N], drafter.markov_head.markov_w2.weight)
            assert torch.equal(model.map_draft_to_target(torch.arange(N)), ids)
            draft = model.compute_draft_logits(h)  # the speculator's logits over the N rows
            assert draft.shape == (5, N)
            torch.testing.assert_close(draft, ours)
            prev = ids[torch.tensor([0, 7, 99])]  # the previous token is a target id: w1's row of it
            ours_head = drafter.markov_head
            bias = model.markov_bias(model.markov_embed(prev))  # [3, N]
            torch.testing.assert_close(bias, ours_head.markov_w2(ours_head.markov_w1(prev)))
        else:
            logits = model.compute_logits(h)  # scattered to the target's vocabulary
            assert logits.shape == (5, 2048)
            outside = torch.ones(2048, dtype=torch.bool)
            outside[ids] = False
            assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ids]).all()
            torch.testing.assert_close(logits[:, ids], ours)
            assert torch.equal(logits.argmax(-1), drafter.to_target(ours.argmax(-1)))


def test_vllm_has_no_dspine_class():
    from vllm.model_executor.models.registry import ModelRegistry

    archs = set(ModelRegistry.get_supported_archs())
    assert {"DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel"} <= archs
    assert not {a for a in archs if "DSpine" in a}
    spine = tiny(architecture="dspine", options={"transfer_rank": 8, "message_size": 8, "top_k": 4})
    assert any("vLLM" in line for line in serving_problems(spine.dcfg))


def serve_fitted(tmp, draft_vocab: int = 0):
    """A DFlash drafter fitted to the planted target (over ``draft_vocab`` rows, 0: all) and written as
    the trainer writes it, served by ``dflash serve eval --engine vllm``'s code and compared with plain
    greedy decoding and with ``dflash eval``'s decode of the same checkpoint: (the run's record, the
    drafter, its engine's log, vLLM's INFO lines included)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dflash_staged.evaluate.speculative import DrafterProposer, speculative_generate
    from dflash_staged.model.drafters.weights import load_drafter
    from dflash_staged.serve.vllm.evaluate import serve_eval_vllm

    from planted import greedy_continuation, planted_target
    from served import LAYERS, fitted_checkpoint, prompts

    target = planted_target(LAYERS)
    target.model.save_pretrained(tmp / "target")
    ps, n = prompts(4), 24
    fitted = fitted_checkpoint(tmp / "fit", "dflash", target, tmp / "target", ps, n, draft_vocab=draft_vocab)
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
        baseline=False, compare=tmp / "eval.json", log=True, quiet=True,
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
    return run, drafter, (tmp / "out" / "logs" / "vllm-spec.log").read_text(errors="replace")


OWN_HEAD = "Keeping separate lm_head weights from the target model"  # vLLM's proposer, as it loads
SHARED_HEAD = "Sharing target model lm_head weights"


def test_the_trainer_s_checkpoint_serves_in_vllm_losslessly(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # (the engine's processes read it as they start)
    _, _, log = serve_fitted(tmp_path_factory.mktemp("served"))
    assert SHARED_HEAD in log and OWN_HEAD not in log, log[-4000:]  # (no lm_head saved: the target's)


def test_a_draft_vocabulary_drafter_serves_in_vllm_losslessly(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    run, drafter, log = serve_fitted(tmp_path_factory.mktemp("served-vocab"), draft_vocab=300)
    assert drafter.dcfg.draft_vocab_size == 300 and drafter.d2t is not None
    ids = set(drafter.to_target(torch.arange(300)).tolist())
    assert all(set(r["tokens"]) <= ids for r in run["per_prompt"])  # (the decode never needs one outside)
    assert OWN_HEAD in log and SHARED_HEAD not in log, log[-4000:]  # its 300 rows, not the target's 2048

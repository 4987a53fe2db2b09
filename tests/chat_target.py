"""A tiny chat target that both Hugging Face and llama.cpp tokenise and render alike, for the tests that
regenerate through a real ``llama-server``.

:func:`save_chat_target` writes an ordinary Hugging Face directory: a 2-layer ``LlamaForCausalLM`` (float32,
random weights from a seed, untied head) and a Llama-2-style tokenizer: a SentencePiece BPE model
(``tokenizer.model``, 512 pieces with byte fallback, trained here on a word corpus), which llama.cpp's
converter reads, and the same vocabulary and merges as a ``tokenizers`` BPE (``tokenizer.json``), which
``AutoTokenizer`` reads (transformers' own SentencePiece conversion needs protobuf, which the project does
not install). The chat template is plain text (no special tokens), so both sides tokenise a prompt as one
piece of text. The head rows of ``<unk>``, ``<s>`` and the byte tokens of non-ASCII bytes are zeroed, so
greedy decoding never emits them (both sides then decode the answer to the same text); ``</s>`` ends an
answer on both sides. ``template`` replaces the chat template (a mismatch test serves one target's weights
with another template).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = (
    "the a of and to in is it you that he was for on are with as his they be at one have this from or by "
    "word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him "
    "two has look more day could go come did number sound no most people my over know water than call "
    "first who may down side been now find any new work part take get place made live where after back "
    "little only round man year came show every good me give our under name very through just form great"
).split()
VOCAB = 512


def _corpus(n: int = 3000) -> str:
    r = random.Random(0)
    return "\n".join(
        " ".join(r.choice(WORDS) for _ in range(r.randint(3, 15))) + r.choice(".?!,:") for _ in range(n)
    )


def _tokenizer_json(sp) -> dict:
    """The SentencePiece BPE model as a ``tokenizers`` BPE (transformers' Llama conversion, done here)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, i in vocab.items():
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or len(piece) < 2:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        local = sorted(
            (p for p in splits if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]])
        )
        merges += [(sp.get_score(i), p) for p in local]
    merges = [p for _, p in sorted(merges, key=lambda m: -m[0])]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return json.loads(tok.to_str())


def save_chat_target(dir: Path, seed: int = 0, template: str = TEMPLATE, hidden: int = 64) -> Path:
    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dir.mkdir(parents=True, exist_ok=True)
    corpus = dir / "corpus.txt"
    corpus.write_text(_corpus())
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(dir / "tokenizer"),
        vocab_size=VOCAB,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    (dir / "tokenizer.vocab").unlink(missing_ok=True)
    sp = spm.SentencePieceProcessor(model_file=str(dir / "tokenizer.model"))
    (dir / "tokenizer.json").write_text(json.dumps(_tokenizer_json(sp)))
    (dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "chat_template": template,
            }
        )
    )
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        head = model.lm_head.weight
        head.normal_(0, 1.0)
        dead = [0, 1] + [i for i in range(VOCAB) if sp.is_byte(i) and int(sp.id_to_piece(i)[3:5], 16) >= 0x80]
        head[dead] = 0
        _plant_eos(model, sp)
    model.save_pretrained(dir)
    return dir


def _plant_eos(model, sp) -> None:
    """Make ``</s>`` take the place of a token that greedy answers often hold after a few tokens, so some
    answers stop at eos (at varied lengths) and others at the length cap."""
    import torch

    outs = []
    for i in range(12):
        ids = sp.encode(f"user: tell me about the water number {i}\nassistant:")
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=2)
        outs.append(out[0, len(ids) :].tolist())
    counts: dict[int, int] = {}
    for o in outs:
        for t in set(o[2:]):
            counts[t] = counts.get(t, 0) + 1
    pick = min(counts, key=lambda t: (abs(counts[t] - len(outs) // 2), t))
    head = model.lm_head.weight
    head[2] = head[pick] * 1.05

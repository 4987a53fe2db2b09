"""Chat-template options: [data] chat_template_kwargs / chat_template shape plan's tokens and loss, are
recorded in the manifest and the checkpoints, and `dflash eval` renders its prompts with them."""

import json

import pytest

from dflash_staged.config import ConfigError, load_config
from dflash_staged.manifest import Manifest
from dflash_staged.model.target.tiny import build_tiny_tokenizer

from helpers import cli, write_config

# A Qwen3-style template written for these tests, with Qwen3's switch: the generation prompt ends
# with an empty <think> block when enable_thinking is false; the last assistant turn after the
# last user turn always shows a <think> block (empty without reasoning); earlier turns lose theirs.
QWEN3_STYLE = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set c = m.content %}{%- set r = '' %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{%- set c = c.split('</think>')[-1].lstrip() %}{%- endif %}"
    "{%- if loop.index0 > ns.last and (loop.last or r) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r + '\\n</think>\\n\\n' + c }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + c }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
CONV = [
    {"role": "user", "content": "what is the capital of france"},
    {"role": "assistant", "content": "paris is the answer, the data says so."},
]
PROMPT = [{"role": "user", "content": "explain why the model is fast"}]


def setup_plan(tmp_path, thinking: bool, name: str, template_text: str = QWEN3_STYLE):
    tpl = tmp_path / "qwen3-style.jinja"
    tpl.write_text(template_text)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONV}) + "\n" for _ in range(6)))
    extra = (
        f'[data]\nmin_loss_tokens = 1\ntoken_budget = 512\nchat_template = "{tpl}"\n'
        f"chat_template_kwargs = {{ enable_thinking = {str(thinking).lower()} }}\n"
    )
    cfg = write_config(tmp_path / f"{name}.toml", extra)
    code, out = cli("plan", "--config", cfg, "--data", data, "--manifest", tmp_path / name)
    return cfg, code, out


def loss_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids.tolist(), mask.tolist()) if m])


def test_enable_thinking_moves_the_empty_think_block_out_of_the_loss(tmp_path):
    tok = build_tiny_tokenizer()
    _, code, out = setup_plan(tmp_path, False, "off")
    assert code == 0, out
    _, code, out = setup_plan(tmp_path, True, "on")
    assert code == 0, out
    with (
        Manifest.open(tmp_path / "off", readonly=True) as off,
        Manifest.open(tmp_path / "on", readonly=True) as on,
    ):
        (ids_off, mask_off), (ids_on, mask_on) = off.sample(0), on.sample(0)
        assert off.meta["chat"] == {
            "kwargs": {"enable_thinking": False},
            "template": QWEN3_STYLE,
            "template_path": str(tmp_path / "qwen3-style.jinja"),
        }
        assert on.meta["config"]["data"]["chat_template_kwargs"] == {"enable_thinking": True}
    # Qwen3's template renders a finished conversation alike in both modes; what differs is the
    # generation prompt, so the empty think block is prompt (non-thinking) or generated text (thinking)
    assert (
        tok.decode(ids_off.tolist())
        == tok.decode(ids_on.tolist())
        == (
            "<|im_start|>user\nwhat is the capital of france<|im_end|>\n<|im_start|>assistant\n"
            + EMPTY_THINK
            + "paris is the answer, the data says so.<|im_end|>\n"
        )
    )
    assert loss_text(tok, ids_off, mask_off) == "paris is the answer, the data says so.<|im_end|>"
    assert loss_text(tok, ids_on, mask_on) == EMPTY_THINK + "paris is the answer, the data says so.<|im_end|>"


def test_reasoning_data_in_non_thinking_mode_is_flagged(tmp_path):
    """A reasoning answer rendered in non-thinking mode is not a continuation of the generation prompt."""
    reasoning = {
        "conversations": [
            {"from": "human", "value": "what is the capital of france"},
            {"from": "gpt", "value": "<think>\nrecall it\n</think>\n\nparis, says the data."},
        ]
    }
    for thinking, warned in ((False, True), (True, False)):
        _, code, out = setup_plan(tmp_path, thinking, f"m-{thinking}")
        assert code == 0 and "warning:" not in out, out
        data = tmp_path / "chat.jsonl"
        data.write_text(data.read_text() + json.dumps(reasoning) + "\n")
        cfg = tmp_path / f"m-{thinking}.toml"
        code, out = cli("plan", "--config", cfg, "--data", data, "--manifest", tmp_path / f"r-{thinking}")
        assert code == 0, out
        assert (
            "warning: in 1 conversation(s) the last assistant turn does not continue the generation prompt"
            in out
        ) is warned, out


def test_the_template_file_counts_in_the_plan_identity(tmp_path):
    cfg, code, out = setup_plan(tmp_path, False, "m")
    assert code == 0, out
    code, out = cli("plan", "--config", cfg, "--data", tmp_path / "chat.jsonl", "--manifest", tmp_path / "m")
    assert code == 0 and "already holds this plan" in out, out
    (tmp_path / "qwen3-style.jinja").write_text(QWEN3_STYLE.replace("<|im_end|>\\n", "<|im_end|>\\n\\n"))
    code, out = cli("plan", "--config", cfg, "--data", tmp_path / "chat.jsonl", "--manifest", tmp_path / "m")
    assert code == 1 and "data_hash" in out, out
    (tmp_path / "qwen3-style.jinja").unlink()
    code, out = cli("plan", "--config", cfg, "--data", tmp_path / "chat.jsonl", "--manifest", tmp_path / "m2")
    assert code == 1 and out.count("\n") == 1 and "data.chat_template" in out and "cannot read" in out, out
    assert not (tmp_path / "m2").exists()


@pytest.mark.parametrize(
    "toml, what",
    [
        ("chat_template_kwargs = 5", "data.chat_template_kwargs: expected a table"),
        ("chat_template_kwargs = { tokenize = true }", "data.chat_template_kwargs.tokenize: dflash sets"),
        ("chat_template_kwargs = { when = 1979-05-27 }", "data.chat_template_kwargs: Object of type date"),
    ],
)
def test_bad_chat_options_in_the_config(tmp_path, toml, what):
    p = tmp_path / "c.toml"
    p.write_text(f"[data]\n{toml}\n")
    with pytest.raises(ConfigError, match=what):
        load_config(p)


@pytest.mark.slow
def test_eval_renders_prompts_with_the_recorded_options(tmp_path):
    """plan (non-thinking) -> extract -> train -> eval: the prompt gets the empty think block."""
    _, code, out = setup_plan(tmp_path, False, "m")
    assert code == 0, out
    store, run = tmp_path / "store", tmp_path / "run"
    for args in (
        ("extract", "--manifest", tmp_path / "m", "--store", store, "--devices", "cpu"),
        ("train", "--manifest", tmp_path / "m", "--store", store, "--out", run, "--device", "cpu"),
    ):
        code, out = cli(*args)
        assert code == 0, out
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": PROMPT + [{"role": "assistant", "content": "reference"}]}) + "\n"
    )
    tok = build_tiny_tokenizer()
    tok.chat_template = QWEN3_STYLE

    def eval_report(*extra):
        code, out = cli(
            "eval",
            "--drafter",
            run,
            "--target",
            "tiny:qwen3",
            "--prompts",
            prompts,
            "--max-new-tokens",
            2,
            "--no-baseline",
            "--json",
            *extra,
        )
        assert code == 0, out
        return json.loads(out.strip().splitlines()[-1])

    def rendered(thinking: bool) -> int:
        text = tok.apply_chat_template(
            PROMPT, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        return len(tok(text, add_special_tokens=False)["input_ids"])

    r = eval_report()
    assert r["chat"]["kwargs"] == {"enable_thinking": False} and r["chat"]["from"].startswith(
        "the checkpoint's record, "
    )
    assert r["per_prompt"][0]["prompt_tokens"] == rendered(False)
    r = eval_report("--chat-template-kwargs", '{"enable_thinking": true}')
    assert r["chat"]["kwargs"] == {"enable_thinking": True}
    assert r["per_prompt"][0]["prompt_tokens"] == rendered(True) < rendered(False)


READS_REASONING = QWEN3_STYLE.replace(
    "{%- set r = '' %}", "{%- set r = m.reasoning_content if m.reasoning_content is defined else '' %}"
)


@pytest.mark.parametrize(
    "template, rendered",
    [
        (READS_REASONING, "<think>\nrecall it\n</think>\n\nparis.<|im_end|>"),  # reads the field (Qwen3)
        (QWEN3_STYLE, "<think>\nrecall it\n</think>\n\nparis.<|im_end|>"),  # splits the content itself
        (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}",
            "<think>\nrecall it\n</think>\n\nparis.",  # knows no reasoning at all
        ),
    ],
)
def test_reasoning_stored_apart_is_rendered_and_carries_the_loss(template, rendered):
    """``dflash regenerate`` stores reasoning in ``reasoning_content``: plan renders it whatever the template
    (read by the template, else put back in front of the answer) and it carries the loss."""
    from dflash_staged.chat import ChatOptions, tokenize_messages

    tok = build_tiny_tokenizer()
    msgs = [
        {"role": "user", "content": "what is the capital of france"},
        {"role": "assistant", "content": "paris.", "reasoning_content": "recall it"},
    ]
    chat = ChatOptions({"enable_thinking": True}, template)
    ids, mask = tokenize_messages(tok, msgs, chat)
    assert rendered in tok.decode(ids.tolist())
    loss = loss_text(tok, ids, mask)
    assert loss.startswith("<think>\nrecall it\n</think>") and "paris." in loss, loss

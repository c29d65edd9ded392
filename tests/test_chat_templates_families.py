"""What the preset families' chat templates do to the labels: Qwen3's reasoning block and
``enable_thinking``, Llama 3.1's date header, Gemma 3's folding of the system turn into the
first user turn.

Templates: the reproductions in tests/family_templates.py (what the model runs in
tests/test_families.py train with), checked here to render as the real ones do: TRL's copies of
Qwen/Qwen3-8B's, meta-llama/Llama-3.1-8B-Instruct's and google/gemma-3-4b-it's templates
(``trl/chat_templates/{qwen3,llama3_1,gemma3}.jinja``). Rows: the bundled SQuAD conversations,
some with a system turn. Labels are compared with TRL's SFTTrainer: Gemma 3's messages rows with
``assistant_only_loss`` (TRL swaps in its ``gemma3_training`` template), Llama 3.1's (TRL has no
training template for it and refuses assistant_only_loss there) and Gemma 3's as prompt-completion
rows (TRL's completion mask): equal token for token, but for the newline Gemma 3 writes after
``<end_of_turn>``, which TRL labels and the project does not (docs/models.md). Qwen3's own
template against TRL: tests/test_chat_labels.py's
test_qwen3_rows_differ_from_trls_only_where_documented.
DeepSeek-R1-Distill's own template is refused (its generation prompt opens a think block its
replies never have); with TRL's training variant of it the labels are TRL's. GLM-4's writes no
token after a reply (the model stops by writing ``<|user|>``): that token is labelled after each
reply and written after the last one, as ms-swift's GLM-4 template labels its suffix (TRL refuses
``assistant_only_loss`` on a template without generation markers, and has no GLM-4 training
template).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from family_templates import GEMMA3, GLM4, LLAMA3_1, QWEN3, family_tokenizer
from test_chat_labels import (
    TRL_1_16,
    conversations,
    labelled_runs,
    our_sft,
    ours,
    read,
    template,
    trl,
    trl_sft,
    with_reasoning,
)
from transformers import AutoModelForCausalLM

from recipes.tasks import chat

MINE = {"qwen3": QWEN3, "llama3_1": LLAMA3_1, "gemma3": GEMMA3}


def rows(family: str) -> list[dict]:
    """The bundled conversations (each opens with a system turn), every other one without
    it; Qwen3's with reasoning too."""
    plain = conversations()
    with_system = [{"messages": r["messages"][1:]} if i % 2 else r for i, r in enumerate(plain)]
    if family == "qwen3":
        with_system += [with_reasoning(r, i) for i, r in enumerate(plain)]
    return with_system


@pytest.mark.parametrize("family", sorted(MINE))
def test_reproductions_render_as_the_real_templates(tmp_path, family):
    """Every row, whole and as a prompt with the generation prompt, renders the same text by
    the reproduction and by the real template (``enable_thinking`` both ways for Qwen3)."""
    tokenizer = family_tokenizer(family)
    real = template(family)
    options = [{"enable_thinking": False}, {"enable_thinking": True}] if family == "qwen3" else [{}]
    for row in read(tmp_path, rows(family)):
        messages = chat.template._for_template(row["messages"])
        for kwargs in options:
            for prompt in (False, True):
                shown = messages[:-1] if prompt else messages
                texts = [
                    tokenizer.apply_chat_template(
                        shown,
                        chat_template=t,
                        add_generation_prompt=prompt,
                        tokenize=False,
                        **kwargs,
                    )
                    for t in (MINE[family], real)
                ]
                assert texts[0] == texts[1]


def test_qwen3_enable_thinking_changes_only_the_generation_prompt(tmp_path):
    """A whole conversation renders the same with thinking on or off (so SFT labels cannot
    depend on it); only a prompt's generation prompt differs: off closes an empty block, which
    a completion then follows (GRPO, DPO prompts render with the template's default: on)."""
    tokenizer = family_tokenizer("qwen3")
    for row in read(tmp_path, rows("qwen3")):
        messages = chat.template._for_template(row["messages"])
        whole = {
            flag: tokenizer.apply_chat_template(
                messages, chat_template=QWEN3, tokenize=False, enable_thinking=flag
            )
            for flag in (True, False)
        }
        assert whole[True] == whole[False]
        prompts = {
            flag: tokenizer.apply_chat_template(
                messages[:-1],
                chat_template=QWEN3,
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=flag,
            )
            for flag in (True, False)
        }
        assert prompts[False] == prompts[True] + "<think>\n\n</think>\n\n"
        assert chat.render_text(tokenizer, QWEN3, row["messages"][:-1], True) == prompts[True]


def test_llama3_1_date_header_and_gemma3_system_turn_are_context(tmp_path):
    """Llama 3.1's system header (its knowledge and today's date, any system text after them)
    and Gemma 3's system text folded into the first user turn get no label: the labelled runs
    are exactly the replies with their end-of-turn token."""
    for family, end in (("llama3_1", "<|eot_id|>"), ("gemma3", "<end_of_turn>")):
        tokenizer = family_tokenizer(family)
        (tmp_path / family).mkdir()
        for raw, row in zip(rows(family), read(tmp_path / family, rows(family)), strict=True):
            features = ours(tokenizer, MINE[family], row)
            text = tokenizer.decode(features["input_ids"])
            replies = [m["content"].strip() for m in raw["messages"] if m["role"] == "assistant"]
            assert labelled_runs(tokenizer, features) == [r + end for r in replies]
            if family == "llama3_1":
                assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024" in text
            elif raw["messages"][0]["role"] == "system":
                system = raw["messages"][0]["content"]
                assert "<start_of_turn>user\n" + system + "\n\n" in text
                assert "<start_of_turn>system" not in text


# THUDM/glm-4-9b-chat-hf's template with its tool branch left out (the template as llama.cpp's
# tests/test-chat-template.cpp and Berkeley's function-calling leaderboard quote it).
GLM4_REAL = (
    "[gMASK]<sop>{% for item in messages %}{% if item['content'] %}<|{{ item['role'] }}|>"
    "{{ item['metadata'] }}\n{{ item['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_glm4_labels_the_token_that_stops_each_reply(tmp_path):
    """GLM-4 ends no reply with a token of its own: the next turn's ``<|user|>`` is what the
    model writes to stop (its generation config lists it as an end of generation). It is
    labelled after every reply and written after the last, and it is the task's stop token;
    without it an SFT'd GLM-4 would never learn to stop."""
    tokenizer = family_tokenizer("glm4")
    raw = rows("glm4")
    for row in raw:
        assert chat.render_text(tokenizer, GLM4, row["messages"]) == chat.render_text(
            tokenizer, GLM4_REAL, row["messages"]
        )
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    assert chat.template.turn_ender(tokenizer, GLM4) == user
    assert chat.template.end_of_turn(tokenizer, GLM4) == [user]
    for raw_row, row in zip(raw, read(tmp_path, raw), strict=True):
        features = ours(tokenizer, GLM4, row)
        replies = [m["content"] for m in raw_row["messages"] if m["role"] == "assistant"]
        assert labelled_runs(tokenizer, features) == [f"\n{r}<|user|>" for r in replies]
        assert features["input_ids"][-1] == user == features["labels"][-1]
    # Templates whose turns end with a token of their own are left as they were.
    for family in ("qwen3", "llama3_1", "gemma3"):
        assert chat.template.turn_ender(family_tokenizer(family), MINE[family]) is None


@pytest.fixture(scope="module")
def tiny_model():
    return AutoModelForCausalLM.from_pretrained(chat.template.ASSETS / "tiny-llama")


@pytest.mark.slow
@TRL_1_16
@pytest.mark.parametrize("family", ["llama3_1", "gemma3"])
def test_labels_equal_trls(tmp_path, tiny_model, family):
    """On the real template: prompt-completion rows (the last reply the completion) labelled
    as TRL's completion mask, token for token; Gemma 3's messages rows (with system turns)
    as TRL's assistant_only_loss."""
    tokenizer = copy.deepcopy(family_tokenizer(family))
    tokenizer.chat_template = template(family)
    sample = rows(family)[:16]
    sets = {
        "prompt-completion": [
            {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in sample
        ]
    }
    if family == "gemma3":
        sets["messages"] = sample
    for name, rows_ in sets.items():
        config = {"assistant_only_loss": True} if name == "messages" else {}
        theirs = trl_sft(tmp_path / name, tokenizer, tiny_model, rows_, **config)
        mine = our_sft(tmp_path / name, tokenizer, rows_)
        assert len(mine) == len(theirs) == 16
        for (ids, labels), (their_ids, their_labels) in zip(mine, theirs, strict=True):
            assert ids == their_ids, name
            differ = [k for k in range(1, len(ids)) if labels[k] != their_labels[k]]
            if family == "llama3_1":
                assert not differ
                continue
            # Gemma 3 writes a newline after <end_of_turn>: TRL labels it, the project does not
            # (docs/models.md). That is the only difference, once after each labelled reply.
            runs = labelled_runs(tokenizer, {"input_ids": ids, "labels": labels})
            assert all(run.endswith("<end_of_turn>") for run in runs)
            assert len(differ) == len(runs), name
            assert all(
                labels[k] == chat.IGNORE_INDEX and labels[k - 1] == ids[k - 1] for k in differ
            )
            assert tokenizer.decode([ids[k] for k in differ]) == "\n" * len(differ)


def r1_distill_tokenizer():
    """The tiny tokenizer with DeepSeek-R1-Distill's chat tokens, BOS, EOS and its own template
    (TRL's copy: every distill checkpoint ships it byte for byte)."""
    tokenizer = family_tokenizer("qwen2_5")
    tokens = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    tokenizer.add_tokens(tokens, special_tokens=True)
    tokenizer.bos_token, tokenizer.eos_token = tokens[0], tokens[1]
    tokenizer.chat_template = template("deepseek_r1_distill")
    return tokenizer


def reasoned_inline(count: int) -> list[dict]:
    return [with_reasoning(r, 0) for r in conversations()[:count]]  # <think> in the content


def test_r1_distill_own_template_is_refused_naming_the_fix(tmp_path):
    """DeepSeek-R1-Distill's own template opens a think block in its generation prompt but
    renders a reply without it (it drops everything up to ``</think>``, the last reply's too):
    no reply starts where a generation prompt ends, and its reasoning is never rendered, so
    the conversation is refused in one line naming the fix."""
    tokenizer = r1_distill_tokenizer()
    for row in read(tmp_path, [conversations()[0], *reasoned_inline(1)]):
        with pytest.raises(chat.template.TemplateMismatch, match="generation %} markers"):
            ours(tokenizer, tokenizer.chat_template, row)


@pytest.mark.slow
@TRL_1_16
def test_r1_distill_with_trls_training_template_labels_as_trl(tmp_path, tiny_model):
    """task.chat_template=<TRL's deepseek_r1_distill_training.jinja> (the same template with
    ``{% generation %}`` markers and the reasoning kept, docs/models.md): ids and labels equal
    TRL's assistant_only_loss on the model's own tokenizer (TRL swaps that template in)."""
    tokenizer = r1_distill_tokenizer()
    rows_ = reasoned_inline(8) + conversations()[8:16]
    theirs = trl_sft(tmp_path, tokenizer, tiny_model, rows_, assistant_only_loss=True)
    training = Path(trl.__file__).parent / "chat_templates"
    mine = our_sft(
        tmp_path,
        tokenizer,
        rows_,
        chat_template=str(training / "deepseek_r1_distill_training.jinja"),
    )
    assert len(mine) == len(theirs) == 16
    for (ids, labels), (their_ids, their_labels) in zip(mine, theirs, strict=True):
        assert ids == their_ids
        assert labels[1:] == their_labels[1:]
    assert "<think>\nThe passage says: " in tokenizer.decode(
        [t for t in mine[0][1] if t != chat.IGNORE_INDEX]
    )

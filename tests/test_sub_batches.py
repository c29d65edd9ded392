"""``trainer.sub_batches``: a micro-batch run as length-sorted sub-batches trains as the whole.

The cut is checked against every possible cut; the training runs use the bundled tiny BERT with
its dropout off, so the same batches must give the same losses and weights whether each runs
whole, in sub-batches, or in sub-batches on two processes.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_task, read_metrics, run_torchrun, run_train
from safetensors.torch import load_file
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding

from recipes.config import ASSETS
from recipes.data import SubBatchCollator, length_pieces
from recipes.tasks.base import Averaging


def _padded_tokens(lengths: list[int], groups: list[list[int]]) -> int:
    return sum(len(group) * max(lengths[i] for i in group) for group in groups)


def _fewest_tokens(lengths: list[int], pieces: int) -> int:
    """Every cut of the longest-first order into at most ``pieces`` runs."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = None
    for cuts in range(pieces):
        for points in itertools.combinations(range(1, len(order)), cuts):
            bounds = [0, *points, len(order)]
            groups = [order[a:b] for a, b in itertools.pairwise(bounds)]
            tokens = _padded_tokens(lengths, groups)
            best = tokens if best is None else min(best, tokens)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_cut_pads_fewest_tokens_and_keeps_every_row_once(seed):
    generator = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 10, (1,), generator=generator))
    lengths = torch.randint(3, 60, (rows,), generator=generator).tolist()
    pieces = int(torch.randint(1, 5, (1,), generator=generator))
    groups = length_pieces(lengths, pieces)
    assert sorted(i for group in groups for i in group) == list(range(rows))
    assert 1 <= len(groups) <= pieces
    assert _padded_tokens(lengths, groups) == _fewest_tokens(lengths, pieces)
    longest = [max(lengths[i] for i in group) for group in groups]
    assert longest == sorted(longest, reverse=True)


def test_equal_lengths_stay_one_batch():
    assert length_pieces([7] * 5, 4) == [[0, 1, 2, 3, 4]]


def test_sub_batches_are_padded_to_their_own_longest():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-bert")
    features = [
        {"input_ids": [1] * n, "attention_mask": [1] * n, "start_positions": n % 3}
        for n in (9, 40, 11, 38, 10, 39)
    ]
    padding = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    pieces = SubBatchCollator(padding, 4, multiple=8)(features)
    assert [tuple(p["input_ids"].shape) for p in pieces] == [(3, 40), (3, 16)]
    assert sorted(int(s) for p in pieces for s in p["start_positions"]) == sorted(
        f["start_positions"] for f in features
    )


# ------------------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def dropout_free_bert(tmp_path_factory) -> Path:
    """The bundled tiny BERT with dropout off: the same batches must then give the same steps."""
    folder = tmp_path_factory.mktemp("tiny-bert-no-dropout")
    for file in (ASSETS / "tiny-bert").iterdir():
        shutil.copy(file, folder / file.name)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _qa_run(model: Path, cache_dir: Path, out: Path, *extra: str) -> tuple[str, ...]:
    return (
        "recipe=bert_squad",
        "debug=smoke",
        "logger=none",
        f"model.name_or_path={model}",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=1",
        "trainer.per_device_train_batch_size=8",
        "optimizer.lr=1e-3",
        "scheduler.warmup_steps=0",
        "trainer.save_every_n_steps=0",
        "trainer.eval_at_end=false",
        "trainer.progress_bar=false",
        f"output_dir={out}",
        *extra,
    )


def _losses(run: Path) -> list[float]:
    return [m["train/loss"] for m in read_metrics(run) if "train/loss" in m]


@pytest.mark.slow
def test_sub_batches_train_as_whole_batches_on_one_and_two_processes(
    tmp_path, cache_dir, dropout_free_bert
):
    whole, pieces, two = tmp_path / "whole", tmp_path / "pieces", tmp_path / "two"
    run_train(*_qa_run(dropout_free_bert, cache_dir, whole, "trainer.sub_batches=1"))
    proc = run_train(*_qa_run(dropout_free_bert, cache_dir, pieces, "trainer.sub_batches=4"))
    assert "up to 4 sub-batches" in (pieces / "train.log").read_text(), proc.stderr[-2000:]
    torchrun = run_torchrun(
        *_qa_run(dropout_free_bert, cache_dir, two, "trainer.sub_batches=4"),
        "trainer.per_device_train_batch_size=4",
    )
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]

    expected = _losses(whole)
    assert len(expected) == 4
    assert _losses(pieces) == pytest.approx(expected, rel=1e-5)
    assert _losses(two) == pytest.approx(expected, rel=1e-5)
    weights = load_file(whole / "final" / "model.safetensors")
    for run in (pieces, two):
        other = load_file(run / "final" / "model.safetensors")
        # Adam divides by the gradient's running scale, so float rounding in a near-zero
        # gradient moves a weight by up to about lr x steps; a wrong gradient moves them all.
        worst = max((other[n] - t).abs().max().item() for n, t in weights.items())
        assert worst < 4e-3, worst  # lr 1e-3 x 4 steps
        close = sum(torch.isclose(other[n], t, atol=1e-6).sum().item() for n, t in weights.items())
        assert close / sum(t.numel() for t in weights.values()) > 0.99


@pytest.mark.parametrize("ignores_padding", [True, False])
def test_the_qa_loss_does_not_depend_on_padding_unless_asked(ignores_padding):
    task = make_task("qa", loss_ignores_padding=ignores_padding)
    assert (task.loss_shape().averaging == Averaging.row_mean) is ignores_padding
    assert "loss_ignores_padding" not in task.features_key()  # shapes no feature: not in the key
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-bert")
    model = AutoModelForQuestionAnswering.from_pretrained(ASSETS / "tiny-bert").eval()
    features = [
        {**tokenizer("who wrote it?", "a long context that goes on " * n), "start_positions": 6}
        for n in (1, 3)
    ]
    for feature in features:
        feature["end_positions"] = 8
    losses = [
        float(
            task.loss(
                model, DataCollatorWithPadding(tokenizer, padding=pad, max_length=64)(features)
            ).detach()
        )
        for pad in ("longest", "max_length")
    ]
    if ignores_padding:
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    else:  # transformers' head scores the padding too, as the examples train
        assert abs(losses[0] - losses[1]) > 1e-3
        whole = DataCollatorWithPadding(tokenizer)(features)
        assert losses[0] == pytest.approx(float(model(**whole).loss.detach()), rel=1e-6)

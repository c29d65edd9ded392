"""The loop's speed settings decided per device (``recipes.device.training_defaults``): a CPU
keeps what won there, an accelerator runs whole micro-batches in length buckets, and whatever the
recipe or the command line sets wins."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes import config, device, modes

CONF = Path(__file__).resolve().parents[1] / "conf"

SPEED = ("padding", "pad_to_multiple_of", "sub_batches", "pin_memory", "compile")


def _chosen(kind: str, **context) -> dict:
    context = {"generates": False, "whole_model": True, **context}
    return {d.name: d.value for d in device.training_defaults(kind, **context)}


def test_cpu_keeps_the_defaults_measured_on_cpus() -> None:
    assert _chosen(device.CPU) == {
        "padding": "longest",
        "pad_to_multiple_of": 8,
        "sub_batches": 4,
        "pin_memory": False,
        "compile": False,
    }
    assert _chosen(device.CPU, generates=True) == _chosen(device.CPU)


@pytest.mark.parametrize("kind", [device.CUDA, device.MUSA])
def test_accelerators_run_whole_batches_in_length_buckets(kind: str) -> None:
    chosen = _chosen(kind)
    assert chosen["sub_batches"] == 1
    assert chosen["padding"] == "longest"
    assert chosen["pad_to_multiple_of"] == device.ACCELERATOR_LENGTH_BUCKET
    assert chosen["pin_memory"] is True


def test_compile_only_where_it_was_measured_and_shapes_stay_few() -> None:
    assert _chosen(device.CUDA)["compile"] is True  # an encoder task on one device or DDP
    assert _chosen(device.CUDA, generates=True)["compile"] is False
    assert _chosen(device.CUDA, whole_model=False)["compile"] is False
    assert _chosen(device.MUSA)["compile"] is False  # unmeasured on a card
    every = device.training_defaults(device.MUSA, generates=False, whole_model=True)
    assert all(d.why for d in every) and {d.name for d in every} == set(SPEED)


def test_the_trainer_leaves_them_to_the_device() -> None:
    trainer = config.TrainerConfig()
    assert all(getattr(trainer, name) is None for name in SPEED)


def test_set_values_win_and_every_choice_is_said(monkeypatch) -> None:
    config.register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "output_dir=/tmp/unused",
                "trainer.sub_batches=2",
                "trainer.pin_memory=true",
            ],
        )
    settings = config.validate(cfg)
    task = modes.build_task(settings.task)
    monkeypatch.setattr(device, "backend", lambda: device.CPU)
    decided, lines = modes.with_device_defaults(settings, task)
    trainer = decided.trainer
    assert (trainer.sub_batches, trainer.pin_memory) == (2, True)
    assert (trainer.padding, trainer.pad_to_multiple_of, trainer.compile) == ("longest", 8, False)
    assert len(lines) == len(SPEED)
    assert "trainer.sub_batches=2 (set by the run's config)" in lines
    assert any(line.startswith("trainer.pad_to_multiple_of=8 (cpu") for line in lines)
    assert dataclasses.asdict(settings.trainer)["sub_batches"] == 2  # the given settings kept

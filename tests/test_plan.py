"""The memory plan (recipes/plan.py): its arithmetic against the models transformers and peft
build (on the meta device: no memory, no download), its verdicts and fixes, the command, the
refusal of a run that cannot fit and the line an out-of-memory ends a run with. The plan
against measured peaks is scripts/plan_check.py's grid; one small point of it runs here in the
slow set."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import on_musa, run_train

from recipes import checkpoint, plan
from recipes.model_shapes import SHAPES, reduced

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = "Qwen/Qwen3-8B"


def _meta_model(config: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def _count(model, trainable: bool = False) -> int:
    # Tied weights are one parameter (parameters() yields each once).
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_parameter_count_is_the_models(name: str) -> None:
    """Every kept shape, at 2 layers (the count per layer is what the depth multiplies), has
    the parameters transformers builds for it."""
    config = reduced(name, 2)
    assert plan.ModelShape.from_config(config).params == _count(_meta_model(config))


def test_lora_count_is_peft_s() -> None:
    """LoRA's parameters as peft makes them for every linear layer but the output layer."""
    from peft import LoraConfig, get_peft_model

    config = reduced("Qwen/Qwen3-0.6B", 2)
    model = get_peft_model(_meta_model(config), LoraConfig(r=8, target_modules="all-linear"))
    assert plan.ModelShape.from_config(config).lora_params(8) == _count(model, trainable=True)


def _run(**changes) -> plan.RunShape:
    base = plan.RunShape(task="sft", rows=1, seq=4096, eval_rows=0, weight_bytes=2, compute_bytes=2)
    return replace(base, **changes)


def test_settings_shrink_the_parts_they_name() -> None:
    shape = plan.model_shape(QWEN3_8B)
    full = plan.plan(shape, _run())
    # bf16 weights, gradients and 2 AdamW moments, and the step's fp32 temporaries
    assert full.peak_bytes > 12 * shape.params
    ckpt = plan.plan(shape, _run(checkpointing=True))
    acts = {p.name: p.bytes for p in full.phases[0].parts}["activations"]
    acts_ckpt = {p.name: p.bytes for p in ckpt.phases[0].parts}["activations"]
    assert acts_ckpt < acts / 5
    offload = plan.plan(shape, _run(activation_offload=True))
    assert offload.host_bytes == acts
    sharded = plan.plan(shape, _run(shard=8, processes=8, checkpointing=True))
    assert sharded.peak_bytes < ckpt.peak_bytes / 3
    on_host = plan.plan(shape, _run(shard=8, processes=8, fsdp_offload=True, checkpointing=True))
    assert on_host.peak_bytes < sharded.peak_bytes
    assert on_host.host_bytes == shape.params * (2 + 2 + 4) // 8  # this process's shards
    lora = plan.plan(shape, _run(lora_rank=16, checkpointing=True))
    assert lora.peak_bytes < ckpt.peak_bytes / 2
    longer = plan.plan(shape, _run(seq=8192))
    assert longer.peak_bytes > full.peak_bytes


def _parts(found: plan.Plan, phase: str) -> dict[str, int]:
    return {p.name: p.bytes for p in next(x for x in found.phases if x.name == phase).parts}


def test_fsdp_gathers_in_the_compute_dtype_and_autocast_copies_nothing() -> None:
    """Under FSDP (accelerate's mixed-precision policy: the compute dtype) the gathered units
    are the low-precision weights the matmuls read: no autocast copies; the output layer's
    gradient is the gathered root's, whole, in that dtype; AdamW runs foreach over the shards
    (two fp32 temporaries a parameter). FSDP on one process is FSDP too."""
    shape = plan.model_shape("Qwen/Qwen3-0.6B")
    mixed = {"weight_bytes": 4, "compute_bytes": 2, "seq": 2048, "checkpointing": True}
    plain = plan.plan(shape, _run(**mixed))
    loss = "training step (loss and output layer)"
    assert _parts(plain, loss)["autocast weight copies"] > 0
    for run in (_run(**mixed, fsdp=True), _run(**mixed, shard=2, processes=2)):
        sharded = plan.plan(shape, run)
        parts = _parts(sharded, loss)
        assert parts["autocast weight copies"] == 0
        root = (shape.embedding_params + shape.head_params) * 2
        assert parts["FSDP gathered layers"] == 2 * shape.layer_params * 2 + root
        assert parts["output layer's gradient"] == shape.hidden * shape.vocab * 2
        step = _parts(sharded, "optimizer step")
        assert step["optimizer step's temporaries"] == 2 * shape.params * 4 // run.shard
    assert _parts(plain, "optimizer step")["optimizer step's temporaries"] == shape.params * 4


def test_the_runs_own_fused_loss_decision_is_the_plans() -> None:
    """A LoRA run that adds a template's tokens to a tied model trains its output layer, so its
    loss runs unfused: the plan logged beside its peak takes the loaded model's decision."""
    settings = plan.compose(["recipe=llama_sft", "peft=lora", f"model.name_or_path={QWEN3_8B}"])
    assert plan.run_shape(settings).fused_loss
    assert not plan.run_shape(settings, fused_loss=False).fused_loss


def test_reference_and_teacher_are_sharded_like_the_policy() -> None:
    """DPO's frozen reference under full fine-tuning (none with LoRA: the adapter disabled)
    and GKD's teacher count once per card, divided among the FSDP / HSDP shard group."""
    student, teacher = plan.model_shape(QWEN3_8B), plan.model_shape("Qwen/Qwen3-32B")
    one = plan.plan(student, _run(task="gkd", second=teacher, second_bytes=2))
    part = {p.name: p.bytes for p in one.phases[0].parts}["reference / teacher"]
    assert part == teacher.params * 2
    eight = plan.plan(student, _run(task="gkd", second=teacher, second_bytes=2, shard=8))
    assert {p.name: p.bytes for p in eight.phases[0].parts}["reference / teacher"] == part // 8
    # The case: an 8B student learning from a 32B teacher fits eight 80 GB cards.
    assert plan.plan(
        student,
        _run(task="gkd", second=teacher, second_bytes=2, shard=8, checkpointing=True),
        card_bytes=plan.card_memory("S5000"),
    ).fits


def test_cheapest_fix_fits_and_is_cheapest() -> None:
    shape = plan.model_shape(QWEN3_8B)
    run = _run(rows=4)
    card = plan.card_memory("S4000")
    assert not plan.plan(shape, run, card_bytes=card).fits
    fix = plan.cheapest_fix(shape, run, card)
    assert fix is not None and fix.plan.fits and fix.overrides
    # Any single cheaper change does not fit.
    for cheaper in (_run(rows=4, checkpointing=True), _run(rows=2), _run(rows=4, lora_rank=16)):
        tried = plan.plan(shape, cheaper, card_bytes=card)
        if tried.fits:
            assert plan._describe(run, cheaper)[1] >= fix.cost


def test_command_prints_the_parts_and_a_verdict(capsys) -> None:
    """The issue's check, with the model's hub id (its preset is model=qwen3_8b)."""
    code = plan.main(
        [
            "recipe=llama_sft",
            f"model.name_or_path={QWEN3_8B}",
            "model.gguf_file=null",
            "model.dtype=bfloat16",
            "peft=lora",
            "trainer.gradient_checkpointing=true",
            "task.max_seq_length=4096",
            "--card",
            "S4000",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    for part in ("weights", "activations", "logits and loss", "LoRA adapters", "evaluation"):
        assert part in out
    assert "S4000 (48.00 GiB)" in out
    assert ("fits on" in out) or ("cheapest fix" in out)


def test_command_refuses_an_unknown_card(capsys) -> None:
    assert plan.main(["recipe=llama_sft", "--card", "S9"]) == 2
    assert "--card S9" in capsys.readouterr().err


def test_run_that_cannot_fit_is_refused_before_loading(tmp_path) -> None:
    """Qwen3-4B in full (fp32 weights and AdamW: 64 GB) exceeds this CPU's RAM: one line,
    exit 2, before the model (absent offline) loads, and no run folder left."""
    done = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "model.name_or_path=Qwen/Qwen3-4B",
        f"output_dir={tmp_path / 'run'}",
        check=False,
    )
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the plan estimates") and "cheapest fix: " in line
    assert "peft=lora" in line.split("cheapest fix: ")[1]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_refused_on_a_card_by_its_memory(tmp_path) -> None:
    """On an (emulated) S4000, Qwen3-8B in full: the card's own memory in the one line, exit 2,
    before the model (absent offline) loads."""
    done = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "model.name_or_path=Qwen/Qwen3-8B",
        f"output_dir={tmp_path / 'run'}",
        check=False,
        script=on_musa(card="S4000"),
    )
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the plan estimates") and "S4000 has 48.00 GiB" in line
    assert "cheapest fix: " in line and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_out_of_memory_ends_in_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch) -> None:
    """An OutOfMemoryError planted in the model's forward at the third training step: one
    line of advice, exit 1, and step-2's checkpoint complete."""
    import torch
    from transformers import LlamaForCausalLM

    calls = []
    forward = LlamaForCausalLM.forward

    def failing(self, *args, **kwargs):
        if self.training:
            calls.append(1)
            if len(calls) == 3:
                raise torch.OutOfMemoryError("planted: out of memory")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", failing)
    out = tmp_path / "run"
    done = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "trainer.max_steps=4",
        "trainer.save_every_n_steps=2",
        "trainer.per_device_train_batch_size=2",
        "trainer.activation_offload=true",  # saved tensors through host memory: still trains
        f"output_dir={out}",
        check=False,
    )
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: out of memory at step 3")
    assert "cheapest fix for a fifth less: " in line
    kept = out / "checkpoints" / checkpoint.name_of(2)
    assert f"{kept} is intact" in line
    assert [p.name for p in checkpoint.finished_checkpoints(kept.parent)] == [kept.name]
    assert json.loads((kept / checkpoint.STATE_FILE).read_text())["step"] == 2


@pytest.mark.slow
def test_plan_is_within_15_percent_of_the_measured_peak(tmp_path) -> None:
    """One of scripts/plan_check.py's 512-token points on the emulated card (full fine-tuning
    with checkpointing: weights, gradients, AdamW, logits, attention): the card allocator's
    peak against the plan. The whole grid is the script's (docs/results.md)."""
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            "scripts/plan_check.py",
            "--work",
            str(tmp_path),
            "--points",
            "full-ckpt-512",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [
        line for line in done.stdout.splitlines() if line.startswith("| full") or "| lora" in line
    ]
    assert len(rows) == 1
    for row in rows:
        error = float(row.split("|")[5].strip().rstrip(" %"))
        assert abs(error) <= 15, row


def test_fsdp_offload_needs_an_fsdp_launch(monkeypatch) -> None:
    from recipes.config import ConfigError
    from recipes.memory import set_fsdp_offload

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    with pytest.raises(ConfigError, match=r"trainer\.fsdp_offload=true: the run is not launched"):
        set_fsdp_offload(True)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    set_fsdp_offload(True)  # what accelerate's FSDP plugin reads when it is built
    assert os.environ["FSDP_OFFLOAD_PARAMS"] == "true"


def test_accelerate_configs_give_processes_and_shards() -> None:
    """FSDP2 shards over every process, HSDP over a node's cards, DDP over none."""
    conf = ROOT / "conf" / "accelerate"
    assert plan.processes_from_accelerate(str(conf / "fsdp2.yaml")) == (8, 8, False)
    assert plan.processes_from_accelerate(str(conf / "hsdp_musa.yaml")) == (16, 8, False)
    processes, shard, _ = plan.processes_from_accelerate(str(conf / "multi_musa.yaml"))
    assert processes > 1 and shard == 1


@pytest.mark.slow  # every plan docs/large-models.md quotes, composed here: about 3 s
def test_the_large_models_page_quotes_the_plans_of_this_checkout(capsys) -> None:
    """Its plan blocks and table figures are what the commands beside them print now
    (``python scripts/docs_plans.py`` rewrites them after a change to the plan)."""
    sys.path.insert(0, str(ROOT))
    from scripts import docs_plans

    assert docs_plans.main(["--check"]) == 0, capsys.readouterr().out

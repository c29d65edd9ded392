"""What a user does with a run, on the emulated MUSA device (``scripts/emulated_musa.py``): score
it (``mode=eval`` on one card and two), answer with it (``mode=predict``, ``recipes.answer``),
chat with it (``recipes.chat``), kill it and resume it; LoRA with gradient checkpointing and
packing, and DPO with a frozen reference model, each equal to the CPU run; the environment
doctor and the GPU check's dry run on the device.

The device refuses a musa tensor mixed with a CPU one, so a model, a reference model or a batch
left on the CPU fails these runs instead of passing quietly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import test_gpu_check
import torch
from conftest import (
    GPU_CHECK_ON_THE_CARD,
    ROOT,
    free_port,
    kill_at_checkpoint,
    musa_launch,
    on_musa,
    read_metrics,
    run_train,
    squad_questions,
    start_train,
)
from fake_torch_musa import GEMM_TF32_REPORT
from safetensors.torch import load_file
from test_gkd import perturbed_teacher

pytestmark = pytest.mark.slow

QUIET = ("logger=none", "trainer.progress_bar=false")
# Three logged steps, nothing evaluated or saved at the end.
THREE_STEPS = (
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.eval_at_start=false",
    "trainer.eval_at_end=false",
    "trainer.save_final_model=false",
)
SQUAD_V2 = ("recipe=bert_squad_v2", "debug=smoke", *QUIET)
DEV = ROOT / "recipes" / "assets" / "squad" / "v2" / "dev.json"
SCORES = ("eval/exact_match", "eval/f1", "eval/HasAns_f1", "eval/NoAns_f1")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
FAULTS = str(Path(__file__).with_name("faults_during_run.py"))


def _scores(run: Path) -> dict[str, float]:
    metrics = json.loads((run / "results.json").read_text())["metrics"]
    return {k: metrics[k] for k in SCORES}


def _losses(run: Path) -> list[float]:
    return [m["train/loss"] for m in read_metrics(run) if "train/loss" in m]


def _python_on_musa(*args: str, cards: int = 1, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, *on_musa(sys.executable, *args, cards=cards)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_eval_predict_and_answer_on_the_device(tmp_path, cache_dir):
    """A QA model trained on a card scores, predicts and answers there as its run did: mode=eval
    from final/ on one card and on two (mccl gathers the features), mode=predict on the dev
    questions without answers, and recipes.answer on the dev file."""
    run = tmp_path / "run"
    cache = f"data.cache_dir={cache_dir}"
    gemm_tf32 = tmp_path / "gemm_tf32.json"  # the stand-in's GEMM TF32 switch at exit
    run_train(
        *SQUAD_V2,
        cache,
        f"output_dir={run}",
        "trainer.max_steps=10",
        "trainer.eval_at_start=false",
        script=on_musa(),
        env={GEMM_TF32_REPORT: str(gemm_tf32)},
    )
    trained = _scores(run)
    assert trained["eval/f1"] > 0
    # trainer.tf32=true (the default) reached the switch the release's GEMMs read (off by default
    # from v2.9), and trainer.tf32=false below turns it off.
    assert json.loads(gemm_tf32.read_text()) is True

    one = tmp_path / "eval-one"
    done = run_train(
        *SQUAD_V2,
        cache,
        "mode=eval",
        f"model.name_or_path={run}/final",
        f"output_dir={one}",
        "trainer.tf32=false",
        script=on_musa(),
        env={GEMM_TF32_REPORT: str(gemm_tf32)},
    )
    assert "device musa" in done.stderr
    assert json.loads(gemm_tf32.read_text()) is False
    assert _scores(one) == trained
    two = tmp_path / "eval-two"
    done = run_train(
        *SQUAD_V2,
        cache,
        "mode=eval",
        f"model.name_or_path={run}/final",
        f"output_dir={two}",
        script=musa_launch(2),
        env=ONE_THREAD,
    )
    assert "MULTI_MUSA" in done.stderr
    assert _scores(two) == pytest.approx(trained, abs=1e-9)

    questions = tmp_path / "questions.jsonl"
    squad_questions(DEV, questions)
    predicted = tmp_path / "predicted"
    run_train(
        *SQUAD_V2,
        cache,
        "mode=predict",
        f"model.name_or_path={run}/final",
        f"data.predict_file={questions}",
        f"output_dir={predicted}",
        script=on_musa(),
    )
    expected = json.loads((run / "predictions.json").read_text())
    answers = json.loads((predicted / "predictions.json").read_text())
    assert list(answers.values()) == list(expected.values())

    out = tmp_path / "answers.json"
    done = _python_on_musa(
        "-m", "recipes.answer", str(run / "final"), "--file", str(DEV), "--out", str(out)
    )
    assert json.loads(out.read_text()) == expected


def test_chat_on_the_device_answers_as_on_the_cpu(tmp_path, cache_dir):
    """recipes.chat on a card gives the CPU's greedy replies, turn after turn, for a chat model
    trained on the card."""
    run = tmp_path / "run"
    run_train(
        "recipe=llama_sft",
        "debug=smoke",
        *QUIET,
        f"data.cache_dir={cache_dir}",
        f"output_dir={run}",
        "trainer.max_steps=5",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        script=on_musa(),
    )
    lines = "When was the university founded?\nAnd who founded it?\n"
    command = ["-m", "recipes.chat", str(run / "final"), "--max-new-tokens", "8"]
    musa = _python_on_musa(*command, input=lines)
    cpu = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        input=lines,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ACCELERATE_USE_CPU": "1"},
    )
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert musa.stdout == cpu.stdout and musa.stdout.count("\n") >= 2


def test_killed_and_resumed_on_the_device_equals_the_uninterrupted_run(tmp_path, cache_dir):
    """kill -9 after a checkpoint, then resume=auto: every logged number equals the run that was
    not interrupted. The tiny GPT-2 keeps its dropout, so the card's RNG state goes through the
    checkpoint (torch.musa.get_rng_state_all / set_rng_state_all) too."""
    common = (
        "recipe=gpt2_clm",
        "debug=smoke",
        *QUIET,
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=4",
        "trainer.eval_every_n_steps=6",
        "trainer.eval_at_start=false",
        "task.sample_prompt=null",
    )
    reference = tmp_path / "reference"
    run_train(*common, f"output_dir={reference}", script=on_musa())
    run = tmp_path / "run"
    proc = start_train(*common, f"output_dir={run}", script=on_musa())
    kill_at_checkpoint(proc, run, 8)
    assert proc.returncode == -signal.SIGKILL and not (run / "final").exists()
    run_train(*common, f"output_dir={run}", "resume=auto", script=on_musa())
    keys = ("train/loss", "train/lr", "eval/loss")
    numbers = [(m["step"], k, m[k]) for m in read_metrics(run) for k in keys if k in m]
    expected = [(m["step"], k, m[k]) for m in read_metrics(reference) for k in keys if k in m]
    assert sorted(set(numbers)) == sorted(set(expected))
    assert (run / "final" / "model.safetensors").read_bytes() == (
        reference / "final" / "model.safetensors"
    ).read_bytes()


def _cpu_and_musa(
    tmp_path: Path, *overrides: str, cache: Path | None = None
) -> tuple[list[float], list[float]]:
    """The same short run on the CPU and on a card; ``cache``: the feature cache both share,
    else one of each run's own (so the card computes what it could read from the CPU's)."""
    exact = (
        *QUIET,
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        *overrides,
    )
    caches = {where: cache or tmp_path / f"cache-{where}" for where in ("cpu", "musa")}
    run_train(*exact, f"output_dir={tmp_path / 'cpu'}", f"data.cache_dir={caches['cpu']}")
    done = run_train(
        *exact,
        f"output_dir={tmp_path / 'musa'}",
        f"data.cache_dir={caches['musa']}",
        script=on_musa(),
    )
    assert "device musa" in done.stderr
    return _losses(tmp_path / "cpu"), _losses(tmp_path / "musa")


def test_lora_with_gradient_checkpointing_and_packing_equals_the_cpu(tmp_path, cache_dir):
    cpu, musa = _cpu_and_musa(
        tmp_path,
        "recipe=llama_sft",
        "debug=smoke",
        "peft=lora",
        "trainer.gradient_checkpointing=true",
        "task.packing=true",
        cache=cache_dir,
    )
    assert len(musa) == 3 and musa == pytest.approx(cpu, abs=1e-5)


@pytest.mark.parametrize("reference", ["frozen_copy", "precomputed"])
def test_dpo_reference_model_on_the_device_equals_the_cpu(reference, tmp_path):
    """Full fine-tuning: the reference is a frozen copy of the starting model, or its
    log-probabilities computed once before training; either lives on the card (a copy left on
    the CPU is refused there). Each run has a feature cache of its own: the card computes the
    reference's log-probabilities rather than reading the CPU's (and the session's cache stays
    without them, for tests/test_dpo.py)."""
    cpu, musa = _cpu_and_musa(
        tmp_path,
        "recipe=llama_dpo",
        "debug=smoke",
        "peft=none",
        "optimizer.lr=1e-4",
        f"task.precompute_reference={reference == 'precomputed'}",
    )
    assert len(musa) == 3 and musa == pytest.approx(cpu, abs=1e-5)
    assert musa[-1] < musa[0]


def test_doctor_reports_the_emulated_cards():
    done = _python_on_musa("-m", "recipes.env", "--json", cards=2)
    report = json.loads(done.stdout)
    assert report["backend"] == "musa" and report["device_count"] == 2
    assert [d["name"] for d in report["devices"]] == ["MTT S4000", "MTT S4000"]
    assert all(d["capability"] == "2.2" and d["bf16"] for d in report["devices"])
    assert report["devices"][0]["peak_flops"]["bf16"] == 100e12  # the S4000's, for MFU
    assert report["torch_musa"]["imported"] is True
    assert report["distributed_backend"] == "mccl"
    assert report["default_mixed_precision"] == "bf16"
    probe = report["sdpa_probe"]  # the attention check ran on the card, and passed
    assert probe["device"] == "musa:0" and probe["ok"] is True
    # What a run decides at the newest release: its GEMM switch, compile off, torch_musa's AdamW.
    decisions = report["decisions"]
    assert decisions["tf32_switches"][0] == "torch.backends.musa.matmul.allow_tf32"
    assert decisions["compile"] is False and "slower" in decisions["compile_why"]
    assert decisions["adamw"] == "torch_musa.optim.FusedAdamW"


def test_s5000_decisions_on_the_device(tmp_path, cache_dir):
    """An emulated MTT S5000 (MUSA 3.1, 80 GB, MCCL): the doctor reports bf16, TF32 and FP8
    units, MCCL, and the peak table's FP8 figure only; a run picks bf16 and logs TFLOP/s but no
    MFU, saying why (no published bf16 peak), where an S4000's run would report one."""
    done = subprocess.run(
        [sys.executable, *on_musa(sys.executable, "-m", "recipes.env", "--json", card="S5000")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    (card,) = report["devices"]
    assert (card["name"], card["capability"]) == ("MTT S5000", "3.1")
    assert card["bf16"] and card["tf32"] and card["fp8"]
    assert card["total_memory_bytes"] == 80 << 30
    assert card["peak_flops"]["fp8"] == 1000e12 and card["peak_flops"]["bf16"] is None
    assert "no published bf16 peak" in "\n".join(report["advice"])
    assert report["default_mixed_precision"] == "bf16"
    assert report["distributed_backend"] == "mccl"
    run = tmp_path / "run"
    done = run_train(
        "recipe=gpt2_clm",
        "debug=smoke",
        *QUIET,
        f"data.cache_dir={cache_dir}",
        f"output_dir={run}",
        "trainer.mixed_precision=auto",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "task.sample_prompt=null",
        script=on_musa(card="S5000"),
    )
    assert "MFU in bf16 on MTT S5000 is not reported" in done.stderr
    logged = [m for m in read_metrics(run) if "train/loss" in m]
    assert logged and all("train/tflops" in m and "train/mfu" not in m for m in logged)
    assert "mixed precision bf16" in done.stderr  # trainer.mixed_precision=auto on a 3.1 card


def test_deepspeed_launch_on_the_device_is_refused_in_one_line(tmp_path):
    """accelerate's DeepSpeed launch sets ACCELERATE_USE_DEEPSPEED for train.py; on a MUSA
    card the run stops before any model is built, naming MT DeepSpeed, DS_ACCELERATOR=musa,
    why, and the FSDP2 / HSDP configs to use instead."""
    done = run_train(
        "recipe=gpt2_clm",
        "debug=smoke",
        *QUIET,
        f"output_dir={tmp_path / 'run'}",
        check=False,
        env={"ACCELERATE_USE_DEEPSPEED": "true"},
        script=on_musa(),
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "DEEPSPEED" in line]
    for needed in ("MT DeepSpeed", "DS_ACCELERATOR=musa", "#8191", "fsdp2.yaml", "hsdp_musa.yaml"):
        assert needed in line, needed


@pytest.mark.skipif(
    importlib.util.find_spec("torchada") is None,
    reason="torchada is not installed (.ci/run installs it with --no-deps)",
)
def test_torchada_imported_first_leaves_the_device_decisions_alone(tmp_path, cache_dir):
    """torchada imported before anything else, with TORCHADA_FORCE_CUDA_AVAILABLE=1 (so
    torch.cuda.is_available() says yes, and torch.cuda answers from torch.musa): the device is
    still MUSA, with the S4000's decisions, and a run trains on it in bf16."""
    found = tmp_path / "decisions.json"
    done = run_train(
        "recipe=gpt2_clm",
        "debug=smoke",
        *QUIET,
        f"data.cache_dir={cache_dir}",
        f"output_dir={tmp_path / 'run'}",
        "trainer.mixed_precision=auto",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "task.sample_prompt=null",
        env={"TORCHADA_FORCE_CUDA_AVAILABLE": "1"},
        script=on_musa(sys.executable, str(ROOT / "tests" / "torchada_first.py"), str(found)),
    )
    decisions = json.loads(found.read_text())
    assert decisions["torchada_active"] and decisions["cuda_is_available"]
    assert decisions["backend"] == "musa" and decisions["names"] == ["MTT S4000"]
    assert decisions["capability"] == [2, 2] and decisions["bf16"] and decisions["tf32"]
    assert decisions["default_mixed_precision"] == "bf16"
    assert decisions["attn_implementation"] == "sdpa"
    assert decisions["distributed_backend"] == "mccl"
    assert decisions["tf32_set"] == [True, False]  # both ways, on torch.backends.mudnn
    assert decisions["fused_adamw"] and decisions["peak_bf16"] == 100e12
    assert decisions["defaults"]["compile"] is False and decisions["defaults"]["pin_memory"]
    assert "device musa, 1 process(es), mixed precision bf16" in done.stderr
    assert len(_losses(tmp_path / "run")) == 2


def _one_card_then_fsdp2(tmp_path: Path, common: tuple[str, ...], global_batch: int):
    """``common`` on one card (``tmp_path/one``), then under accelerate's FSDP2 on two cards
    with the same global batch (``tmp_path/two``); the two run folders."""
    one, two = tmp_path / "one", tmp_path / "two"
    batch = "trainer.per_device_train_batch_size"
    run_train(*common, f"{batch}={global_batch}", f"output_dir={one}", script=on_musa())
    done = run_train(
        *common,
        f"{batch}={global_batch // 2}",
        f"output_dir={two}",
        script=_fsdp_launch("fsdp2.yaml"),
        env=ONE_THREAD,
    )
    assert "DistributedType.FSDP" in done.stderr
    return one, two


def test_lora_under_fsdp2_on_two_cards_equals_one_card(tmp_path, cache_dir):
    """accelerate's FSDP2 (conf/accelerate/fsdp2.yaml) on two cards, which accelerate refuses on
    a CPU: LoRA trains as on one card with the same global batch, the checkpoints are sharded,
    and final/ is the same merged model, whose answers after training the sharded model gives
    too. (The LoRA dropout is off: two processes would draw other masks than one.) ChatML's
    markers are new to the tiny Llama's tokenizer, so their embedding rows train too (peft's
    trainable tokens) on its tied embedding: accelerate's FSDP2 preparation has to see the tie
    through peft's wrappers (adapters.tie_seen_by_fsdp2), or it shards the embedding and the
    output layer apart and torch stops."""
    common = (
        "recipe=llama_sft",
        "debug=smoke",
        "peft=lora",
        "peft.dropout=0.0",
        "task.chat_template=chatml",
        *QUIET,
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=4",
        "trainer.save_every_n_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_start=false",
    )
    one, two = _one_card_then_fsdp2(tmp_path, common, global_batch=16)
    assert "2 new token rows" in (two / "train.log").read_text()
    assert _losses(two) == pytest.approx(_losses(one), abs=1e-5) and len(_losses(two)) == 4
    assert (two / "checkpoints" / "step-00000004" / "pytorch_model_fsdp_0").is_dir()
    merged = load_file(two / "final" / "model.safetensors")
    expected = load_file(one / "final" / "model.safetensors")
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    # The answers after training: generated by the sharded model, both cards stepping together.
    answers = [(run / "generations.jsonl").read_text().splitlines() for run in (one, two)]
    assert answers[1] == answers[0] and len(answers[0]) == 3


def test_gkd_teacher_sharded_under_fsdp2_on_two_cards_equals_one_card(tmp_path, cache_dir):
    """GKD's frozen teacher under FSDP2 (issue 56: an 8B student from a 32B teacher on cards
    that hold neither whole) is sharded like the student (accelerate's own FSDP2 preparation,
    never given to the optimizer nor checkpointed): full fine-tuning of the student from a
    teacher that is not it trains on two cards as on one card with the same global batch. The
    teacher: the tiny Llama with its weights perturbed (same vocabulary, other logits)."""
    teacher = perturbed_teacher(tmp_path / "teacher")
    common = (
        "recipe=llama_gkd",
        "debug=smoke",
        "peft=none",
        "task.lmbda=0",
        f"task.teacher_model={teacher}",
        *QUIET,
        f"data.cache_dir={cache_dir}",
        *THREE_STEPS,
    )
    one, two = _one_card_then_fsdp2(tmp_path, common, global_batch=8)
    assert "teacher: sharded like the policy" in (two / "train.log").read_text()
    assert _losses(two) == pytest.approx(_losses(one), abs=1e-5) and len(_losses(two)) == 3
    assert all(loss > 0 for loss in _losses(one))  # the teacher is not the student


def test_hsdp_on_four_cards_as_two_nodes_equals_one_card(tmp_path, cache_dir):
    """conf/accelerate/hsdp_musa.yaml through accelerate's launcher on four cards, as 2 "nodes"
    of 2 (dp_replicate 2 x dp_shard 2): accelerate runs FSDP2 on the (replicate, shard) mesh it
    builds, and LoRA trains as one card does with the same global batch. About 50 s of CPU on
    2 cores (four processes); tests/test_hsdp.py checks the mesh itself on CPU processes."""
    common = (
        "recipe=llama_sft",
        "debug=smoke",
        "peft=lora",
        "peft.dropout=0.0",
        *QUIET,
        f"data.cache_dir={cache_dir}",
        *THREE_STEPS,
    )
    one, four = tmp_path / "one", tmp_path / "four"
    run_train(
        *common, "trainer.per_device_train_batch_size=16", f"output_dir={one}", script=on_musa()
    )
    hsdp = _fsdp_launch(
        "hsdp_musa.yaml", 4, "--num_machines", "1",
        "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", "2",
    )  # fmt: skip
    done = run_train(
        *common,
        "trainer.per_device_train_batch_size=4",
        f"output_dir={four}",
        script=hsdp,
        env=ONE_THREAD,
    )
    assert "4 process(es), mixed precision no, distributed DistributedType.FSDP" in done.stderr
    assert "HSDP: the model sharded over 2 processes (a node), replicated 2 times" in done.stderr
    assert _losses(four) == pytest.approx(_losses(one), abs=1e-5) and len(_losses(four)) == 3


def _fsdp_launch(
    config: str, cards: int = 2, *options: str, program: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """train.py (or ``program``) under ``accelerate launch --config_file
    conf/accelerate/<config>`` on ``cards`` emulated cards, one process each; ``options``: more
    of the launcher's own."""
    return on_musa(
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "conf/accelerate" / config),
        "--num_processes",
        str(cards),
        *options,
        "--main_process_port",
        str(free_port()),
        *(program or (str(ROOT / "train.py"),)),
        cards=cards,
    )


T5_SHARDED = (
    "recipe=t5_translation",
    "debug=smoke",
    *QUIET,
    "data.max_eval_examples=32",  # the smoke run's 200 rows generated at every evaluation: slow
    "trainer.max_steps=4",
    "trainer.save_every_n_steps=2",
    "trainer.eval_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.eval_at_start=false",
)


def test_seq2seq_under_fsdp2_on_two_cards_equals_one_card(tmp_path, cache_dir):
    """T5 under conf/accelerate/fsdp2.yaml: its encoder's and decoder's embeddings are one
    module with ``shared`` (transformers 5 builds three tied modules, which FSDP2 refused:
    "shared with a parameter already managed by another FSDP group"). It trains as one card
    with the same global batch, evaluates by generating with both cards stepping together,
    writes sharded checkpoints and the same final/."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = (*T5_SHARDED, f"data.cache_dir={cache_dir}")
    run_train(
        *common, "trainer.per_device_train_batch_size=64", f"output_dir={one}", script=on_musa()
    )
    done = run_train(
        *common,
        "trainer.per_device_train_batch_size=32",
        f"output_dir={two}",
        script=_fsdp_launch("fsdp2.yaml"),
        env=ONE_THREAD,
    )
    assert "DistributedType.FSDP" in done.stderr
    assert _losses(two) == pytest.approx(_losses(one), abs=1e-5) and len(_losses(two)) == 4
    evals = [[m for m in read_metrics(run) if "eval/chrf" in m] for run in (one, two)]
    assert [m["eval/chrf"] for m in evals[1]] == pytest.approx([m["eval/chrf"] for m in evals[0]])
    assert (two / "checkpoints" / "step-00000004" / "pytorch_model_fsdp_0").is_dir()
    merged, expected = (load_file(run / "final" / "model.safetensors") for run in (two, one))
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def test_a_failed_sharded_save_ends_the_run_in_one_line_not_a_hang(tmp_path, cache_dir):
    """Under FSDP a save gathers shards with collectives. When the gather for final/ fails on
    the main process only (tests/faults_during_run.py's ``gather-fails-on-main``), the other
    process is left inside a collective: the failing process must stop with its one line rather
    than wait in another collective for an agreement (a hang on MCCL and NCCL), and the launcher
    ends the rest."""
    run = tmp_path / "run"
    done = run_train(
        *T5_SHARDED,
        "trainer.per_device_train_batch_size=32",
        f"data.cache_dir={cache_dir}",
        f"output_dir={run}",
        script=_fsdp_launch("fsdp.yaml", program=(FAULTS, "gather-fails-on-main")),
        env=ONE_THREAD,
        check=False,
        timeout=400,
    )
    assert done.returncode != 0
    assert (
        f"error: could not write the final model to {run} (RuntimeError: gathering the model "
        "failed on this process only)" in done.stderr
    ), done.stderr[-3000:]
    assert "collective mismatch" not in done.stderr and "Aborted" not in done.stderr
    assert (run / "checkpoints" / "step-00000004").is_dir()  # the sharded checkpoints work
    assert not (run / "final").exists() and not (run / ".tmp-final").exists()


def test_gpu_check_dry_run_on_the_device(tmp_path, cache_dir):
    """The GPU check's rows on the emulated card (shrunk; conftest.GPU_CHECK_ON_THE_CARD, which
    the CPU dry run of tests/test_gpu_check.py leaves to this one): each runs and reports the
    S4000's MFU and the card's peak memory. Not torch.compile: the stand-in has no inductor
    backend for musa (torch_musa/_inductor). Of the smoke rows, two: every recipe runs on the
    emulated card in tests/test_emulated_recipes.py."""
    out = tmp_path / "out"
    only = [arg for row in GPU_CHECK_ON_THE_CARD for arg in ("--only", row)]
    _python_on_musa(
        str(ROOT / "scripts" / "gpu_check.py"),
        "--dry-run",
        *only,
        "--override",
        f"data.cache_dir={cache_dir}",
        "--out",
        str(out),
        env={**os.environ, **ONE_THREAD},
    )
    found = {r["row"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}
    # Each row the CPU dry run leaves to the card ran here (tests/test_gpu_check.py).
    every = test_gpu_check._every_row()
    on_cpu = test_gpu_check.rows_on_the_cpu(every)
    assert every - on_cpu - test_gpu_check.dry_run_repeats(every) <= set(found), sorted(found)
    assert {"micro/sdpa_probe", "micro/generate", "smoke/llama_dpo", "fsdp/llama_sft_lora"} <= set(
        found
    )
    for row in found.values():
        assert row["status"] == "ok", row
        if row.get("kind") in ("train", "launch"):
            assert row["mfu"] is not None and row["peak_memory_gib"] is not None, row
    # The plan's estimate next to the card's measured peak (issue 56).
    assert "measured / plan" in found["llama135m/unpacked"]["note"], found["llama135m/unpacked"]
    assert "MTT S4000 (musa)" in (out / "table.md").read_text()

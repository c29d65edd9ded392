"""The GKD task (``task=gkd``): its loss and gradient against TRL's ``GKDTrainer`` on the same
tokens, its settings' refusals, and one end-to-end run of its guarantees.

Rows: the first bundled held-out SQuAD conversations, not written for these tests. The student
is the tiny Llama with its weights perturbed, the teacher the tiny Llama itself.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    make_task,
    read_metrics,
    run_cpu_launch,
    run_train,
)
from transformers import AutoModelForCausalLM

from recipes.config import ConfigError, DataConfig, ModelConfig
from recipes.losses import distillation_loss, generalized_jsd
from recipes.model import load_tokenizer
from recipes.modes import _check_evaluated_model
from recipes.tasks.chat import Reference
from recipes.tasks.gkd import first_difference

# TRL's experimental GKD (imported here, at collection: its first import takes seconds).
GKDTrainer = pytest.importorskip("trl.experimental.gkd").GKDTrainer

CONVERSATIONS = ROOT / "recipes/assets/conversations/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
ROWS = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:6]]


def _models():
    teacher = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="sdpa").eval()
    student = copy.deepcopy(teacher)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in student.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.05)
    return student, teacher.requires_grad_(False)


def _features(tmp_path, tokenizer, rows=ROWS, **task):
    """The task (zephyr's template and 256 tokens unless ``task`` says) and its training rows
    built from ``rows`` (also the held-out split)."""
    tmp_path.mkdir(exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    gkd = make_task("gkd", **{"chat_template": "zephyr", "max_seq_length": 256, **task})
    data = gkd.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    return gkd, data


def _batch(tmp_path, **task):
    """The task (its teacher set) and a training batch of ROWS in file order."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    gkd, data = _features(tmp_path, tokenizer, **task)
    return gkd, data.train_collator([data.train[i] for i in range(len(data.train))])


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_and_gradient_equal_trl_gkd(tmp_path, beta):
    """The loss (:func:`recipes.losses.distillation_loss`: summed JSD over labelled tokens /
    their count) and the student's gradient equal TRL's, its ``compute_loss`` (which calls
    ``generalized_jsd_loss`` with the causal shift, the labels' mask and no temperature) run on
    the same batch and models; the sampling temperature (0.7 here) does not enter the loss in
    either."""
    gkd, batch = _batch(tmp_path, beta=beta, temperature=0.7, lmbda=0.0)
    student, teacher = _models()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        teacher_logits = teacher(**inputs, use_cache=False).logits[:, :-1]
    student_logits = student(**inputs, use_cache=False).logits[:, :-1]
    mask = batch["labels"][:, 1:] != -100  # the logits at t against the label at t + 1
    total, count = distillation_loss(student_logits, teacher_logits, mask, beta)
    ours = total.sum() / count.sum()
    gkd.teacher = Reference(adapter_disabled=False, frozen=teacher)
    with torch.no_grad():  # the task's divergence is the function's, on its own forwards
        torch.testing.assert_close(gkd.divergence(student, batch), (total, count))
    ours.backward()
    ours_grads = _grads(student)
    student.zero_grad()

    # TRL's own compute_loss on a stand-in for its trainer holding what it reads of self.
    trainer = types.SimpleNamespace(
        teacher_model=teacher, beta=beta, generalized_jsd_loss=GKDTrainer.generalized_jsd_loss
    )
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    theirs = GKDTrainer.compute_loss(trainer, student, inputs)
    theirs.backward()
    assert count.sum() > 6 * 3  # every row has labelled tokens
    assert ours.item() > 1e-3  # the perturbed student is far from its teacher
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    for mine, trls in zip(ours_grads, _grads(student), strict=True):
        torch.testing.assert_close(mine, trls, atol=1e-6, rtol=0)


@pytest.mark.parametrize("template", ["chatml", "zephyr", "llama3"])
def test_rows_equal_trls_gkd_collator(tmp_path, template):
    """Each row's tokens and labels equal those of TRL's GKD collator (``DataCollatorForChatML``,
    unpadded): under chatml and zephyr the newline after the reply's end-of-turn token is
    labelled, as TRL labels every token after the prompt; a row longer than max_seq_length keeps
    its last tokens, its reply trained (cut at its end, such a row had no reply left and was
    dropped). A row whose reply alone fills the length is dropped, where TRL stops the run."""
    from trl.experimental.utils import DataCollatorForChatML

    length = 128
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    _, data = _features(tmp_path, tokenizer, chat_template=template, max_seq_length=length)
    assert len(data.train) == len(ROWS)
    theirs = DataCollatorForChatML(tokenizer=tokenizer, max_length=length)(ROWS)
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    for i, row in enumerate(data.train):
        kept = theirs["attention_mask"][i].bool()
        assert row["input_ids"] == theirs["input_ids"][i][kept].tolist()
        assert row["labels"] == theirs["labels"][i][kept].tolist()
        assert (row["labels"][-len(newline) :] == newline) == (template != "llama3")
    assert sum(len(ids) == length for ids in data.train["input_ids"]) >= 3  # cut, reply kept

    long = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": "so " * 200}]
    with pytest.raises(ValueError, match="no prompt tokens left after truncation"):
        DataCollatorForChatML(tokenizer=tokenizer, max_length=length)([{"messages": long}])
    rows = [ROWS[0], {"messages": long}]
    _, kept = _features(tmp_path / "long", tokenizer, rows, chat_template=template)
    _, cut = _features(
        tmp_path / "long", tokenizer, rows, chat_template=template, max_seq_length=length
    )
    assert len(kept.train) == 2 and cut.train["input_ids"] == [data.train[0]["input_ids"]]


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_of_random_logits_equals_trls(beta):
    """:func:`recipes.losses.generalized_jsd` summed over labelled positions equals TRL's
    ``generalized_jsd_loss`` (reduction ``sum``), and the precomputed path (the teacher's
    log-probs at the labelled positions only) gives the same sums per row."""
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 5, 17, generator=generator)
    teacher = torch.randn(3, 5, 17, generator=generator)
    labels = torch.randint(0, 17, (3, 5), generator=generator)
    labels[0, :2] = labels[2, 3] = -100
    mask = labels != -100
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, reduction="sum")
    ours = (generalized_jsd(student, teacher, beta) * mask).sum()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    total, count = distillation_loss(student, teacher, mask, beta)
    logps = torch.log_softmax(teacher[mask], dim=-1)
    precomputed, _ = distillation_loss(student, logps, mask, beta, teacher_is_logps=True)
    torch.testing.assert_close(precomputed, total)
    assert count.tolist() == [3, 5, 4]


def test_settings_refused_with_one_line():
    with pytest.raises(ConfigError, match=r"task.precompute_teacher=true with task.lmbda=0.5"):
        make_task("gkd", precompute_teacher=True)
    with pytest.raises(ConfigError, match=r"task.seq_kd=true"):
        make_task("gkd", precompute_teacher=True, lmbda=0.0, seq_kd=True)
    with pytest.raises(ConfigError, match=r"task.beta=1.5: must be in \[0, 1\]"):
        make_task("gkd", beta=1.5)
    with pytest.raises(ConfigError, match=r"task.lmbda=-0.1"):
        make_task("gkd", lmbda=-0.1)
    assert make_task("gkd", precompute_teacher=True, lmbda=0.0).args.precompute_teacher
    # mode=eval of a final/ against the teacher it would be without task.teacher_model: itself;
    # said of the teacher (not DPO's rewards and KL), with the setting that names one.
    with pytest.raises(ConfigError) as refused:
        _check_evaluated_model(make_task("gkd"), "run/final", None)
    line = str(refused.value)
    assert "task=gkd scores a model against its teacher" in line
    assert "every divergence exactly 0" in line and "reward" not in line
    assert "Set task.teacher_model=<the teacher it was trained with>, or evaluate" in line
    _check_evaluated_model(make_task("gkd", teacher_model="teacher"), "run/final", None)


@pytest.mark.parametrize("path", ["/no/such/teacher", "./gone", "runs/old/final"])
def test_a_teacher_path_that_does_not_exist_is_no_such_folder(tmp_path, path):
    """As model.name_or_path: not the hub's "Repo id must be in the form ..." error."""
    with pytest.raises(ConfigError, match=rf"^task.teacher_model={path}: no such folder\. "):
        make_task("gkd", teacher_model=path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="no such folder"):
        make_task("gkd", teacher_model=str(tmp_path / "file"))
    assert make_task("gkd", teacher_model=str(tmp_path)).args.teacher_model == str(tmp_path)
    assert make_task("gkd", teacher_model="HuggingFaceTB/SmolLM2-360M-Instruct")


# ----------------------------------------------------------------------------- end to end

SMOKE = ("recipe=llama_gkd", "debug=smoke", "logger=none", "trainer.progress_bar=false")


@pytest.fixture
def teacher(tmp_path):
    return perturbed_teacher(tmp_path / "teacher")


def perturbed_teacher(folder: Path) -> Path:
    """A teacher of the tiny Llama's vocabulary that is not the student: its weights perturbed,
    saved with its tokenizer in ``folder``."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.05)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(folder)
    return folder


def _settings(run, cache_dir, *more):
    """The smoke run (its teacher the bundled tiny GPT-2, of the tiny Llama's tokenizer)."""
    return (
        *SMOKE,
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
        "task.num_generations=0",
        "data.max_eval_examples=16",
        "trainer.log_every_n_steps=1",
        "trainer.save_final_model=false",
        "peft.dropout=0",
        *more,
    )


def _curve(run):
    keys = ("train/loss", "train/on_policy", "train/grad_norm")
    return {r["step"]: [r[k] for k in keys] for r in read_metrics(run) if "train/loss" in r}


@pytest.mark.slow
def test_lora_run_learns_the_teacher_resumes_exactly_and_eval_mode_scores_it(tmp_path, cache_dir):
    """LoRA, half the rows on-policy: the held-out divergence from the teacher falls. Resumed
    from its step-2 checkpoint (the later ones removed), the run draws the same on-policy rows
    and samples and logs the uninterrupted run's losses. mode=eval of the run's last checkpoint
    gives the divergence its last evaluation logged."""
    more = ("trainer.max_steps=4", "trainer.save_every_n_steps=2", "trainer.eval_at_end=true")
    whole = tmp_path / "whole"
    run_train(*_settings(whole, cache_dir, *more, "trainer.eval_at_start=true"))
    evals = [r["eval/loss"] for r in read_metrics(whole) if "eval/loss" in r]
    assert evals[-1] < evals[0] * 0.95, evals
    want = _curve(whole)
    assert all(0 < on < 1 for _, on, _ in want.values()), want  # some rows sampled, not all
    scored = tmp_path / "scored"
    run_train(*_settings(scored, cache_dir, "mode=eval", f"resume={whole}"))
    (record,) = [r for r in read_metrics(scored) if "eval/loss" in r]
    assert record["eval/loss"] == pytest.approx(evals[-1], rel=1e-6)
    # The run as a process killed after its step-2 checkpoint leaves it, then resumed.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints/step-00000004")
    lines = (resumed / "metrics.jsonl").read_text().splitlines(True)
    kept = [line for line in lines if json.loads(line)["step"] <= 2]
    (resumed / "metrics.jsonl").write_text("".join(kept))
    done = run_train(*_settings(resumed, cache_dir, *more), "resume=auto")
    assert "resumed from" in done.stderr
    got = _curve(resumed)
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), step


@pytest.mark.slow
def test_two_processes_train_as_one(tmp_path, cache_dir):
    """The same global batch on one process and on two: each row's on-policy draw and sample
    come from its own seed, so the losses are the one process's."""
    more = ("trainer.max_steps=3", "trainer.eval_at_end=false", "trainer.eval_at_start=false")
    one = tmp_path / "one"
    run_train(*_settings(one, cache_dir, *more, "trainer.per_device_train_batch_size=8"))
    two = tmp_path / "two"
    proc = run_cpu_launch(
        ROOT / "train.py",
        *_settings(two, cache_dir, *more, "trainer.per_device_train_batch_size=4"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = [value for step in sorted(_curve(one)) for value in _curve(one)[step]]
    got = [value for step in sorted(_curve(two)) for value in _curve(two)[step]]
    assert len(got) == 3 * 3 and got == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_precomputed_teacher_gives_the_live_loss_and_vocabularies_are_checked(tmp_path, teacher):
    """task.precompute_teacher: the cached full-vocabulary log-probs give the loss the teacher
    on the device gives; a teacher of another vocabulary is refused."""
    from accelerate import Accelerator

    from recipes.config import GenerationConfig
    from recipes.tasks.base import RunContext

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    settings = {"chat_template": "zephyr", "max_seq_length": 256, "lmbda": 0.0}
    cfg = DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    student, _ = _models()
    run = RunContext(Accelerator(cpu=True), tokenizer, None, GenerationConfig())
    live = make_task("gkd", teacher_model=str(teacher), **settings)
    data = live.build_data(cfg, tokenizer)
    live.before_training(student, data, run, 4)
    cached = make_task("gkd", teacher_model=str(teacher), precompute_teacher=True, **settings)
    cached_data = cached.build_data(cfg, tokenizer)
    cached.before_training(student, cached_data, run, 4)
    assert list((tmp_path / "cache").glob("gkd-teacher-*.pt"))
    for split in ("train", "eval"):
        rows = [getattr(data, split)[i] for i in range(len(ROWS))]
        batch = getattr(cached_data, f"{split}_collator")(rows)
        assert "teacher_logps" in batch
        with torch.no_grad():
            want, count = live.divergence(student, getattr(data, f"{split}_collator")(rows))
            got, _ = cached.divergence(student, batch)
        assert want.sum() > 1e-3 * count.sum()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # A teacher whose tokenizer has one token more (and its embedding row).
    from transformers import AutoTokenizer

    bigger = AutoTokenizer.from_pretrained(TINY_LLAMA)
    bigger.add_tokens(["<extra>"])
    model = AutoModelForCausalLM.from_pretrained(teacher)
    model.resize_token_embeddings(len(bigger))
    model.save_pretrained(tmp_path / "other")
    bigger.save_pretrained(tmp_path / "other")
    other = make_task("gkd", teacher_model=str(tmp_path / "other"), **settings)
    with pytest.raises(ConfigError, match=r"task.teacher_model=.*other: its vocabulary") as err:
        other.before_training(student, other.build_data(cfg, tokenizer), run, 4)
    assert "first differing id 2000: '<extra>' in the teacher's, None in the student's" in str(
        err.value
    )


def test_a_vocabulary_of_the_same_size_names_its_first_differing_token():
    """Two vocabularies of 2000 tokens each differ in a token: named, not "2000 vs 2000"."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    student = tokenizer.get_vocab()
    by_id = {i: t for t, i in student.items()}
    teacher = dict(student)
    del teacher[by_id[7]], teacher[by_id[9]]
    teacher["<mine>"], teacher["<also>"] = 9, 7
    assert first_difference(teacher, student) == (
        f"; first differing id 7: '<also>' in the teacher's, {by_id[7]!r} in the student's"
    )
    assert first_difference(student, dict(student)) == ""


def test_on_policy_rows_take_the_students_samples_and_the_others_the_teachers(tmp_path):
    """lmbda=0.5 with seq_kd: each row drawn on-policy gets the student's sample, each other
    row the teacher's (the tiny GPT-2), both from the row's own seed (the same on a second call,
    as on resume), the prompt unlabelled; the loss trains on them and logs the on-policy share."""
    from accelerate import Accelerator

    from recipes import generation
    from recipes.config import GenerationConfig
    from recipes.tasks.base import RunContext

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    teacher = ROOT / "recipes/assets/tiny-gpt2"
    gkd = make_task(
        "gkd",
        chat_template="zephyr",
        max_seq_length=256,
        lmbda=0.5,
        seq_kd=True,
        max_new_tokens=8,
        teacher_model=str(teacher),
    )
    data = gkd.build_data(DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "c")), tokenizer)
    student, _ = _models()
    run = RunContext(Accelerator(cpu=True), tokenizer, None, GenerationConfig())
    gkd.before_training(student, data, run, 4)
    data.train_collator.start_epoch(7, 0)
    batch = data.train_collator([data.train[i] for i in range(len(ROWS))])
    on_policy = batch["on_policy"].tolist()
    assert 0 < sum(on_policy) < len(ROWS)  # both kinds in this batch (seed 7)
    first, again = gkd._sequences(student, batch), gkd._sequences(student, batch)
    assert torch.equal(first["input_ids"], again["input_ids"])
    frozen = AutoModelForCausalLM.from_pretrained(teacher)
    sampling = GenerationConfig(do_sample=True, temperature=0.9, top_p=1.0, top_k=0)
    for row, on in enumerate(on_policy):
        n = int(batch["prompt_length"][row])
        prompt = batch["input_ids"][row, :n].tolist()
        seed = int(batch["row_seed"][row])
        stream = [torch.Generator().manual_seed(seed)]
        (want,) = generation.complete_ids(
            student if on else frozen, [prompt], tokenizer, sampling, 8, streams=stream
        )
        mask = first["attention_mask"][row].bool()
        assert first["input_ids"][row][mask].tolist() == prompt + want
        labels = first["labels"][row][mask].tolist()
        assert labels == [-100] * n + want
    # On the run's generation.engine: continuous batching draws the same seeded ids.
    gkd.run = dataclasses.replace(run, generation=GenerationConfig(engine="continuous"))
    assert torch.equal(gkd._sequences(student, batch)["input_ids"], first["input_ids"])
    # generation.engine=vllm: the student's rows go to the server, here refused before a request
    # (the tiny Llama ties its output layer, which vLLM cannot reload)
    served = GenerationConfig(engine="vllm", vllm_sync_dir=str(tmp_path / "sync"))
    gkd.run = dataclasses.replace(run, generation=served)
    with pytest.raises(ConfigError, match=r"tie_word_embeddings"):
        gkd._sequences(student, batch)
    gkd.run = run
    loss = gkd.loss(student, batch)
    assert loss.total > 0 and 0 < loss.stats["on_policy"] < loss.count

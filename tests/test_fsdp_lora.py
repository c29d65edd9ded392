"""LoRA under FSDP2 in two CPU processes: the merged ``final/`` and the adapter the project
saves from sharded parameters equal those of the same training on one process.

accelerate refuses FSDP without an accelerator, so ``tests/fsdp_lora_worker.py`` shards with
torch's ``fully_shard`` as accelerate's FSDP2 plugin does and then runs the project's save path
(``adapters.gathered_copy`` + ``adapters.save_final``). What only a GPU can show: the same
through ``accelerate launch --config_file conf/accelerate/fsdp2.yaml`` (its wrapping, mixed
precision policy, sharded checkpoints and resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, free_port
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "fsdp_lora_worker.py"


def _run(*command: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_lora_trained_sharded_saves_the_same_final_as_on_one_process(tmp_path):
    from peft import AutoPeftModelForCausalLM

    one, two = tmp_path / "one", tmp_path / "two"
    _run(sys.executable, str(WORKER), str(one))
    _run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(WORKER),
        str(two),
    )
    expected = load_file(one / "final" / "model.safetensors")
    merged = load_file(two / "final" / "model.safetensors")
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    stops = json.loads((two / "final" / "generation_config.json").read_text())["eos_token_id"]
    assert (
        stops == json.loads((one / "final" / "generation_config.json").read_text())["eos_token_id"]
    )
    assert isinstance(stops, list) and len(stops) == 2  # the stop token survives the gathering
    base = load_file(two / "final" / "base" / "model.safetensors")
    assert not torch.equal(base["model.embed_tokens.weight"], merged["model.embed_tokens.weight"])

    ids = torch.randint(3, 2000, (1, 16), generator=torch.Generator().manual_seed(2))
    adapted = AutoPeftModelForCausalLM.from_pretrained(two / "final" / "adapter")
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(two / "final")(input_ids=ids).logits
        torch.testing.assert_close(adapted(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)

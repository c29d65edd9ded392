"""Flash attention on MUSA (``recipes.device.musa_flash_attention``): where flash-attention's
API imports on a MUSA device and transformers detects it there (``is_flash_attn_2_available``
accepts MUSA from huggingface/transformers PR #48612; the installed 5.x has it, 4.57 asks for
CUDA or MLU only), a bf16 / fp16 run defaults to ``flash_attention_2``, and DPO / KTO / GRPO
run padding-free and SFT packs without cross-talk through its variable-length kernels.

On the emulated card the kernel is ``tests/flash_attn_standin`` (the padding-free tests'
reference varlen attention, as a ``flash_attn`` package): the padding-free DPO batch runs
through transformers' flash path on the card with the padded batch's loss and gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, on_musa

from recipes import device

STANDIN = ROOT / "tests/flash_attn_standin"


def test_no_flash_attention_default_off_musa() -> None:
    found = device.musa_flash_attention()
    assert not found.usable and found.detail == "not a MUSA device"
    assert device.default_attn_implementation("bf16") == "sdpa"


_DPO_ON_THE_CARD = r"""
import json, logging, sys
import torch
from transformers import AutoModelForCausalLM
from conftest import make_task
from test_padding_free import TINY_LLAMA, _data, _frozen, _loss_and_grads, _pairs
from recipes import device
from recipes.config import ModelConfig
from recipes.model import load_model, load_tokenizer

logging.basicConfig(level=logging.INFO)  # the line that names the kernel

out = {
    "flash": device.musa_flash_attention().detail,
    "default": {p: device.default_attn_implementation(p) for p in ("bf16", "fp16", "no")},
}
tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
results = {}
for attention in ("sdpa", "auto"):  # auto: the device's default for a bf16 run
    dpo = make_task("dpo", chat_template="zephyr", max_seq_length=256)
    data = _data(dpo, __import__("pathlib").Path(sys.argv[1]) / attention, tokenizer, _pairs(6))
    torch.manual_seed(0)
    cfg = ModelConfig(name_or_path=str(TINY_LLAMA), attn_implementation=attention)
    model = load_model(cfg, AutoModelForCausalLM, precision="bf16")
    model = model.float().to("musa").train()  # fp32: the stand-in computes exactly
    out.setdefault("loaded", []).append(model.config._attn_implementation)
    dpo.check_model(model)
    data.layout.decide(dpo.flat_batches(model))
    dpo.reference = _frozen(model)
    batch = data.train_collator([data.train[i] for i in range(len(data.train))])
    batch = {k: v.to("musa") for k, v in batch.items()}
    loss, grads = _loss_and_grads(dpo, model, batch)
    results[attention] = (loss, grads, list(batch["input_ids"].shape), str(loss.total.device))
(loss_p, grads_p, shape_p, on_p), (loss_f, grads_f, shape_f, on_f) = results.values()
out["shapes"] = [shape_p, shape_f]
out["devices"] = [on_p, on_f]
out["losses"] = [loss_p.total.item(), loss_f.total.item()]
out["grad_gap"] = max(
    ((grads_f[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
    for n, g in grads_p.items()
)
out["grads"] = [sorted(grads_p) == sorted(grads_f), len(grads_p)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_padding_free_dpo_runs_through_the_musa_flash_kernel(tmp_path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT / "tests"), str(ROOT)])
    command = on_musa(sys.executable, "-c", _DPO_ON_THE_CARD, str(tmp_path))
    done = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["flash"].startswith("flash_attn 2.8.3 (") and "flash_attn_standin" in out["flash"]
    # flash kernels take no fp32: an fp32 run keeps SDPA.
    assert out["default"] == {
        "bf16": "flash_attention_2",
        "fp16": "flash_attention_2",
        "no": "sdpa",
    }
    (rows, width), (one, flat) = out["shapes"]
    assert rows == 12 and one == 1 and flat < rows * width  # padded pairs; one row, no padding
    assert out["devices"] == ["musa:0", "musa:0"]
    assert out["loaded"] == ["sdpa", "flash_attention_2"]
    assert "attention: flash_attention_2, flash_attn 2.8.3 (" in done.stderr  # the run says so
    assert out["losses"][1] == pytest.approx(out["losses"][0], rel=1e-5, abs=1e-6)
    assert out["grads"][0] and out["grads"][1] > 0 and out["grad_gap"] < 1e-4

"""``python tests/reference_free_run.py REPORT train.py-overrides...``: train.py, watched for a
reference model (tests/test_dpo_reference_free.py).

In the run, ``copy.deepcopy`` inside ``recipes.tasks.chat.reference`` (how the DPO task makes its
frozen reference) and peft's ``disable_adapter`` (its LoRA reference) fail the run; after the task's
``before_training`` and at every loss, the task's reference and the models alive in the process
are recorded. REPORT (JSON) is written at exit.
"""

from __future__ import annotations

import atexit
import gc
import json
import runpy
import sys
import types
from pathlib import Path

import peft
import torch
from transformers import PreTrainedModel

from recipes.tasks import chat, dpo

REPORT = Path(sys.argv[1])
report: dict = {"losses": 0, "references": [], "deepcopies": 0, "adapter_disabled": 0}


def _no_copy(*args, **kwargs):
    report["deepcopies"] += 1
    raise AssertionError("task=dpo copied the model (a reference)")


chat.reference.copy = types.SimpleNamespace(deepcopy=_no_copy)


def _no_disabling(self, *args, **kwargs):
    report["adapter_disabled"] += 1
    raise AssertionError("task=dpo disabled the LoRA adapter (a reference pass)")


peft.PeftModel.disable_adapter = _no_disabling


def _models() -> list[PreTrainedModel]:
    """The models alive in the process, not counting one inside another (a causal LM's base)."""
    gc.collect()
    models = [m for m in gc.get_objects() if isinstance(m, PreTrainedModel)]
    inner = {id(sub) for m in models for sub in m.modules() if sub is not m}
    return [m for m in models if id(m) not in inner]


def _parameters(models: list[torch.nn.Module]) -> int:
    """Their parameters' elements, each tensor once."""
    unique = {id(p): p for m in models for p in m.parameters()}
    return sum(p.numel() for p in unique.values())


before_training = dpo.DirectPreference.before_training


def _watched_before_training(self, model, data, run, batch_size):
    accelerator = run.accelerator
    report["models_before"] = len(_models())
    before_training(self, model, data, run, batch_size)
    models = _models()
    report["models_after"] = len(models)
    report["parameters_alive"] = _parameters(models)
    report["parameters_policy"] = _parameters([accelerator.unwrap_model(model)])
    report["reference_after_setup"] = self.reference is not None


loss = dpo.DirectPreference.loss


def _watched_loss(self, model, batch):
    report["losses"] += 1
    report["references"].append(self.reference is not None or "reference_logps" in batch)
    return loss(self, model, batch)


dpo.DirectPreference.before_training = _watched_before_training
dpo.DirectPreference.loss = _watched_loss
atexit.register(lambda: REPORT.write_text(json.dumps(report)))

train = Path(__file__).resolve().parents[1] / "train.py"
sys.argv = [str(train), *sys.argv[2:]]
runpy.run_path(str(train), run_name="__main__")

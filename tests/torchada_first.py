"""``python tests/torchada_first.py OUT.json [train.py overrides ...]``: import torchada first, as
a user's script or vllm-musa does, write the device decisions of :mod:`recipes.device` to
``OUT.json`` and, with overrides, run ``train.py`` in the same process.

torchada (github.com/MooreThreads/torchada) patches torch on import: ``torch.cuda`` becomes a
module that answers from ``torch.musa`` (its ``is_available`` stays CUDA's own unless
``TORCHADA_FORCE_CUDA_AVAILABLE=1``), ``torch.device("cuda")`` and ``torch.Generator("cuda")``
mean musa, ``nccl`` process groups become ``mccl``, ``CUDA_VISIBLE_DEVICES`` and
``MUSA_VISIBLE_DEVICES`` are synchronised, and ``torch.backends.cuda.matmul`` answers from
``torch.backends.musa.matmul`` where that exists."""

from __future__ import annotations

import json
import runpy
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

with warnings.catch_warnings():
    # It compiles C++ operator overrides against torch_musa's headers, which the emulated
    # card's stand-in has none of; torchada warns and goes on without them.
    warnings.simplefilter("ignore")
    import torchada  # noqa: F401

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))
from recipes import device  # noqa: E402


def decisions() -> dict:
    trained_on = torch.device(device.backend(), 0)
    return {
        "torchada_active": type(torch.cuda).__name__ != "module"
        and torch.device("cuda").type == device.MUSA,
        "cuda_is_available": torch.cuda.is_available(),
        "backend": device.backend(),
        "names": device.device_names(),
        "capability": device.device_capability(0),
        "bf16": device.supports_bf16(),
        "tf32": device.supports_tf32(),
        "default_mixed_precision": device.default_mixed_precision(),
        "attn_implementation": device.default_attn_implementation(),
        "distributed_backend": device.distributed_backend()[0],
        "tf32_set": [device.set_tf32(True), device.set_tf32(False)],
        "fused_adamw": device.fused_adamw_ok(trained_on, trained_on),
        "peak_bf16": device.peak_flops(trained_on, "bf16"),
        "defaults": {
            d.name: d.value
            for d in device.training_defaults(
                device.backend(), generates=True, whole_model=True, musa_version=None
            )
        },
    }


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(decisions()), encoding="utf-8")
    if len(sys.argv) > 2:
        sys.argv = [str(ROOT / "train.py"), *sys.argv[2:]]
        runpy.run_path(sys.argv[0], run_name="__main__")

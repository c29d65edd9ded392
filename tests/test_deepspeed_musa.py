"""DeepSpeed on MUSA (``recipes.device.deepspeed_unsupported_reason``): a DeepSpeed with a MUSA
accelerator (``deepspeed/accelerator/musa_accelerator.py``, as Moore Threads' builds and the
closed upstream port, deepspeedai/DeepSpeed PR #8191, have it) under ``DS_ACCELERATOR=musa``
runs; anything else is refused in one line that names what is missing. No DeepSpeed with a MUSA
accelerator installs here: the DeepSpeed folders below are laid out on disk as pip would lay them
out, which is all the check reads. The shipped ZeRO configs are read as accelerate reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from recipes import device


def _deepspeed(root: Path, musa: bool) -> None:
    package = root / "deepspeed"
    (package / "accelerator").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "accelerator" / "__init__.py").write_text("")
    (package / "accelerator" / "cuda_accelerator.py").write_text("")
    if musa:
        (package / "accelerator" / "musa_accelerator.py").write_text("class MUSA_Accelerator: ...")


def test_deepspeed_on_musa_needs_its_musa_accelerator_and_ds_accelerator(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv(device.DS_ACCELERATOR_ENV, raising=False)
    for kind in ("upstream", "musa"):
        _deepspeed(tmp_path / kind, musa=kind == "musa")
    monkeypatch.syspath_prepend(str(tmp_path / "upstream"))
    assert device.deepspeed_musa_accelerator() is None
    upstream = device.deepspeed_unsupported_reason(device.MUSA)
    assert "has no MUSA accelerator" in upstream and "#8191" in upstream

    monkeypatch.syspath_prepend(str(tmp_path / "musa"))
    found = device.deepspeed_musa_accelerator()
    assert found == tmp_path / "musa/deepspeed/accelerator/musa_accelerator.py"
    unset = device.deepspeed_unsupported_reason(device.MUSA)
    assert "DS_ACCELERATOR=(unset)" in unset and "set DS_ACCELERATOR=musa" in unset
    monkeypatch.setenv(device.DS_ACCELERATOR_ENV, "cuda")
    assert "DS_ACCELERATOR=cuda" in device.deepspeed_unsupported_reason(device.MUSA)
    monkeypatch.setenv(device.DS_ACCELERATOR_ENV, "musa")
    assert device.deepspeed_unsupported_reason(device.MUSA) is None
    assert device.deepspeed_unsupported_reason(device.CPU) is None  # never refused off MUSA


@pytest.mark.parametrize(
    ("name", "stage", "offload"),
    [
        ("zero2_musa.yaml", 2, "none"),
        ("zero3_musa.yaml", 3, "none"),
        ("zero3_offload_musa.yaml", 3, "cpu"),
    ],
)
def test_shipped_zero_configs_for_musa(name, stage, offload) -> None:
    config = yaml.safe_load((ROOT / "conf/accelerate" / name).read_text(encoding="utf-8"))
    assert config["distributed_type"] == "DEEPSPEED" and not config["use_cpu"]
    deepspeed = config["deepspeed_config"]
    assert deepspeed["zero_stage"] == stage
    assert deepspeed["offload_optimizer_device"] == offload
    assert deepspeed["offload_param_device"] == (offload if stage == 3 else "none")
    # The recipe's trainer.mixed_precision decides, as in the other shipped configs.
    assert config["mixed_precision"] == "no"

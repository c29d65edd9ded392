"""Device module, environment report and accelerate launch configs.

The CPU expectations are skipped on a machine with an accelerator; the table lookups, the
configs and the backend-name guard run everywhere.
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from conftest import free_port, run_cpu_launch
from packaging.version import Version

from recipes import backends, device, env

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = sorted((ROOT / "conf" / "accelerate").glob("*.yaml"))

on_cpu = pytest.mark.skipif(device.backend() != device.CPU, reason="expectations for CPU machines")
no_torch_musa = pytest.mark.skipif(
    importlib.util.find_spec("torch_musa") is not None, reason="torch_musa is installed here"
)


# What auto picks on this CPU (the flag reader is tested on its own below, with cpuinfo files).
CPU_DEFAULT_PRECISION = device.cpu_mixed_precision(
    device.cpu_bf16_native(), device.cpu_bf16_autocast()
)


@pytest.mark.parametrize(
    ("native", "autocast", "expected"),
    [(True, True, "bf16"), (True, False, "no"), (False, True, "no"), (None, True, "no")],
)
def test_cpu_default_precision_needs_bf16_instructions(
    native: bool | None, autocast: bool, expected: str
) -> None:
    assert device.cpu_mixed_precision(native, autocast) == expected


@on_cpu
def test_cpu_backend_defaults() -> None:
    assert device.backend() == "cpu"
    assert device.device_module() is None
    assert device.device_count() == 0
    assert device.device_names() == []
    assert device.default_mixed_precision() == CPU_DEFAULT_PRECISION
    assert device.default_attn_implementation() == "sdpa"
    assert device.distributed_backend()[0] == "gloo"


@on_cpu
def test_cpu_device_helpers_are_harmless() -> None:
    cpu = torch.device("cpu")
    assert device.peak_flops(cpu, "bf16") is None
    assert device.max_memory_allocated(cpu) is None
    device.synchronize(cpu)
    device.reset_peak_memory_stats(cpu)
    assert device.set_tf32(True) is False  # no TF32 on a CPU, whatever is asked
    assert device.set_tf32(False) is False


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("MTT S4000", "bf16", 100e12),
        ("MTT S4000", "fp32", 25e12),
        ("MTT S4000", "tf32", 50e12),
        ("MTT S3000", "fp32", 15.2e12),
        ("MTT S80", "fp32", 14.4e12),
        ("MTT S5000", "fp8", 1000e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "bf16", 989.4e12),
        ("NVIDIA L4", "fp16", 121e12),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
        ("Tesla V100-SXM2-32GB", "fp16", 125e12),
        # No TF32 units: TF32-enabled matmuls run at the fp32 rate.
        ("Tesla V100-SXM2-32GB", "tf32", 15.7e12),
        # No published fp16 figure: fp16 runs at least at the fp32 rate (MFU an upper bound).
        ("MTT S80", "fp16", 14.4e12),
        ("MTT S3000", "float16", 15.2e12),
    ],
)
def test_lookup_peak_known(name: str, dtype: str, expected: float) -> None:
    assert device.peak_flops_by_name(name, dtype) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "dtype", "basis"),
    [
        ("MTT S4000", "fp16", "fp16"),
        ("MTT S80", "fp16", "fp32"),
        ("MTT S80", "bf16", None),  # no bf16 at all on S80: not guessed
        ("Tesla V100-SXM2-32GB", "tf32", "fp32"),
        ("MTT S5000", "fp16", None),  # only an fp8 figure
    ],
)
def test_peak_basis_says_which_figure_is_used(name: str, dtype: str, basis: str | None) -> None:
    assert device.peak_flops_basis(name, dtype) == basis


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("Some Future Accelerator", "bf16"),
        ("NVIDIA A10G", "bf16"),  # not the A10, and not in the table
        ("NVIDIA GeForce RTX 4090 D", "bf16"),
        ("Tesla V100-SXM2-32GB", "bf16"),  # no native bf16: not guessed
        ("MTT S80", "bf16"),  # fp16 only
        ("MTT S5000", "bf16"),
    ],
)
def test_lookup_peak_unknown_is_none(name: str, dtype: str) -> None:
    assert device.peak_flops_by_name(name, dtype) is None


def test_s5000_peak_table_says_what_is_not_published() -> None:
    """The MTT S5000 (MUSA 3.1): Moore Threads' press figures give about 1,000 dense FP8
    TFLOPS, 80 GB at 1.6 TB/s, and no bf16, fp16, TF32 or fp32 peak. The table holds the FP8
    figure, says the rest is unpublished, and a bf16 run gets no MFU rather than a guess."""
    note = device.peak_flops_note("MTT S5000")
    assert note is not None and "bf16" in note and "MFU" in note
    assert all(
        device.peak_flops_by_name("MTT S5000", dtype) is None
        for dtype in ("fp32", "tf32", "fp16", "bf16")
    )
    assert device.peak_flops_note("MTT S4000") is None  # its bf16 peak is published


def test_s5000_advice_says_bf16_runs_have_no_mfu(tmp_path: Path) -> None:
    report = _musa_report("MTT S5000", 8, mccl=True, bf16=True)
    for dev in report["devices"]:
        dev.update(capability="3.1", fp8=True, peak_flops_note=device.peak_flops_note(dev["name"]))
    advice = env.advice(report)
    (line,) = [line for line in advice if "no published bf16 peak" in line]  # once, not 8 times
    assert line.startswith("MTT S5000:") and "no MFU" in line
    assert not any("not in the peak FLOP/s table" in line for line in advice)
    config = _write_and_load(report, tmp_path / "s5000.yaml")
    assert config.distributed_type.value == "MULTI_MUSA" and config.mixed_precision == "bf16"
    s4000 = env.advice(_musa_report("MTT S4000", 8, mccl=True, bf16=True))
    assert not any("no published" in line for line in s4000)


def test_deepspeed_is_refused_on_musa_only() -> None:
    """No MUSA accelerator upstream (DeepSpeed PR #8191 closed unmerged) and no public source
    of MT DeepSpeed: refused on MUSA with both named; CUDA and CPU keep DeepSpeed."""
    reason = device.deepspeed_unsupported_reason(device.MUSA)
    assert reason is not None
    assert all(part in reason for part in ("MT DeepSpeed", "DS_ACCELERATOR=musa", "#8191"))
    assert device.deepspeed_unsupported_reason(device.CUDA) is None
    assert device.deepspeed_unsupported_reason(device.CPU) is None


def test_lookup_peak_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        device.peak_flops_by_name("MTT S4000", "int4")


@pytest.mark.slow  # env_check.py in a Python of its own
def test_env_json_subprocess() -> None:
    result = _run_doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backend"] == device.backend()
    versions = report["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["accelerate"] and versions["transformers"]
    assert report["default_mixed_precision"] == device.default_mixed_precision()
    assert report["distributed_backend"] == device.distributed_backend()[0]
    assert set(report["visible_devices_env"]) == set(backends.VISIBLE_DEVICES_ENV_VARS)
    if device.backend() == device.CPU:
        assert report["device_count"] == 0
        assert any("conf/accelerate/cpu.yaml" in line for line in report["advice"])


def test_write_accelerate_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nested" / "local.yaml"
    assert env.main(["--write-accelerate-config", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    assert path.read_text(encoding="utf-8").startswith("# accelerate launch --config_file")
    config = load_config_from_file(str(path))
    report = env.collect()
    assert config.distributed_type.value == report["accelerate_distributed_type"]
    assert config.num_processes == report["launch_num_processes"]
    assert config.mixed_precision == device.default_mixed_precision()
    if device.backend() == device.CPU:
        assert config.distributed_type.value in {"NO", "MULTI_CPU"}
        assert config.use_cpu is True


def test_accelerate_configs_exist() -> None:
    names = {path.name for path in ACCELERATE_CONFIGS}
    assert {
        "single_device.yaml",
        "multi_musa.yaml",
        "multi_musa_2nodes.yaml",
        "fsdp.yaml",
        "fsdp2.yaml",
        "hsdp_musa.yaml",
        "cpu.yaml",
    } <= names


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_parses(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    # Each file opens with the command that uses it.
    first_line = text.splitlines()[0]
    assert first_line.startswith("# ")
    assert f"accelerate launch --config_file conf/accelerate/{path.name} " in first_line
    config = load_config_from_file(str(path))
    assert config.compute_environment.value == "LOCAL_MACHINE"
    multi_node = "2nodes" in path.name or path.name.startswith("hsdp")
    assert config.num_machines == (2 if multi_node else 1)
    if config.num_machines > 1:  # processes of all machines, the same number on each
        assert config.num_processes == 8 * config.num_machines
        assert config.distributed_type.value in ("MULTI_MUSA", "FSDP")  # DDP or HSDP


@pytest.mark.skipif(
    env._version_tuple(importlib.metadata.version("accelerate")) < (1, 6)
    or env._version_tuple(torch.__version__) < (2, 6),
    reason="FSDP2 needs accelerate >= 1.6 and torch >= 2.6",
)
def test_fsdp2_config_builds_accelerates_fsdp2_plugin() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    text = (ROOT / "conf/accelerate/fsdp2.yaml").read_text(encoding="utf-8")
    found = yaml.safe_load(text)["fsdp_config"]
    # The launcher passes these as FSDP_* variables; the plugin takes the same values.
    renamed = {"fsdp_version": "fsdp_version", "fsdp_offload_params": "cpu_offload"}
    plugin = FullyShardedDataParallelPlugin(
        **{renamed.get(k, k.removeprefix("fsdp_")): v for k, v in found.items()}
    )
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert "TORCH_MUSA_FSDP2_OVERLAP_LEVEL" in text


def test_reference_multi_musa_config() -> None:
    config = load_config_from_file(str(ROOT / "conf/accelerate/multi_musa.yaml"))
    assert config.distributed_type.value == "MULTI_MUSA"
    assert config.num_processes == 8
    assert config.gpu_ids == "0,1,2,3,4,5,6,7"
    assert config.mixed_precision == "no"
    assert config.rdzv_backend == "static"
    assert config.same_network is True
    assert config.use_cpu is False


@pytest.mark.parametrize("path", sorted((ROOT / "conf").rglob("*.yaml")), ids=lambda p: p.name)
def test_documents_cited_in_configs_are_in_the_repository(path: Path) -> None:
    # Documents, as cited: README.md, MUSA.md, docs/launching.md (not output files: summary.md).
    comments = [line.partition("#")[2] for line in path.read_text(encoding="utf-8").splitlines()]
    for cited in re.findall(r"(?:docs/[\w./-]+|\b[A-Z][A-Za-z_]*)\.md\b", "\n".join(comments)):
        assert (ROOT / cited).exists(), (path.name, cited)


# --- the doctor (recipes.env / scripts/env_check.py) ---------------------------------------

# The environment of a doctor run with no device-hiding variables and no launcher leftovers, so
# the CPU expectations hold whatever the calling shell exported.
_CLEAN_ENV = {
    key: value
    for key, value in os.environ.items()
    if key not in backends.VISIBLE_DEVICES_ENV_VARS and not key.startswith("ACCELERATE_")
}


def _run_doctor(*args: str, env_vars: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python scripts/env_check.py <args>`` as a user runs it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "env_check.py"), *args],
        cwd=ROOT,
        env={**_CLEAN_ENV, **(env_vars or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _fake_tool(folder: Path, name: str) -> Path:
    """An executable stand-in for a vendor tool, to put on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text("#!/bin/sh\necho 'no device'\n", encoding="utf-8")
    tool.chmod(0o755)
    return tool


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """In-process doctor runs without the caller's device-hiding variables."""
    for var in backends.VISIBLE_DEVICES_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@on_cpu
@no_torch_musa
def test_doctor_facts_on_this_cpu_machine(clean_env: pytest.MonkeyPatch) -> None:
    report = env.collect()
    assert report["backend"] == "cpu"
    assert report["device_count"] == 0 and report["devices"] == []
    assert report["accelerate_distributed_type"] == "NO"
    assert report["launch_num_processes"] == 1
    assert report["distributed_backend"] == "gloo"
    assert report["mccl_available"] is False
    assert report["accelerate_sees_musa"] is False
    assert report["torch_musa"]["installed"] is False
    assert report["torch_musa"]["expected_torch"] is None
    assert report["versions"]["torch_gpu_build"] == backends.torch_accelerator_build()
    assert report["python_executable"] == sys.executable
    # bf16 on CPU is autocast, tried for real; TF32 does not apply.
    precision = report["precision"]
    assert precision["bf16"] == {
        "supported": device.cpu_bf16_autocast(),
        "mode": "autocast on CPU",
        "cpu_instructions": device.cpu_bf16_native(),
    }
    assert precision["tf32"] == {"applicable": False, "supported": None}
    assert report["default_mixed_precision"] == CPU_DEFAULT_PRECISION
    assert set(report["vendor_tools"]) == set(report["kernel_modules"]) == {"musa", "cuda"}
    assert report["visible_devices_env"] == dict.fromkeys(backends.VISIBLE_DEVICES_ENV_VARS)
    advice = "\n".join(report["advice"])
    # The two-process CPU launch and the precision setting are what the advice points to.
    assert "ACCELERATE_USE_CPU=1 accelerate launch --config_file conf/accelerate/cpu.yaml" in advice
    assert "trainer.mixed_precision" in advice and "trainer.tf32" in advice
    assert "torch_musa" not in advice
    assert not any(var in advice for var in backends.VISIBLE_DEVICES_ENV_VARS)


@on_cpu
def test_doctor_text_report_on_this_cpu_machine(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert env.main([]) == 0
    out = capsys.readouterr().out
    for row in (
        "backend                      cpu",
        "MCCL available               no",
        "mthreads-gmi on PATH         -",
        "MTHREADS_VISIBLE_DEVICES     -",
        "accelerate distributed_type  NO",
    ):
        assert row in out, row
    assert "conf/accelerate/cpu.yaml" in out.split("\nAdvice\n")[1]


@on_cpu
@pytest.mark.parametrize("value", ["", "-1", "none"])
def test_advice_container_variable_hiding_every_device(
    clean_env: pytest.MonkeyPatch, value: str
) -> None:
    clean_env.setenv("MTHREADS_VISIBLE_DEVICES", value)
    report = env.collect()
    assert report["visible_devices_env"]["MTHREADS_VISIBLE_DEVICES"] == value
    first = report["advice"][0]  # problems first
    assert first.startswith(f"MTHREADS_VISIBLE_DEVICES={value!r}")
    assert "MTHREADS_VISIBLE_DEVICES=all" in first


@on_cpu
def test_advice_index_variable_hiding_every_device(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MUSA_VISIBLE_DEVICES", "-1")
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # selects devices; hides nothing
    advice = env.collect()["advice"]
    assert advice[0].startswith("MUSA_VISIBLE_DEVICES='-1'")
    assert "MUSA_VISIBLE_DEVICES=all" not in advice[0]  # an index variable takes indices
    assert "CUDA_VISIBLE_DEVICES" not in "\n".join(advice)


@on_cpu
@no_torch_musa
def test_advice_mthreads_gmi_without_torch_musa(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tool = _fake_tool(tmp_path / "bin", "mthreads-gmi")
    clean_env.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    clean_env.setenv("MTHREADS_VISIBLE_DEVICES", "")
    report = env.collect()
    assert report["vendor_tools"]["musa"] == str(tool)
    assert report["backend"] == "cpu"  # a tool on PATH is no device
    advice = report["advice"]
    assert advice[0].startswith("MTHREADS_VISIBLE_DEVICES=''")
    musa = advice[1]  # then torch_musa: the image, the releases and the container flags
    assert "mthreads-gmi" in musa and sys.executable in musa
    assert "registry.mthreads.com/mcconline/musa-pytorch-release-public" in musa
    assert "--runtime=mthreads --env MTHREADS_VISIBLE_DEVICES=all" in musa
    releases = backends.torch_musa_releases_for_torch(torch.__version__)
    assert all(release in musa for release in releases)
    assert backends.TORCH_MUSA_RELEASES_URL in musa


@on_cpu
def test_advice_nvidia_smi_with_cpu_only_torch(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tool = _fake_tool(tmp_path / "bin", "nvidia-smi")
    clean_env.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    advice = "\n".join(env.collect()["advice"])
    if backends.torch_accelerator_build() is None:  # this venv's torch is the +cpu wheel
        assert "--index-url https://download.pytorch.org/whl/cu" in advice
    else:
        assert "--gpus all" in advice


# Report dicts for machines this one is not: the advice and configs are functions of the report.


def _report(**changes: Any) -> dict[str, Any]:
    """A report of a plain CPU machine, with top-level keys replaced by ``changes``."""
    report: dict[str, Any] = {
        "backend": "cpu",
        "device_count": 0,
        "devices": [],
        "cpu": {"name": "x86_64", "logical_cores": 8},
        "python_executable": "/usr/bin/python3",
        "versions": {
            "python": "3.10.12",
            "torch": "2.2.0",
            "torch_gpu_build": None,
            "torch_musa": None,
            "accelerate": "0.33.0",
            "transformers": "4.40.0",
            "torchada": None,
        },
        "torch_musa": {
            "installed": False,
            "imported": False,
            "version": None,
            "error": None,
            "expected_torch": None,
        },
        "accelerate_sees_musa": False,
        "precision": {
            "bf16": {"supported": True, "mode": "autocast on CPU", "cpu_instructions": False},
            "tf32": {"applicable": False, "supported": None},
            "default_mixed_precision": "no",
        },
        "default_mixed_precision": "no",
        "default_attn_implementation": "sdpa",
        "sdpa_probe": {"device": "cpu", "ok": True, "dtypes": {}},
        "image": None,
        "image_gpu": None,
        "distributed_backend": "gloo",
        "distributed_backend_reason": "gloo (CPU processes)",
        "mccl_available": False,
        "vendor_tools": {"musa": None, "cuda": None},
        "kernel_modules": {"musa": False, "cuda": False},
        "visible_devices_env": dict.fromkeys(backends.VISIBLE_DEVICES_ENV_VARS),
    }
    report.update(copy.deepcopy(changes))
    report["launch_num_processes"], report["accelerate_distributed_type"] = env._launch_plan(report)
    return report


def _with_torch_musa(report: dict[str, Any], version: str, **info: Any) -> dict[str, Any]:
    report["versions"]["torch_musa"] = version
    report["torch_musa"].update(
        installed=True,
        imported=True,
        version=version,
        expected_torch=list(backends.torch_for_torch_musa(version)),
        **info,
    )
    return report


def _gpu(index: int, name: str, capability: str, bf16: bool, tf32: bool) -> dict[str, Any]:
    return {
        "index": index,
        "name": name,
        "capability": capability,
        "total_memory_bytes": 48 * 1024**3,
        "bf16": bf16,
        "tf32": tf32,
        "peak_flops": {d: device.peak_flops_by_name(name, d) for d in ("fp32", "bf16", "fp8")},
    }


def _musa_report(name: str, count: int, *, mccl: bool, bf16: bool) -> dict[str, Any]:
    report = _report(
        backend="musa",
        device_count=count,
        devices=[_gpu(i, name, "2.2" if bf16 else "2.1", bf16, bf16) for i in range(count)],
        precision={
            "bf16": {"supported": bf16, "mode": "native", "cpu_instructions": None},
            "tf32": {"applicable": True, "supported": bf16},
            "default_mixed_precision": "bf16" if bf16 else "fp16",
        },
        default_mixed_precision="bf16" if bf16 else "fp16",
        default_attn_implementation="sdpa",
        distributed_backend="mccl" if mccl else None,
        distributed_backend_reason="MCCL (registered by torch_musa)" if mccl else "no MCCL",
        mccl_available=mccl,
        vendor_tools={"musa": "/usr/bin/mthreads-gmi", "cuda": None},
        kernel_modules={"musa": True, "cuda": False},
        accelerate_sees_musa=True,
    )
    return _with_torch_musa(report, "1.3.0")


def _write_and_load(report: dict[str, Any], path: Path) -> Any:
    env.write_accelerate_config(path, report)
    return load_config_from_file(str(path))


def test_s80_without_mccl_is_single_device(tmp_path: Path) -> None:
    report = _musa_report("MTT S80", 2, mccl=False, bf16=False)
    advice = "\n".join(env.advice(report))
    assert "MUSA_VISIBLE_DEVICES=<index>" in advice  # one card, chosen by index
    assert "conf/accelerate/single_device.yaml" in advice
    # The report's accelerate is 0.33.0, whose MUSA fp16 path has no grad scaler.
    assert "accelerate>=1.0" in advice
    assert "attn_implementation" not in advice
    assert "torch==" not in advice  # torch_musa 1.3.0 with torch 2.2.0 match
    config = _write_and_load(report, tmp_path / "s80.yaml")
    assert config.distributed_type.value == "NO"
    assert config.num_processes == 1
    assert config.use_cpu is False
    assert config.mixed_precision == "fp16"


def test_s4000_with_mccl_is_multi_musa(tmp_path: Path) -> None:
    report = _musa_report("MTT S4000", 8, mccl=True, bf16=True)
    advice = "\n".join(env.advice(report))
    assert "--write-accelerate-config conf/accelerate/local.yaml" in advice
    assert "conf/accelerate/fsdp.yaml" in advice  # FSDP1: the report's torch is 2.2
    assert "trainer.tf32=true" in advice
    assert "MUSA_VISIBLE_DEVICES" not in advice and "single_device.yaml" not in advice
    config = _write_and_load(report, tmp_path / "s4000.yaml")
    assert config.distributed_type.value == "MULTI_MUSA"
    assert config.num_processes == 8
    assert config.gpu_ids == "all"
    assert config.mixed_precision == "bf16"
    assert config.use_cpu is False


@pytest.mark.parametrize(
    ("torch_musa", "torch_version", "pin"),
    [
        ("1.3.0", "2.5.1", "torch==2.2.0"),
        ("2.0.0-pt25", "2.2.0", "torch==2.5.0"),
        # What v2.0.0 and v2.0.0-pt25 both report (setup.py: version.txt + "+" + commit).
        ("2.0.0+8b583b3", "2.7.1", "torch==2.2.0"),
        ("2.0.0+8b583b3", "2.2.0a0+git8ac9b20", None),
        ("2.0.0+8b583b3", "2.5.0", None),
        ("1.3.0+aa63a73", "2.2.0", None),
        ("2.7.1+101c131", "2.7.1", None),
        ("2.7.0", "2.5.0", "torch==2.7.1"),
        ("2.0.0-pt25", "2.5.0", None),
        ("2.1.0", "2.5.1", "torch==2.5.0"),  # imports, but torch_musa warns
        ("2.7.1+0bc05bf", "2.7.0", "torch==2.7.1"),  # below its TORCH_MIN_VERSION: refused
        ("2.5.0+0dbf6f1", "2.5.0a0+gitabc1234", None),  # a vendor build of 2.5.0
        ("2.7.1", "2.7.1", None),
    ],
)
def test_advice_torch_version_against_torch_musa(
    torch_musa: str, torch_version: str, pin: str | None
) -> None:
    report = _with_torch_musa(_musa_report("MTT S4000", 1, mccl=True, bf16=True), torch_musa)
    report["versions"]["torch"] = torch_version
    advice = "\n".join(env.advice(report))
    if pin is None:
        assert "torch_musa" not in advice
    else:  # the torch to pin, and where the matching wheels are
        assert pin in advice and backends.TORCH_MUSA_RELEASES_URL in advice
        minimum = backends.torch_musa_minimum_torch(torch_musa)
        below = backends.torch_base_version(torch_version) < Version(minimum)
        assert ("refuses to import" in advice) is below, advice


def test_advice_torch_musa_not_in_the_table() -> None:
    report = _with_torch_musa(_musa_report("MTT S4000", 1, mccl=True, bf16=True), "9.9.0")
    assert report["torch_musa"]["expected_torch"] == []
    assert any("torch_musa 9.9.0" in line for line in env.advice(report))


def test_advice_torch_musa_import_failure() -> None:
    report = _report()
    report["versions"]["torch_musa"] = "1.3.0"
    report["torch_musa"].update(
        installed=True,
        error="OSError: libsrv_um_MUSA.so: cannot open shared object file",
        expected_torch=["2.2.0"],
    )
    advice = env.advice(report)
    assert "OSError: libsrv_um_MUSA.so" in advice[0]  # the error, first
    assert "--runtime=mthreads --env MTHREADS_VISIBLE_DEVICES=all" in advice[0]


def test_advice_torch_musa_sees_no_device() -> None:
    report = _with_torch_musa(
        _report(vendor_tools={"musa": "/usr/bin/mthreads-gmi", "cuda": None}), "2.7.0"
    )
    report["versions"]["torch"] = "2.7.1"
    advice = env.advice(report)
    assert "mthreads-gmi" in advice[0] and "`lsmod | grep mtgpu`" in advice[0]
    assert "--runtime=mthreads --env MTHREADS_VISIBLE_DEVICES=all" in advice[0]
    assert any("conf/accelerate/cpu.yaml" in line for line in advice)


def test_advice_musa_driver_without_torch_musa() -> None:
    report = _report(kernel_modules={"musa": True, "cuda": False})
    report["versions"]["torch"] = "2.5.1"
    advice = env.advice(report)
    assert "mtgpu" in advice[0] and "/usr/bin/python3" in advice[0]
    for release in ("v2.0.0-pt25", "v2.1.x", "v2.5.0"):  # the releases built for torch 2.5
        assert release in advice[0]
    assert "v2.7.x" not in advice[0]


def test_advice_cuda_machine(tmp_path: Path) -> None:
    report = _report(
        backend="cuda",
        device_count=4,
        devices=[_gpu(i, "NVIDIA A100-SXM4-80GB", "8.0", True, True) for i in range(4)],
        precision={
            "bf16": {"supported": True, "mode": "native", "cpu_instructions": None},
            "tf32": {"applicable": True, "supported": True},
            "default_mixed_precision": "bf16",
        },
        default_mixed_precision="bf16",
        distributed_backend="nccl",
        distributed_backend_reason="NCCL",
        vendor_tools={"musa": None, "cuda": "/usr/bin/nvidia-smi"},
    )
    report["versions"]["torch_gpu_build"] = "CUDA 12.1"
    advice = "\n".join(env.advice(report))
    assert "MULTI_GPU" in advice and "--write-accelerate-config" in advice
    assert "torch_musa" not in advice and "MTHREADS" not in advice
    config = _write_and_load(report, tmp_path / "a100.yaml")
    assert (config.distributed_type.value, config.num_processes) == ("MULTI_GPU", 4)


def test_advice_nvidia_driver_but_no_gpu_seen() -> None:
    report = _report(kernel_modules={"musa": False, "cuda": True})
    report["versions"]["torch_gpu_build"] = "CUDA 12.1"
    advice = env.advice(report)
    assert "--gpus all" in advice[0]
    assert "CUDA_VISIBLE_DEVICES" in advice[0]


@pytest.mark.parametrize("instructions", [True, False, None])
def test_advice_plain_cpu(instructions: bool | None, tmp_path: Path) -> None:
    report = _report()
    report["precision"]["bf16"]["cpu_instructions"] = instructions
    picked = device.cpu_mixed_precision(instructions, autocast=True)
    report["default_mixed_precision"] = report["precision"]["default_mixed_precision"] = picked
    advice = env.advice(report)
    assert len(advice) == 2  # how to launch, and the precision it trains in
    assert "conf/accelerate/cpu.yaml --multi_gpu" in advice[0]
    assert "trainer.mixed_precision" in advice[1]
    text = env.format_report({**report, "advice": advice})
    assert "not applicable on CPU" in text
    config = _write_and_load(report, tmp_path / "cpu.yaml")
    assert (config.distributed_type.value, config.num_processes, config.use_cpu) == ("NO", 1, True)
    assert config.mixed_precision == ("bf16" if instructions else "no")


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("1.0.0", ("2.0.0",)),
        ("1.2.1", ("2.0.0",)),
        ("1.3.0+aa63a73", ("2.2.0",)),
        ("v2.0.1", ("2.2.0", "2.5.0")),
        ("2.0.0+8b583b3", ("2.2.0", "2.5.0")),  # v2.0.0 or v2.0.0-pt25: the string cannot tell
        ("2.0.0-pt25", ("2.5.0",)),
        ("v2.0.0-pt25", ("2.5.0",)),
        ("2.1.1+0a1b2c3", ("2.5.0",)),
        ("2.5.0", ("2.5.0",)),
        ("2.7.0", ("2.7.1",)),
        ("2.7.1+101c131", ("2.7.1",)),
        ("2.3.0", ()),
        ("dev", ()),
    ],
)
def test_torch_for_torch_musa(version: str, expected: tuple[str, ...]) -> None:
    assert backends.torch_for_torch_musa(version) == expected


def test_torch_musa_releases_for_torch() -> None:
    assert backends.torch_musa_releases_for_torch("2.2.0") == ["v1.3.x", "v2.0.x"]
    assert backends.torch_musa_releases_for_torch("2.5.0") == ["v2.0.0-pt25", "v2.1.x", "v2.5.0"]
    assert backends.torch_musa_releases_for_torch("2.7.1+cpu") == ["v2.7.x"]
    assert backends.torch_musa_releases_for_torch("2.0.1") == ["v1.0-v1.2"]
    assert backends.torch_musa_releases_for_torch("2.4.0") == []
    # torch_musa 2.7.x refuses torch below its TORCH_MIN_VERSION 2.7.1; 2.2 builds take 2.2.0a0.
    assert backends.torch_musa_releases_for_torch("2.7.0") == []
    assert backends.torch_musa_releases_for_torch("2.2.0a0+git8ac9b20") == ["v1.3.x", "v2.0.x"]


@pytest.mark.parametrize(
    ("version", "minimum"),
    [("1.3.0", "2.0.0"), ("2.0.0+8c8e412", "2.0.0"), ("2.0.0-pt25", "2.5.0"), ("2.7.0", "2.7.1")],
)
def test_torch_musa_minimum_torch(version: str, minimum: str) -> None:
    assert backends.torch_musa_minimum_torch(version) == minimum


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n", True),
        ("processor\t: 0\nflags\t\t: fpu sse amx_bf16 amx_tile\n", True),
        ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n", False),
        ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", True),  # Arm (Neoverse V1 and up)
        ("processor\t: 0\nFeatures\t: fp asimd\n", False),
        ("processor\t: 0\n", None),
    ],
)
def test_cpu_bf16_native(tmp_path: Path, text: str, expected: bool | None) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text, encoding="utf-8")
    assert device.cpu_bf16_native(str(cpuinfo)) is expected


def test_cpu_bf16_native_without_cpuinfo(tmp_path: Path) -> None:
    assert device.cpu_bf16_native(str(tmp_path / "missing")) is None


def test_cpu_bf16_autocast_is_real() -> None:
    # Whatever this torch answers must be what a bf16 autocast matmul really does here.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert device.cpu_bf16_autocast() is (out.dtype == torch.bfloat16)


def test_accelerate_distributed_type_for_other_backends() -> None:
    assert backends.accelerate_distributed_type(8, device.MUSA) == "MULTI_MUSA"
    assert backends.accelerate_distributed_type(2, device.CUDA) == "MULTI_GPU"
    assert backends.accelerate_distributed_type(2, device.CPU) == "MULTI_CPU"
    assert backends.accelerate_distributed_type(1, device.MUSA) == "NO"


# --write-accelerate-config: accepted by a real `accelerate launch`, never clobbers a file.

_PROBE = (
    "from pathlib import Path\n"
    "from accelerate import Accelerator\n"
    "a = Accelerator()\n"
    "fields = [a.distributed_type.value, a.num_processes, a.device.type, a.mixed_precision]\n"
    "print(*fields)\n"
    "Path(f'rank{a.process_index}.txt').write_text(' '.join(map(str, fields)))\n"
)


@pytest.mark.slow
@on_cpu
def test_written_config_runs_under_accelerate_launch(tmp_path: Path) -> None:
    config = tmp_path / "local.yaml"
    result = _run_doctor("--write-accelerate-config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"wrote accelerate config: {config}" in result.stdout
    script = tmp_path / "probe.py"
    script.write_text(_PROBE, encoding="utf-8")
    # The command the file's first line documents, with the probe for train.py.
    first_line = config.read_text(encoding="utf-8").splitlines()[0]
    assert first_line == f"# accelerate launch --config_file {config} train.py recipe=<name>"
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(free_port()),
            str(script),
        ],
        cwd=tmp_path,
        env=_CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert launch.returncode == 0, launch.stderr[-2000:]
    probes = sorted(path.read_text().split() for path in tmp_path.glob("rank*.txt"))
    # One CPU process, not distributed, the precision the doctor reported for this machine.
    assert probes == [["NO", "1", "cpu", CPU_DEFAULT_PRECISION]]
    assert f"NO 1 cpu {CPU_DEFAULT_PRECISION}" in launch.stdout


def test_write_accelerate_config_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "local.yaml"
    path.write_text("# mine\n", encoding="utf-8")
    assert env.main(["--write-accelerate-config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the report: nothing else happened
    assert str(path) in captured.err and "--force" in captured.err
    assert path.read_text(encoding="utf-8") == "# mine\n"
    with pytest.raises(FileExistsError):
        env.write_accelerate_config(path, env.collect())
    assert path.read_text(encoding="utf-8") == "# mine\n"

    assert env.main(["--write-accelerate-config", str(path), "--force", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout stays JSON; the note goes to stderr
    assert f"wrote accelerate config: {path}" in captured.err
    assert load_config_from_file(str(path)).num_processes >= 1


@pytest.mark.slow  # env_check.py in a Python of its own
def test_write_accelerate_config_refusal_exit_status(tmp_path: Path) -> None:
    path = tmp_path / "local.yaml"
    path.write_text("keep: me\n", encoding="utf-8")
    result = _run_doctor("--write-accelerate-config", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert str(path) in result.stderr and "--force" in result.stderr
    assert path.read_text(encoding="utf-8") == "keep: me\n"


def test_write_accelerate_config_rejects_a_directory_and_lone_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert env.main(["--write-accelerate-config", str(tmp_path), "--force"]) == 1
    assert str(tmp_path) in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        env.main(["--force"])
    assert exit_info.value.code == 2
    assert "--write-accelerate-config" in capsys.readouterr().err


# Backend names that only the device module and the doctor may spell (STYLE.md rule 6).
_BACKEND_STRINGS = {"cuda", "musa", "nccl", "mccl"}
_BACKEND_MODULES = {"cuda", "musa"}


def _backend_references(source: str) -> list[str]:
    """Find code (not comments or prose) that names a backend.

    Parsing instead of grepping keeps a docstring that says "no torch.cuda here" from tripping
    the guard, while still catching ``torch.cuda.x``, ``x.cuda()``, ``"cuda"``, ``'nccl'`` and
    ``f"cuda:{i}"``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if (
            isinstance(node, ast.Attribute)
            and node.attr in _BACKEND_MODULES
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            found.append(f"line {line}: torch.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _BACKEND_MODULES
        ):
            found.append(f"line {line}: .{node.func.attr}()")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value.strip().lower()
            if value in _BACKEND_STRINGS or (
                ":" in value and value.split(":")[0] in _BACKEND_MODULES
            ):
                found.append(f"line {line}: {node.value!r}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [alias.name for alias in node.names]
            if isinstance(node, ast.ImportFrom) and node.module:
                modules.append(node.module)
            found.extend(f"line {line}: import {m}" for m in modules if m.startswith("torch_musa"))
    return found


def test_backend_guard_catches_examples() -> None:
    bad = 'import torch\nx = torch.cuda.is_available()\ny = t.cuda()\nd = "nccl"\nz = f"musa:{i}"\n'
    assert len(_backend_references(bad)) == 4
    assert _backend_references('"""Never call torch.cuda.x or .cuda() here."""\n# "cuda"\n') == []


_MAY_NAME_BACKENDS = {ROOT / "recipes" / name for name in ("device.py", "backends.py", "env.py")}


def test_no_backend_names_outside_device_module() -> None:
    candidates = [ROOT / "train.py", *sorted((ROOT / "recipes").rglob("*.py"))]
    offenders = {}
    for path in candidates:
        if not path.is_file() or path in _MAY_NAME_BACKENDS:
            continue
        hits = _backend_references(path.read_text(encoding="utf-8"))
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, f"backend names belong in recipes/device.py (or the doctor): {offenders}"


def test_scripts_choose_devices_through_the_device_module() -> None:
    # CUDA and NCCL in code (not prose): a script's device choice goes through recipes.device,
    # or the comparison it runs cannot run on a MUSA card (scripts/llm_peers.py's --device was
    # auto|cpu|cuda). The emulator's own scripts may name "musa", the device they emulate.
    offenders = {}
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        hits = [
            hit
            for hit in _backend_references(path.read_text(encoding="utf-8"))
            if "cuda" in hit.lower() or "nccl" in hit.lower()
        ]
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, f"choose devices through recipes.device: {offenders}"


@pytest.mark.parametrize(
    ("environ", "installed", "derived"),
    [
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, "musa", "2,3"),
        ({"CUDA_VISIBLE_DEVICES": "2", "MUSA_VISIBLE_DEVICES": "0"}, "musa", None),  # theirs
        ({"CUDA_VISIBLE_DEVICES": ""}, "musa", ""),  # hides every card, as it would on CUDA
        ({}, "musa", None),
        ({"CUDA_VISIBLE_DEVICES": "1"}, "cuda", None),  # CUDA reads its own
    ],
)
def test_visible_devices_derived_on_musa_only(
    environ: dict[str, str], installed: str, derived: str | None
) -> None:
    assert device.derived_visible_devices(environ, installed) == derived
    before = environ.get("MUSA_VISIBLE_DEVICES")
    lines = device.prepare_environment(False, environ, installed)
    assert environ.get("MUSA_VISIBLE_DEVICES") == (before if derived is None else derived)
    assert any("taken from CUDA_VISIBLE_DEVICES" in line for line in lines) is (derived is not None)


@pytest.mark.parametrize(
    ("installed", "environ", "training", "expected"),
    [
        ("musa", {}, True, ("PYTORCH_MUSA_ALLOC_CONF", "expandable_segments:True", "default")),
        ("cuda", {}, True, ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", "default")),
        ("musa", {"PYTORCH_MUSA_ALLOC_CONF": "max_split_size_mb:128"}, True,
         ("PYTORCH_MUSA_ALLOC_CONF", "max_split_size_mb:128", "set by the user")),
        # torch's generic name counts as the user's choice: nothing added beside it.
        ("cuda", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, True,
         ("PYTORCH_ALLOC_CONF", "expandable_segments:False", "set by the user")),
        ("musa", {}, False, None),  # eval / predict: left alone
        ("cpu", {}, True, None),
    ],
)  # fmt: skip
def test_allocator_default_for_training_runs(
    installed: str, environ: dict[str, str], training: bool, expected: tuple | None
) -> None:
    given = dict(environ)
    lines = device.prepare_environment(training, environ, installed)
    if expected is None:
        assert lines == [] and environ == given
        return
    variable, value, why = expected
    assert environ[variable] == value
    assert set(environ) - set(given) <= {variable}  # only the backend's own variable is added
    [line] = lines
    assert line.startswith(f"{variable}={value} (") and why in line


@pytest.mark.slow
@on_cpu
def test_cpu_yaml_header_command_starts_two_gloo_processes(tmp_path: Path) -> None:
    # Runs the command the cpu.yaml header documents, so the documented recipe cannot rot.
    # Each rank writes its own file: two processes printing at once interleave their lines.
    script = tmp_path / "probe.py"
    script.write_text(
        "from pathlib import Path\n"
        "from accelerate import Accelerator\n"
        "import torch.distributed as dist\n"
        "a = Accelerator()\n"
        "fields = [a.process_index, a.num_processes, a.distributed_type.value, dist.get_backend()]\n"
        "Path(f'rank{a.process_index}.txt').write_text(' '.join(map(str, fields)))\n",
        encoding="utf-8",
    )
    result = run_cpu_launch(script, cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    probes = sorted(path.read_text().split() for path in tmp_path.glob("rank*.txt"))
    assert probes == [["0", "2", "MULTI_CPU", "gloo"], ["1", "2", "MULTI_CPU", "gloo"]]


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (
            "registry.mthreads.com/mcconline/musa-pytorch-release-public:rc3.1.0-v1.3.0-S4000-py310",
            "S4000",
        ),
        (
            "registry.mthreads.com/mcconline/musa-pytorch-release-public:rc4.2.0-v2.1.0-S80-py310",
            "S80",
        ),
        (
            "registry.mthreads.com/mcconline/musa-pytorch-release-public:rc3.1.0-v1.3.0-S3000-py38",
            "S3000",
        ),
        (
            "registry.mthreads.com/mcconline/musa-pytorch-release-public:rc5.1.0-v2.9.1-S5000-py310_tef",
            "S5000",
        ),
        ("registry.mthreads.com/mcconline/musa-pytorch-release-public:latest", None),
        ("python:3.11-slim", None),
        (None, None),
    ],
)
def test_image_gpu_from_the_vendor_tag(image: str | None, expected: str | None) -> None:
    assert backends.image_gpu(image) == expected


def test_advice_names_the_image_build_and_a_mismatch() -> None:
    image = "registry.mthreads.com/mcconline/musa-pytorch-release-public:rc4.2.0-v2.1.0-S80-py310"
    s80 = _musa_report("MTT S80", 1, mccl=False, bf16=False)
    s80.update(image=image, image_gpu="S80")
    advice = "\n".join(env.advice(s80))
    assert image in advice and "--build-arg BASE_IMAGE=" not in advice
    s4000 = _musa_report("MTT S4000", 1, mccl=True, bf16=True)
    s4000.update(image=image, image_gpu="S80")
    assert "--build-arg BASE_IMAGE=" in "\n".join(env.advice(s4000))

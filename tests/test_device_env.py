"""Device module, environment report and accelerate launch configs.

The CPU expectations are skipped on a machine with an accelerator; the table lookups, the
configs and the backend-name guard run everywhere.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from conftest import run_cpu_launch

from recipes import device, env

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = sorted((ROOT / "conf" / "accelerate").glob("*.yaml"))

on_cpu = pytest.mark.skipif(device.backend() != device.CPU, reason="expectations for CPU machines")


@on_cpu
def test_cpu_backend_defaults() -> None:
    assert device.backend() == "cpu"
    assert device.device_module() is None
    assert device.device_count() == 0
    assert device.device_names() == []
    assert device.default_mixed_precision() == "no"
    assert device.default_attn_implementation() == "sdpa"
    assert device.distributed_backend() == "gloo"
    assert device.accelerate_distributed_type(1) == "NO"
    assert device.accelerate_distributed_type(2) == "MULTI_CPU"


@on_cpu
def test_cpu_device_helpers_are_harmless() -> None:
    cpu = torch.device("cpu")
    assert device.peak_flops(cpu, "bf16") is None
    assert device.max_memory_allocated(cpu) is None
    device.synchronize(cpu)
    device.reset_peak_memory_stats(cpu)
    device.enable_tf32()


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
    ],
)
def test_lookup_peak_known(name: str, dtype: str, expected: float) -> None:
    assert device._lookup_peak(name, dtype) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("Some Future Accelerator", "bf16"),
        ("NVIDIA A10G", "bf16"),  # not the A10, and not in the table
        ("NVIDIA GeForce RTX 4090 D", "bf16"),
        ("Tesla V100-SXM2-32GB", "bf16"),  # no native bf16: not guessed
        ("MTT S80", "fp16"),  # figure not published in MUSA.md
        ("MTT S5000", "bf16"),
    ],
)
def test_lookup_peak_unknown_is_none(name: str, dtype: str) -> None:
    assert device._lookup_peak(name, dtype) is None


def test_lookup_peak_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        device._lookup_peak("MTT S4000", "int4")


def test_env_json_subprocess() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "recipes.env", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(result.stdout)
    assert report["backend"] == device.backend()
    versions = report["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["accelerate"] and versions["transformers"]
    assert report["default_mixed_precision"] == device.default_mixed_precision()
    assert report["distributed_backend"] == device.distributed_backend()
    assert set(report["visible_devices_env"]) == set(device.VISIBLE_DEVICES_ENV_VARS)
    if device.backend() == device.CPU:
        assert report["device_count"] == 0
        assert any("CPU" in line for line in report["advice"])


def test_env_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert env.main([]) == 0
    out = capsys.readouterr().out
    assert "backend" in out and device.backend() in out
    assert "Advice" in out


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
    assert config.num_machines == (2 if "2nodes" in path.name else 1)
    if config.num_machines > 1:  # processes of all machines, the same number on each
        assert config.num_processes == 8 * config.num_machines
        assert config.distributed_type.value == "MULTI_MUSA"


def test_reference_multi_musa_config() -> None:
    config = load_config_from_file(str(ROOT / "conf/accelerate/multi_musa.yaml"))
    assert config.distributed_type.value == "MULTI_MUSA"
    assert config.num_processes == 8
    assert config.gpu_ids == "0,1,2,3,4,5,6,7"
    assert config.mixed_precision == "no"
    assert config.rdzv_backend == "static"
    assert config.same_network is True
    assert config.use_cpu is False


# Backend names that only recipes/device.py may spell (STYLE.md rule 6).
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


def test_no_backend_names_outside_device_module() -> None:
    candidates = [ROOT / "train.py", *sorted((ROOT / "recipes").rglob("*.py"))]
    offenders = {}
    for path in candidates:
        if not path.is_file() or path == ROOT / "recipes" / "device.py":
            continue
        hits = _backend_references(path.read_text(encoding="utf-8"))
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, f"backend names belong in recipes/device.py only: {offenders}"


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

"""Environment doctor: what this machine offers the recipes, and what to fix when it is off.

Run before a first training run, and attach the output to bug reports::

    python -m recipes.env                      # aligned text report with advice
    python -m recipes.env --json               # the same facts, machine-readable
    python -m recipes.env --write-accelerate-config conf/accelerate/local.yaml [--force]

(``python scripts/env_check.py`` is the same command.) Backend-specific questions are answered
by :mod:`recipes.device`; this module only gathers and presents them, so its advice can be
checked on any machine by feeding :func:`advice` a report dict.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from recipes import device

_GIB = 1024**3
_MIN_TORCH = (2, 2)
_MUSA_IMAGE = "registry.mthreads.com/mcconline/musa-pytorch-release-public:<tag>"
_TORCH_MUSA_RELEASES = "https://github.com/MooreThreads/torch_musa/releases"
_CPU_LAUNCH = (
    "ACCELERATE_USE_CPU=1 accelerate launch --config_file conf/accelerate/cpu.yaml --multi_gpu "
    "train.py recipe=<name>"
)


def _dist_version(name: str) -> str | None:
    # Metadata, not import: importing transformers is slow, and importing torchada would patch
    # torch.cuda as a side effect of a read-only report.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _devices() -> list[dict[str, Any]]:
    devices = []
    for index, name in enumerate(device.device_names()):
        capability = device.device_capability(index)
        memory = device.device_total_memory(index)
        devices.append(
            {
                "index": index,
                "name": name,
                "capability": None if capability is None else f"{capability[0]}.{capability[1]}",
                "total_memory_bytes": memory,
                "bf16": device.device_supports_bf16(index),
                "tf32": device.device_supports_tf32(index),
                "peak_flops": {
                    dtype: device.peak_flops_by_name(name, dtype)
                    for dtype in ("fp32", "tf32", "fp16", "bf16", "fp8")
                },
            }
        )
    return devices


def _precision(backend: str) -> dict[str, Any]:
    """bf16 and TF32 as they apply to this machine's backend.

    On CPU, bf16 means autocast (tried for real) and TF32 does not apply (``applicable`` False,
    ``supported`` None); on an accelerator both are native hardware support.
    """
    if backend == device.CPU:
        bf16 = {
            "supported": device.cpu_bf16_autocast(),
            "mode": "autocast on CPU",
            "cpu_instructions": device.cpu_bf16_native(),
        }
        tf32 = {"applicable": False, "supported": None}
    else:
        bf16 = {"supported": device.supports_bf16(), "mode": "native", "cpu_instructions": None}
        tf32 = {"applicable": True, "supported": device.supports_tf32()}
    return {"bf16": bf16, "tf32": tf32, "default_mixed_precision": device.default_mixed_precision()}


def _launch_plan(report: dict[str, Any]) -> tuple[int, str]:
    """Processes and accelerate ``distributed_type`` for a local launch on this machine.

    Without a collective backend (S80/S3000: no MCCL) a multi-process launch would fail at
    init, so such a machine maps to one process whatever its device count.
    """
    count = report["device_count"]
    processes = count if report["distributed_backend"] is not None else min(count, 1)
    processes = max(processes, 1)
    return processes, device.accelerate_distributed_type(processes, report["backend"])


def collect() -> dict[str, Any]:
    """Gather the environment facts.

    Returns:
        A JSON-serialisable dict: backend, devices (name, capability, memory, bf16, TF32, peak
        FLOP/s), versions (with torch's GPU build and the torch the installed torch_musa
        expects), precision (bf16 / TF32 for this backend, the default mixed precision),
        attention default, distributed backend and MCCL, the accelerate launch this machine
        maps to, vendor tools on PATH, vendor kernel drivers, visible-devices variables, and
        advice.
    """
    musa = device.torch_musa_info()
    torch_musa_version = musa["version"] or _dist_version("torch_musa")
    musa["expected_torch"] = (
        None if torch_musa_version is None else device.torch_for_torch_musa(torch_musa_version)
    )
    backend = device.backend()
    precision = _precision(backend)
    report: dict[str, Any] = {
        "backend": backend,
        "device_count": device.device_count(),
        "devices": _devices(),
        "cpu": {
            "name": platform.processor() or platform.machine(),
            "logical_cores": os.cpu_count(),
        },
        "python_executable": sys.executable,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_gpu_build": device.torch_accelerator_build(),
            "torch_musa": torch_musa_version,
            "accelerate": _dist_version("accelerate"),
            "transformers": _dist_version("transformers"),
            "torchada": _dist_version("torchada"),
        },
        "torch_musa": musa,
        "accelerate_sees_musa": device.accelerate_sees_musa(),
        "precision": precision,
        "default_mixed_precision": precision["default_mixed_precision"],
        "default_attn_implementation": device.default_attn_implementation(),
        "distributed_backend": device.distributed_backend(),
        "distributed_backend_reason": device.distributed_backend_reason(),
        "mccl_available": device.mccl_available(),
        "vendor_tools": {name: shutil.which(tool) for name, tool in device.VENDOR_TOOLS.items()},
        "kernel_modules": device.kernel_modules_loaded(),
        "visible_devices_env": {
            var: os.environ.get(var) for var in device.VISIBLE_DEVICES_ENV_VARS
        },
    }
    report["launch_num_processes"], report["accelerate_distributed_type"] = _launch_plan(report)
    report["advice"] = advice(report)
    return report


# --- advice: one small function per situation, each returning the sentences that apply ---


def _advice_visible_devices(report: dict[str, Any]) -> list[str]:
    if report["backend"] != device.CPU:
        return []
    lines = []
    for var, value in report["visible_devices_env"].items():
        if value is None or value.strip().lower() not in device.HIDE_ALL_DEVICES_VALUES:
            continue
        fix = (
            f"set {var}=all (or unset it)"
            if var in device.CONTAINER_VISIBLE_DEVICES_ENV_VARS
            else "unset it, or list the device indices to use (e.g. 0 or 0,1)"
        )
        lines.append(f"{var}={value!r} hides every device from this process: {fix}.")
    return lines


def _musa_signals(report: dict[str, Any]) -> list[str]:
    """What says this is a MUSA host, even though torch may see no MUSA device."""
    signals = []
    if report["vendor_tools"].get(device.MUSA):
        signals.append(f"{device.VENDOR_TOOLS[device.MUSA]} is on PATH")
    if report["kernel_modules"].get(device.MUSA):
        signals.append(f"the {device.KERNEL_MODULES[device.MUSA]} kernel driver is loaded")
    if report["visible_devices_env"].get("MTHREADS_VISIBLE_DEVICES") is not None:
        signals.append("MTHREADS_VISIBLE_DEVICES is set")
    return signals


def _install_torch_musa(torch_version: str) -> str:
    """The clause saying which torch_musa wheel fits ``torch_version``."""
    releases = device.torch_musa_releases_for_torch(torch_version)
    if releases:
        return (
            f"install torch_musa {' or '.join(releases)} (the releases built for this torch "
            f"{torch_version}) from {_TORCH_MUSA_RELEASES}"
        )
    # 2.0.0 also has builds, but the project needs torch >= 2.2.
    return (
        f"pair a torch that has torch_musa builds (2.2.0, 2.5.0 or 2.7.1; this torch "
        f"{torch_version} has none) with its torch_musa from {_TORCH_MUSA_RELEASES}"
    )


def _advice_musa_unseen(report: dict[str, Any]) -> list[str]:
    """No MUSA device although this looks like (or is set up as) a MUSA host."""
    if report["backend"] != device.CPU:
        return []
    musa = report["torch_musa"]
    signals = _musa_signals(report)
    toolkit = (
        "In Docker the host needs the MUSA driver and mt-container-toolkit bound to Docker, and "
        "the container must run with --runtime=mthreads --env MTHREADS_VISIBLE_DEVICES=all."
    )
    if musa["error"]:
        return [
            f"torch_musa is installed but failed to import ({musa['error']}). accelerate imports "
            "it too, so training cannot start until this is fixed. A missing libsrv_um_MUSA.so "
            f"means the container runtime is not bound. {toolkit} An 'undefined symbol' error "
            "means torch and torch_musa do not match (see the torch_musa version advice)."
        ]
    if musa["installed"]:
        where = f" ({'; '.join(signals)})" if signals else ""
        tool = device.VENDOR_TOOLS[device.MUSA]
        return [
            f"torch_musa {report['versions']['torch_musa'] or ''} is installed but sees no MUSA "
            f"device{where}. On the host, check the driver: {tool} should list the cards and "
            f"`lsmod | grep {device.KERNEL_MODULES[device.MUSA]}` show the driver. {toolkit}"
        ]
    if signals:
        torch_version = report["versions"]["torch"]
        return [
            f"This looks like a MUSA host ({'; '.join(signals)}), but torch_musa is not "
            f"installed in this Python "
            f"({report['python_executable']}), so torch cannot see MUSA GPUs. torch_musa is not "
            f"on PyPI: work in a MUSA image ({_MUSA_IMAGE}), or "
            f"{_install_torch_musa(torch_version)}. {toolkit}"
        ]
    return []


def _advice_torch_musa_version(report: dict[str, Any]) -> list[str]:
    version = report["versions"]["torch_musa"]
    if not version:
        return []
    torch_version = report["versions"]["torch"]
    expected = report["torch_musa"].get("expected_torch")
    if expected is None:
        return [
            f"torch_musa {version} is not in the known compatibility table (recipes/device.py): check its "
            f"release notes for the torch it needs (this Python has torch {torch_version})."
        ]
    if _version_tuple(expected) == _version_tuple(torch_version):
        return []
    return [
        f"torch_musa {version} is built against torch {expected}, but this Python has torch "
        f"{torch_version}: a mismatched pair fails at import (undefined symbols) or at run time. "
        f"Install the torch {expected} wheel published with that torch_musa release "
        f"({_TORCH_MUSA_RELEASES}) or use the MUSA image that ships the pair, and keep pip from "
        f"replacing it (pip install --no-deps, or a constraints file with torch=={expected})."
    ]


def _advice_cuda(report: dict[str, Any]) -> list[str]:
    backend = report["backend"]
    if backend == device.CUDA:
        return [
            "NVIDIA GPU(s) through CUDA: the recipes run unchanged through accelerate (MULTI_GPU "
            "with NCCL for several GPUs); the MUSA-only settings (MCCL, "
            f"{device.MUSA_SDPA_ENV_VAR}) do not apply."
        ]
    tool = device.VENDOR_TOOLS[device.CUDA]
    signals = []
    if report["vendor_tools"].get(device.CUDA):
        signals.append(f"{tool} is on PATH")
    if report["kernel_modules"].get(device.CUDA):
        signals.append(f"the {device.KERNEL_MODULES[device.CUDA]} kernel driver is loaded")
    if backend != device.CPU or not signals:
        return []
    seen = f"This looks like an NVIDIA host ({'; '.join(signals)})"
    torch_version = report["versions"]["torch"]
    if report["versions"].get("torch_gpu_build") is None:
        return [
            f"{seen}, but this torch ({torch_version}) is a CPU-only build: install the CUDA "
            f"build of the same version, pip install torch=={torch_version.split('+')[0]} "
            "--index-url https://download.pytorch.org/whl/cu<XY> (a CUDA version the driver "
            f"supports, see {tool})."
        ]
    return [
        f"{seen} and torch is a {report['versions']['torch_gpu_build']} build, but torch sees no "
        f"GPU: run {tool} to check the driver sees them; in Docker add --gpus all (NVIDIA "
        "Container Toolkit); check that CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES do not "
        "hide them."
    ]


def _advice_launch(report: dict[str, Any]) -> list[str]:
    backend = report["backend"]
    count = report["device_count"]
    if backend == device.CPU:
        return [
            "No accelerator: the recipes run on the CPU. `python train.py recipe=<name> "
            "debug=smoke` trains one process in fp32 (fine for smoke runs with tiny models). Two "
            f"gloo processes on this machine: {_CPU_LAUNCH} (both the variable and --multi_gpu "
            "are needed)."
        ]
    if backend == device.MUSA and not report["mccl_available"]:
        what = (
            f"the {count} MUSA devices cannot train together"
            if count > 1
            else "multi-GPU training is unsupported"
        )
        return [
            f"No MCCL in this torch_musa build (MTT S80/S3000 builds ship none): {what}. Run "
            "one process on one device (the config written by "
            "--write-accelerate-config is single-process, as is conf/accelerate/"
            "single_device.yaml) and pick the card with MUSA_VISIBLE_DEVICES=<index>; a "
            "multi-process launch would fail or hang at init."
        ]
    if report["distributed_backend"] is None:
        return [f"No multi-device training: {report['distributed_backend_reason']}."]
    processes, distributed_type = _launch_plan(report)
    if processes > 1:
        return [
            f"{count} devices with {report['distributed_backend'].upper()}: `python -m "
            "recipes.env --write-accelerate-config conf/accelerate/local.yaml` writes a "
            f"{distributed_type} config with {processes} processes; "
            "`python train.py` alone uses one device."
        ]
    return []


def _advice_precision(report: dict[str, Any]) -> list[str]:
    precision = report["precision"]
    bf16 = precision["bf16"]
    if report["backend"] == device.CPU:
        picked = report["default_mixed_precision"]
        if not bf16["supported"]:
            how = "bf16 autocast fails with this CPU and torch: fp32 is the only choice"
        elif picked == "bf16":
            how = (
                "this CPU has bf16 instructions (AVX512-BF16/AMX) and bf16 autocast works, so "
                "the matmuls run in bf16, which is faster; trainer.mixed_precision=no trains in "
                "fp32"
            )
        elif bf16["cpu_instructions"] is None:
            how = (
                "bf16 autocast works, but whether this CPU has bf16 instructions is unknown: "
                "time a few steps before choosing trainer.mixed_precision=bf16"
            )
        else:
            how = (
                "bf16 autocast works but this CPU has no bf16 instructions, so it is slower "
                "than fp32: keep fp32"
            )
        mode = (
            "bf16 autocast (accelerate mixed_precision 'bf16')"
            if picked == "bf16"
            else "fp32 (accelerate mixed_precision 'no')"
        )
        return [
            f"Precision on CPU: trainer.mixed_precision=auto (the default) trains in {mode}; "
            f"{how}. TF32 does not apply to CPUs (trainer.tf32 is ignored)."
        ]
    names = ", ".join(sorted({dev["name"] for dev in report["devices"]})) or "this device"
    tf32 = (
        "trainer.tf32=true (the default) lets the remaining fp32 matmuls use TF32"
        if precision["tf32"]["supported"]
        else "there are no TF32 units, so trainer.tf32 changes nothing"
    )
    if bf16["supported"]:
        return [
            f"Precision: {names} has native bf16; trainer.mixed_precision=auto (the default) "
            f"picks bf16 (accelerate mixed_precision: bf16); {tf32}."
        ]
    return [
        f"Precision: {names} has no native bf16 (MTT S80/S3000 and pre-Ampere NVIDIA are fp16 "
        "only): trainer.mixed_precision=auto picks fp16 with a grad scaler (accelerate "
        "mixed_precision: fp16); do not set bf16; trainer.mixed_precision=no trains in fp32; "
        f"{tf32}."
    ]


def _advice_other(report: dict[str, Any]) -> list[str]:
    lines = []
    if report["backend"] == device.MUSA and report["default_attn_implementation"] == "eager":
        lines.append(
            "Attention defaults to eager on MUSA (the fused SDPA kernel lacked a backward pass in "
            f"early torch_musa); set {device.MUSA_SDPA_ENV_VAR}=1 if yours has it."
        )
    unlisted = {
        dev["name"]
        for dev in report["devices"]
        if all(value is None for value in dev["peak_flops"].values())
    }
    lines.extend(
        f"{name} is not in the peak FLOP/s table: MFU will not be reported."
        for name in sorted(unlisted)
    )
    torch_version = report["versions"]["torch"]
    if _version_tuple(torch_version) < _MIN_TORCH:
        lines.append(f"torch {torch_version} is older than the supported 2.2.")
    return lines


def advice(report: dict[str, Any]) -> list[str]:
    """Turn the facts into the few sentences a user should act on, problems first.

    Args:
        report: The output of :func:`collect`, or a dict of the same shape describing another
            machine (how the tests check the advice for hardware this machine lacks).

    Returns:
        Sentences, each naming the setting, variable, file or command to use.
    """
    return [
        *_advice_visible_devices(report),
        *_advice_musa_unseen(report),
        *_advice_torch_musa_version(report),
        *_advice_cuda(report),
        *_advice_launch(report),
        *_advice_precision(report),
        *_advice_other(report),
    ]


def accelerate_config(report: dict[str, Any]) -> dict[str, Any]:
    """Build an accelerate launch config for the machine described by ``report``.

    Args:
        report: The output of :func:`collect` (or a dict of the same shape).

    Returns:
        The keys ``accelerate config`` writes for a single-machine launch; only keys known to
        accelerate 0.33 so the file loads on old MUSA images too.
    """
    num_processes, distributed_type = _launch_plan(report)
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed_type,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": report["default_mixed_precision"],
        "num_machines": 1,
        "num_processes": num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": report["backend"] == device.CPU,
    }
    if num_processes > 1:
        config["gpu_ids"] = "all"
    return config


def _config_note(report: dict[str, Any]) -> str:
    """The header line that says what the written launch does on this machine."""
    processes, _ = _launch_plan(report)
    count = report["device_count"]
    if report["backend"] == device.CPU:
        return (
            "One CPU process. Two gloo processes: conf/accelerate/cpu.yaml (its header has "
            "the command)."
        )
    if processes == 1 and count > 1:
        return (
            f"One process although {count} devices are visible: this machine has no "
            "collective backend for them (MUSA S80/S3000: no MCCL); pick the card with "
            "MUSA_VISIBLE_DEVICES=<index>."
        )
    if processes > 1:
        return f"{processes} processes, one per visible device (gpu_ids: all)."
    return "One process on the one visible device."


def write_accelerate_config(
    path: str | os.PathLike[str], report: dict[str, Any], *, force: bool = False
) -> Path:
    """Write :func:`accelerate_config` as YAML, headed by the command that uses it.

    Args:
        path: Destination file; parent folders are created.
        report: The output of :func:`collect`.
        force: Replace an existing file; without it an existing file is left untouched.

    Returns:
        The written path.

    Raises:
        FileExistsError: ``path`` exists and ``force`` is False.
        IsADirectoryError: ``path`` is a directory.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    names = ", ".join(dev["name"] for dev in report["devices"]) or report["cpu"]["name"] or "cpu"
    header = (
        f"# accelerate launch --config_file {path} train.py recipe=<name>\n"
        f"# Written by `python -m recipes.env` for this machine ({report['backend']}: {names}).\n"
        f"# {_config_note(report)}\n"
        "# mixed_precision is this machine's default; trainer.mixed_precision in the recipe\n"
        "# (auto unless set) is passed to Accelerator and wins over it.\n"
    )
    body = yaml.safe_dump(accelerate_config(report), sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Mode "x" refuses an existing file atomically, so a race cannot clobber one either.
    with path.open("w" if force else "x", encoding="utf-8") as handle:
        handle.write(header + body)
    return path


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _bf16_text(report: dict[str, Any]) -> str:
    bf16 = report["precision"]["bf16"]
    if report["backend"] != device.CPU:
        return "yes (native)" if bf16["supported"] else "no (fp16 only)"
    if not bf16["supported"]:
        return "no (bf16 autocast on CPU fails here)"
    instructions = {
        True: "CPU has bf16 instructions",
        False: "no CPU bf16 instructions: slower than fp32",
        None: "CPU bf16 instructions unknown",
    }[bf16["cpu_instructions"]]
    return f"yes, as autocast on CPU ({instructions})"


def _tf32_text(report: dict[str, Any]) -> str:
    tf32 = report["precision"]["tf32"]
    if not tf32["applicable"]:
        return "not applicable on CPU (a GPU tensor-core mode; CPU matmuls run in fp32)"
    return "yes (trainer.tf32=true uses it)" if tf32["supported"] else "no"


def _device_row(dev: dict[str, Any]) -> tuple[str, str]:
    memory = dev["total_memory_bytes"]
    peak_text = ", ".join(
        f"{dtype} {value / 1e12:g}" for dtype, value in dev["peak_flops"].items() if value
    )
    return (
        f"device {dev['index']}",
        f"{dev['name']}  capability {_fmt(dev['capability'])}  "
        f"{'-' if memory is None else f'{memory / _GIB:.1f} GiB'}  "
        f"bf16 {_fmt(dev['bf16'])}  tf32 {_fmt(dev['tf32'])}  "
        f"peak TFLOP/s: {peak_text or 'not in table'}",
    )


def _sections(report: dict[str, Any]) -> list[tuple[str, list[tuple[str, Any]]]]:
    musa = report["torch_musa"]
    cpu = report["cpu"]
    return [
        (
            "Accelerator",
            [
                ("backend", report["backend"]),
                ("devices", report["device_count"]),
                *(_device_row(dev) for dev in report["devices"]),
                ("cpu", f"{cpu['name']} ({cpu['logical_cores']} logical cores)"),
            ],
        ),
        ("Versions", list(report["versions"].items())),
        (
            "torch_musa",
            [
                ("installed", musa["installed"]),
                ("imported", musa["imported"]),
                ("import error", musa["error"]),
                ("built for torch", musa["expected_torch"]),
                ("accelerate sees MUSA", report["accelerate_sees_musa"]),
            ],
        ),
        (
            "Precision and attention",
            [
                ("bf16", _bf16_text(report)),
                ("tf32", _tf32_text(report)),
                ("default mixed_precision", report["default_mixed_precision"]),
                ("default attn_implementation", report["default_attn_implementation"]),
            ],
        ),
        (
            "Distributed",
            [
                ("backend (multi-process)", report["distributed_backend"]),
                ("why", report["distributed_backend_reason"]),
                ("MCCL available", report["mccl_available"]),
                ("accelerate distributed_type", report["accelerate_distributed_type"]),
                ("accelerate num_processes", report["launch_num_processes"]),
            ],
        ),
        (
            "Host",
            [
                ("python executable", report["python_executable"]),
                *(
                    (f"{tool} on PATH", report["vendor_tools"][name])
                    for name, tool in device.VENDOR_TOOLS.items()
                ),
                *(
                    (f"{module} driver loaded", report["kernel_modules"][name])
                    for name, module in device.KERNEL_MODULES.items()
                ),
                *report["visible_devices_env"].items(),
            ],
        ),
    ]


def format_report(report: dict[str, Any]) -> str:
    """Lay the report out as aligned ``key  value`` rows under section titles, then advice."""
    sections = _sections(report)
    width = max(len(key) for _, rows in sections for key, _ in rows)
    lines = ["Environment report (python -m recipes.env)"]
    for title, rows in sections:
        lines.append("")
        lines.append(title)
        lines.extend(f"  {key:<{width}}  {_fmt(value)}" for key, value in rows)
    lines.append("")
    lines.append("Advice")
    lines.extend(f"  - {text}" for text in report["advice"] or ["nothing to fix"])
    return "\n".join(lines) + "\n"


def _emit(text: str, *, stderr: bool = False) -> None:
    # The one place this CLI writes to the terminal; library code logs instead.
    stream = sys.stderr if stderr else sys.stdout
    stream.write(text)
    stream.flush()


def _refusal(path: Path, *, force: bool) -> str | None:
    """Why ``--write-accelerate-config`` will not write ``path``, or None when it will."""
    if path.is_dir():
        return f"cannot write accelerate config: {path} is a directory\n"
    if path.exists() and not force:
        return (
            f"refusing to overwrite existing file {path}: pass --force to replace it, "
            "or choose another PATH\n"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Print the environment report, and write an accelerate config when asked.

    Args:
        argv: Command-line arguments; defaults to ``sys.argv[1:]``.

    Returns:
        0 (the report is informational; problems are listed under Advice, not as a failure);
        1 when the accelerate config cannot be written (an existing file without ``--force``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m recipes.env",
        description="Report the accelerator, versions and defaults the recipes will use here, "
        "with advice on what to fix.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--write-accelerate-config",
        metavar="PATH",
        help="write an accelerate launch config YAML for this machine to PATH",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="let --write-accelerate-config replace an existing file",
    )
    args = parser.parse_args(argv)
    if args.force and not args.write_accelerate_config:
        parser.error("--force only applies to --write-accelerate-config")

    target = Path(args.write_accelerate_config) if args.write_accelerate_config else None
    # Refuse before the report, so that a refused run changes nothing and says only why.
    refusal = None if target is None else _refusal(target, force=args.force)
    if refusal is not None:
        _emit(refusal, stderr=True)
        return 1

    report = collect()
    _emit(json.dumps(report, indent=2) + "\n" if args.json else format_report(report))
    if target is not None:
        try:
            path = write_accelerate_config(target, report, force=args.force)
        except FileExistsError:  # created between the check and the write
            _emit(_refusal(target, force=False) or "", stderr=True)
            return 1
        # stderr under --json, so that stdout stays parseable JSON.
        _emit(f"wrote accelerate config: {path}\n", stderr=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Environment report: what this machine offers the recipes, and what to fix when it is off.

Run before a first training run, and attach the output to bug reports::

    python -m recipes.env                      # aligned text table
    python -m recipes.env --json               # the same facts, machine-readable
    python -m recipes.env --write-accelerate-config conf/accelerate/local.yaml

Backend-specific questions are answered by :mod:`recipes.device`; this module only gathers and
presents them.
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


def _dist_version(name: str) -> str | None:
    # Metadata, not import: importing transformers is slow, and importing torchada would patch
    # torch.cuda as a side effect of a read-only report.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_version_tuple() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
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
                "peak_flops": {
                    dtype: device.peak_flops_by_name(name, dtype)
                    for dtype in ("fp32", "tf32", "fp16", "bf16", "fp8")
                },
            }
        )
    return devices


def _advice(report: dict[str, Any]) -> list[str]:
    """Turn the facts into the few sentences a user should act on."""
    advice = []
    backend = report["backend"]
    musa = report["torch_musa"]
    tools = report["vendor_tools"]
    visible = report["visible_devices_env"]
    musa_host = bool(
        musa["installed"] or tools.get(device.MUSA) or visible["MTHREADS_VISIBLE_DEVICES"]
    )

    if musa["error"]:
        advice.append(
            f"torch_musa is installed but failed to import ({musa['error']}). accelerate imports "
            "it too, so training cannot start until this is fixed. Inside Docker this usually "
            "means the host's mt-container-toolkit is not bound (libsrv_um_MUSA.so missing)."
        )
    if backend == device.CPU and musa_host:
        advice.append(
            "No MUSA device seen on what looks like a MUSA host: check that the MUSA driver is "
            "loaded (mthreads-gmi), that the container runs with mt-container-toolkit and "
            "--env MTHREADS_VISIBLE_DEVICES=all, and that torch_musa is installed in this Python."
        )
    if backend == device.CPU and tools.get(device.CUDA):
        advice.append(
            "nvidia-smi is on PATH but torch sees no GPU: this torch may be a CPU-only build, or "
            "the container lacks --gpus all."
        )
    for var, value in visible.items():
        if (
            backend == device.CPU
            and value is not None
            and value.strip() in {"", "-1", "none", "void"}
        ):
            advice.append(f"{var}={value!r} hides every device; unset it to use the accelerator.")
    if backend == device.CPU:
        advice.append(
            "Running on CPU: fine for smoke runs with tiny models. For multi-process (gloo) "
            "runs: ACCELERATE_USE_CPU=1 accelerate launch --config_file "
            "conf/accelerate/cpu.yaml --multi_gpu train.py ..."
        )
    elif report["distributed_backend"] is None:
        advice.append(f"No multi-device training: {report['distributed_backend_reason']}.")
    if backend != device.CPU and not report["bf16_supported"]:
        advice.append(
            "No native bf16 on this device: mixed precision defaults to fp16 with a grad scaler."
        )
    if backend == device.MUSA and report["default_attn_implementation"] == "eager":
        advice.append(
            "Attention defaults to eager on MUSA (the fused SDPA kernel lacked a backward pass in "
            f"early torch_musa); set {device.MUSA_SDPA_ENV_VAR}=1 if yours has it."
        )
    unlisted = {
        dev["name"]
        for dev in report["devices"]
        if all(value is None for value in dev["peak_flops"].values())
    }
    advice.extend(
        f"{name} is not in the peak FLOP/s table: MFU will not be reported."
        for name in sorted(unlisted)
    )
    if _torch_version_tuple() < _MIN_TORCH:
        advice.append(f"torch {torch.__version__} is older than the supported 2.2.")
    return advice


def collect() -> dict[str, Any]:
    """Gather the environment facts.

    Returns:
        A JSON-serialisable dict: backend, devices (name, capability, memory, peak FLOP/s),
        versions, precision and attention defaults, distributed backend, vendor tools on PATH,
        visible-devices variables, the accelerate launch type this machine maps to, and advice.
    """
    count = device.device_count()
    dist_backend = device.distributed_backend()
    # Without a collective backend (S80/S3000: no MCCL) a multi-process launch would fail at
    # init, so the machine maps to a single-process launch whatever the device count.
    launch_processes = count if dist_backend is not None else min(count, 1)
    musa = device.torch_musa_info()
    report: dict[str, Any] = {
        "backend": device.backend(),
        "device_count": count,
        "devices": _devices(),
        "cpu": {
            "name": platform.processor() or platform.machine(),
            "logical_cores": os.cpu_count(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_musa": musa["version"] or _dist_version("torch_musa"),
            "accelerate": _dist_version("accelerate"),
            "transformers": _dist_version("transformers"),
            "torchada": _dist_version("torchada"),
        },
        "torch_musa": musa,
        "accelerate_sees_musa": device.accelerate_sees_musa(),
        "bf16_supported": device.supports_bf16(),
        "tf32_supported": device.supports_tf32(),
        "default_mixed_precision": device.default_mixed_precision(),
        "default_attn_implementation": device.default_attn_implementation(),
        "distributed_backend": dist_backend,
        "distributed_backend_reason": device.distributed_backend_reason(),
        "mccl_available": device.mccl_available(),
        "launch_num_processes": max(launch_processes, 1),
        "accelerate_distributed_type": device.accelerate_distributed_type(launch_processes),
        "vendor_tools": {
            backend: shutil.which(tool) for backend, tool in device.VENDOR_TOOLS.items()
        },
        "visible_devices_env": {
            var: os.environ.get(var) for var in device.VISIBLE_DEVICES_ENV_VARS
        },
    }
    report["advice"] = _advice(report)
    return report


def accelerate_config(report: dict[str, Any]) -> dict[str, Any]:
    """Build an accelerate launch config for the machine described by ``report``.

    Args:
        report: The output of :func:`collect`.

    Returns:
        The keys ``accelerate config`` writes for a single-machine launch; only keys known to
        accelerate 0.33 so the file loads on old MUSA images too.
    """
    num_processes = report["launch_num_processes"]
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": report["accelerate_distributed_type"],
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


def write_accelerate_config(path: str | os.PathLike[str], report: dict[str, Any]) -> Path:
    """Write :func:`accelerate_config` as YAML, headed by the command that uses it.

    Args:
        path: Destination file; parent folders are created.
        report: The output of :func:`collect`.

    Returns:
        The written path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = ", ".join(dev["name"] for dev in report["devices"]) or report["cpu"]["name"] or "cpu"
    header = (
        f"# accelerate launch --config_file {path} train.py recipe=<name>\n"
        f"# Written by `python -m recipes.env` for this machine ({report['backend']}: {names}).\n"
        "# mixed_precision is this machine's default; trainer.mixed_precision in the recipe,\n"
        "# when set, is passed to Accelerator and wins over it.\n"
    )
    body = yaml.safe_dump(accelerate_config(report), sort_keys=True)
    path.write_text(header + body, encoding="utf-8")
    return path


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _format_report(report: dict[str, Any]) -> str:
    """Lay the report out as aligned ``key  value`` rows under section titles."""
    musa = report["torch_musa"]
    sections: list[tuple[str, list[tuple[str, Any]]]] = [
        (
            "Accelerator",
            [
                ("backend", report["backend"]),
                ("devices", report["device_count"]),
                (
                    "cpu",
                    f"{report['cpu']['name']} ({report['cpu']['logical_cores']} logical cores)",
                ),
            ],
        ),
        ("Versions", list(report["versions"].items())),
        (
            "torch_musa",
            [
                ("installed", musa["installed"]),
                ("imported", musa["imported"]),
                ("import error", musa["error"]),
                ("accelerate sees MUSA", report["accelerate_sees_musa"]),
            ],
        ),
        (
            "Precision and attention",
            [
                ("bf16 supported", report["bf16_supported"]),
                ("tf32 supported", report["tf32_supported"]),
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
                (f"{tool} on PATH", report["vendor_tools"][b])
                for b, tool in device.VENDOR_TOOLS.items()
            ]
            + list(report["visible_devices_env"].items()),
        ),
    ]
    for dev in report["devices"]:
        memory = dev["total_memory_bytes"]
        peak = dev["peak_flops"]
        peak_text = ", ".join(
            f"{dtype} {value / 1e12:g}" for dtype, value in peak.items() if value is not None
        )
        sections[0][1].append(
            (
                f"device {dev['index']}",
                f"{dev['name']}  capability {_fmt(dev['capability'])}  "
                f"{'-' if memory is None else f'{memory / _GIB:.1f} GiB'}  "
                f"peak TFLOP/s: {peak_text or 'not in table'}",
            )
        )

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


def main(argv: Sequence[str] | None = None) -> int:
    """Print the environment report.

    Args:
        argv: Command-line arguments; defaults to ``sys.argv[1:]``.

    Returns:
        0 (the report is informational; problems are listed under Advice, not as a failure).
    """
    parser = argparse.ArgumentParser(
        prog="python -m recipes.env",
        description="Report the accelerator, versions and defaults the recipes will use here.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--write-accelerate-config",
        metavar="PATH",
        help="write an accelerate launch config YAML for this machine to PATH",
    )
    args = parser.parse_args(argv)

    report = collect()
    if args.json:
        _emit(json.dumps(report, indent=2) + "\n")
    else:
        _emit(_format_report(report))
    if args.write_accelerate_config:
        path = write_accelerate_config(args.write_accelerate_config, report)
        # stderr under --json, so that stdout stays parseable JSON.
        _emit(f"wrote accelerate config: {path}\n", stderr=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

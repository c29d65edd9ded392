"""Environment doctor: what this machine offers the recipes, and what to fix when it is off.

Run before a first training run, and attach the output to bug reports::

    python -m recipes.env                      # aligned text report with advice
    python -m recipes.env --json               # the same facts, machine-readable
    python -m recipes.env --write-accelerate-config conf/accelerate/local.yaml [--force]

(``python scripts/env_check.py`` is the same command.) Backend-specific questions are answered
by :mod:`recipes.device` (what training uses) and :mod:`recipes.backends` (drivers, tools,
release tables); this module only gathers and presents them, so its advice can be checked on
any machine by feeding :func:`advice` a report dict.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # torch_musa >= 2.0 built for torch 2.5 registers a ``torch.backends`` entry point, so from
    # torch 2.5 ``import torch`` loads it and a broken one raises before any advice is given. The
    # doctor imports torch without autoloading and loads torch_musa itself, catching the error.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch
import yaml
from packaging.version import Version

from recipes import backends, device, packages

_GIB = 1024**3
_MIN_TORCH = (2, 2)
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
        memory = backends.device_total_memory(index)
        devices.append(
            {
                "index": index,
                "name": name,
                "capability": None if capability is None else f"{capability[0]}.{capability[1]}",
                "total_memory_bytes": memory,
                "bf16": device.supports_bf16(index),
                "tf32": device.supports_tf32(index),
                "fp8": device.supports_fp8(index),
                "peak_flops": {
                    dtype: device.peak_flops_by_name(name, dtype)
                    for dtype in ("fp32", "tf32", "fp16", "bf16", "fp8")
                },
                # Where a dtype's peak is another column's figure (fp16 on MTT S80 / S3000).
                "peak_flops_basis": {
                    dtype: basis
                    for dtype in ("fp32", "tf32", "fp16", "bf16", "fp8")
                    if (basis := device.peak_flops_basis(name, dtype)) not in (None, dtype)
                },
                # What the vendor does not publish (the S5000's bf16 peak): no MFU, not a guess.
                "peak_flops_note": device.peak_flops_note(name),
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
    return processes, backends.accelerate_distributed_type(processes, report["backend"])


def sdpa_probe(where: str, dtypes: Sequence[torch.dtype]) -> dict[str, Any]:
    """One training step of attention through SDPA, checked against eager attention.

    Forward and backward of ``scaled_dot_product_attention`` with a padding mask, as BERT
    uses it, at head_dim 64 (MUSA's flash kernel for fp16/bf16 on arch >= 2.2; its math kernel
    otherwise): outputs and gradients must be finite and close to an fp32 eager reference, so a
    torch_musa build with a wrong kernel is caught here rather than as a diverging run.

    Returns:
        ``ok``, and per dtype the largest error relative to the reference's magnitude (or the
        exception that the step raised).
    """
    tolerance = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
    generator = torch.Generator().manual_seed(0)
    shape = (2, 4, 32, 64)  # batch, heads, positions, head_dim
    base = [torch.randn(shape, generator=generator) for _ in range(3)]
    keep = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    keep[1, ..., 24:] = False  # the second sequence is padded
    results: dict[str, Any] = {"device": where, "ok": True, "dtypes": {}}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        with _full_fp32(dtype == torch.float32):
            found: dict[str, Any] = {"tf32": device.tf32_enabled()}
            try:
                error = _sdpa_error(base, keep, where, dtype)
            except Exception as err:  # any failure of the kernels is the finding
                found.update(ok=False, error=f"{type(err).__name__}: {err}")
            else:
                found.update(ok=error <= tolerance.get(dtype, 5e-3), relative_error=error)
        results["dtypes"][name] = found
        results["ok"] = results["ok"] and found["ok"]
    return results


@contextlib.contextmanager
def _full_fp32(wanted: bool) -> Iterator[None]:
    """TF32 off for the fp32 check, restored afterwards: torch_musa 2.7 runs fp32 matmuls and
    SDPA in TF32 by default, whose error would exceed the fp32 tolerance on a sound kernel."""
    was = device.tf32_enabled()
    if wanted and was:
        device.set_tf32(False)
    try:
        yield
    finally:
        if wanted and was:
            device.set_tf32(True)


def _sdpa_error(
    base: list[torch.Tensor], keep: torch.Tensor, where: str, dtype: torch.dtype
) -> float:
    def step(fn: Any, cast: torch.dtype, on: str) -> list[torch.Tensor]:
        q, k, v = (t.to(on, cast).requires_grad_() for t in base)
        out = fn(q, k, v, keep.to(on))
        out.float().pow(2).sum().backward()
        return [t.detach().float().cpu() for t in (out, q.grad, k.grad, v.grad)]

    def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    # The reference sees the same rounded inputs, in fp32 on the CPU.
    base = [t.to(dtype).float() for t in base]
    got, want = step(sdpa, dtype, where), step(eager, torch.float32, device.CPU)
    if not all(torch.isfinite(t).all() for t in got):
        return math.inf
    return max(
        float((g - w).abs().max() / w.abs().max().clamp_min(1e-6))
        for g, w in zip(got, want, strict=True)
    )


def _probe_dtypes(backend: str) -> list[torch.dtype]:
    if backend == device.CPU:
        return [torch.float32]
    half = torch.bfloat16 if device.supports_bf16() else torch.float16
    return [half, torch.float32]


def _decisions(backend: str) -> dict[str, Any]:
    """What a run decides from this backend and its torch_musa release: the TF32 switches
    ``trainer.tf32`` sets, whether ``trainer.compile`` defaults on (for a model trained whole),
    the AdamW ``optimizer.fused=null`` builds, and on MUSA the FSDP2 overlap level."""
    musa_version = device.torch_musa_info()["version"] if backend == device.MUSA else None
    compiled = next(
        default
        for default in device.training_defaults(
            backend, generates=False, whole_model=True, musa_version=musa_version
        )
        if default.name == "compile"
    )
    found: dict[str, Any] = {
        "tf32_switches": list(device.tf32_switches(backend)),
        "tf32_on_now": device.tf32_enabled(),
        "compile": compiled.value,
        "compile_why": compiled.why,
        "adamw": device.default_adamw(backend),
    }
    if backend == device.MUSA:
        found["tf32_override"] = os.environ.get(device.MUBLAS_TF32_OVERRIDE)
        found["fsdp2_overlap_level"] = os.environ.get(device.FSDP2_OVERLAP_ENV)
        found["fsdp2_overlap_problem"] = device.fsdp2_overlap_unsupported_reason(backend)
    return found


def peft_torchao() -> dict[str, Any]:
    """The installed peft and torchao, and whether peft's LoRA layers accept that torchao
    (:func:`recipes.packages.installed_peft_torchao_conflict`; a LoRA run refuses to start
    otherwise)."""
    problem = packages.installed_peft_torchao_conflict()
    return {
        "peft": packages.installed_version("peft"),
        "torchao": packages.installed_version("torchao"),
        "agree": problem is None,
        "problem": problem,
    }


def allocator(backend: str) -> dict[str, Any] | None:
    """The caching allocator's variable on this backend, its value, whether the user set it,
    and what a training run sets where not (:func:`recipes.device.prepare_environment`); None on
    cpu. Also the visible devices a MUSA host derives from ``CUDA_VISIBLE_DEVICES``."""
    found = device.allocator_setting(backend)
    if found is None:
        return None
    variable, value, by_user = found
    return {
        "variable": variable,
        "value": value,
        "set_by_user": by_user,
        "training_runs": value if by_user else device.EXPANDABLE_SEGMENTS,
        "visible_devices_derived": device.derived_visible_devices(os.environ, backend),
    }


def _probe_device(backend: str) -> str:
    module = device.device_module(backend)
    return backend if module is None else f"{backend}:{module.current_device()}"


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
        None
        if torch_musa_version is None
        else list(backends.torch_for_torch_musa(torch_musa_version))
    )
    late = backends.late_musa_release(torch_musa_version)
    musa["release_changes"] = None if late is None else late.changes
    musa["vllm_musa"] = (
        None if not musa["installed"] else backends.vllm_musa_for_torch_musa(torch_musa_version)
    )
    backend = device.backend()
    precision = _precision(backend)
    distributed, distributed_reason = device.distributed_backend()
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
            "torch_gpu_build": backends.torch_accelerator_build(),
            "torch_musa": torch_musa_version,
            "accelerate": _dist_version("accelerate"),
            "transformers": _dist_version("transformers"),
            "torchada": _dist_version("torchada"),
            "peft": _dist_version("peft"),
            "torchao": _dist_version("torchao"),
        },
        "peft_torchao": peft_torchao(),
        "allocator": allocator(backend),
        "torch_musa": musa,
        "accelerate_sees_musa": backends.accelerate_sees_musa(),
        "precision": precision,
        "default_mixed_precision": precision["default_mixed_precision"],
        "default_attn_implementation": device.default_attn_implementation(
            precision["default_mixed_precision"]
        ),
        "flash_attention": device.musa_flash_attention().detail,
        "decisions": _decisions(backend),
        "sdpa_probe": sdpa_probe(_probe_device(backend), _probe_dtypes(backend)),
        "image": os.environ.get(backends.BASE_IMAGE_ENV_VAR),
        "image_gpu": backends.image_gpu(os.environ.get(backends.BASE_IMAGE_ENV_VAR)),
        "distributed_backend": distributed,
        "distributed_backend_reason": distributed_reason,
        "mccl_available": device.mccl_available(),
        "vendor_tools": {name: shutil.which(tool) for name, tool in backends.VENDOR_TOOLS.items()},
        "kernel_modules": backends.kernel_modules_loaded(),
        "visible_devices_env": backends.visible_devices_env(),
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
        if value is None or value.strip().lower() not in backends.HIDE_ALL_DEVICES_VALUES:
            continue
        fix = (
            f"set {var}=all (or unset it)"
            if var in backends.CONTAINER_VISIBLE_DEVICES_ENV_VARS
            else "unset it, or list the device indices to use (e.g. 0 or 0,1)"
        )
        lines.append(f"{var}={value!r} hides every device from this process: {fix}.")
    return lines


def _musa_signals(report: dict[str, Any]) -> list[str]:
    """What says this is a MUSA host, even though torch may see no MUSA device."""
    signals = []
    if report["vendor_tools"].get(device.MUSA):
        signals.append(f"{backends.VENDOR_TOOLS[device.MUSA]} is on PATH")
    if report["kernel_modules"].get(device.MUSA):
        signals.append(f"the {backends.KERNEL_MODULES[device.MUSA]} kernel driver is loaded")
    if report["visible_devices_env"].get("MTHREADS_VISIBLE_DEVICES") is not None:
        signals.append("MTHREADS_VISIBLE_DEVICES is set")
    return signals


def _install_torch_musa(torch_version: str) -> str:
    """The clause saying which torch_musa wheel fits ``torch_version``."""
    releases = backends.torch_musa_releases_for_torch(torch_version)
    if releases:
        return (
            f"install torch_musa {' or '.join(releases)} (the releases built for this torch "
            f"{torch_version}) from {backends.TORCH_MUSA_RELEASES_URL}"
        )
    # 2.0.0 also has builds, but the project needs torch >= 2.2.
    built = ", ".join(v for v in backends.torches_with_torch_musa() if Version(v) >= Version("2.2"))
    return (
        f"pair a torch that has torch_musa builds ({built}; this torch "
        f"{torch_version} has none) with its torch_musa from {backends.TORCH_MUSA_RELEASES_URL}"
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
        tool = backends.VENDOR_TOOLS[device.MUSA]
        return [
            f"torch_musa {report['versions']['torch_musa'] or ''} is installed but sees no MUSA "
            f"device{where}. On the host, check the driver: {tool} should list the cards and "
            f"`lsmod | grep {backends.KERNEL_MODULES[device.MUSA]}` show the driver. {toolkit}"
        ]
    if signals:
        torch_version = report["versions"]["torch"]
        return [
            f"This looks like a MUSA host ({'; '.join(signals)}), but torch_musa is not "
            f"installed in this Python "
            f"({report['python_executable']}), so torch cannot see MUSA GPUs. torch_musa is not "
            f"on PyPI: work in a MUSA image ({backends.MUSA_IMAGE}), or "
            f"{_install_torch_musa(torch_version)}. {toolkit}"
        ]
    return []


def _advice_torch_musa_version(report: dict[str, Any]) -> list[str]:
    """torch and torch_musa as torch_musa itself checks them when it is imported: it refuses a
    torch below its ``TORCH_MIN_VERSION`` and warns unless the torch is the one it was built
    against."""
    version = report["versions"]["torch_musa"]
    if not version:
        return []
    torch_version = report["versions"]["torch"]
    expected = report["torch_musa"].get("expected_torch") or []
    if not expected:
        return [
            f"torch_musa {version} is not in the known compatibility table (recipes/backends.py): check "
            f"its release notes for the torch it needs (this Python has torch {torch_version})."
        ]
    if any(built in torch_version for built in expected):
        return []
    wanted = " or ".join(expected)
    minimum = backends.torch_musa_minimum_torch(version)
    if minimum and backends.torch_base_version(torch_version) < Version(minimum):
        problem = f"refuses to import with torch {torch_version} (it needs torch >= {minimum})"
    else:
        problem = (
            f"is built against torch {wanted}, but this Python has torch {torch_version}: "
            "torch_musa warns, and a mismatched pair fails at import (undefined symbols) or at "
            "run time"
        )
    return [
        f"torch_musa {version} {problem}. Install the torch {wanted} wheel published with that "
        f"torch_musa release ({backends.TORCH_MUSA_RELEASES_URL}) or use the MUSA image that "
        "ships the pair, and keep pip from replacing it (pip install --no-deps, or a "
        f"constraints file with torch=={expected[0]})."
    ]


def _advice_cuda(report: dict[str, Any]) -> list[str]:
    backend = report["backend"]
    if backend == device.CUDA:
        return [
            "NVIDIA GPU(s) through CUDA: the recipes run unchanged through accelerate (MULTI_GPU "
            "with NCCL for several GPUs); the MUSA-only settings (MCCL, "
            "TORCH_MUSA_FSDP2_OVERLAP_LEVEL) do not apply."
        ]
    tool = backends.VENDOR_TOOLS[device.CUDA]
    signals = []
    if report["vendor_tools"].get(device.CUDA):
        signals.append(f"{tool} is on PATH")
    if report["kernel_modules"].get(device.CUDA):
        signals.append(f"the {backends.KERNEL_MODULES[device.CUDA]} kernel driver is loaded")
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
            "`python train.py` alone uses one device. A model too large for one device: "
            f"{_fsdp_config(report)}."
        ]
    return []


def _fsdp_config(report: dict[str, Any]) -> str:
    """FSDP2 where accelerate (>= 1.6, ``fsdp_version: 2``) and torch (>= 2.6) have it."""
    accelerate = _version_tuple(report["versions"].get("accelerate") or "0.0")
    if _version_tuple(report["versions"]["torch"]) >= (2, 6) and accelerate >= (1, 6):
        return "conf/accelerate/fsdp2.yaml (FSDP2)"
    return (
        "conf/accelerate/fsdp.yaml (FSDP1; FSDP2, conf/accelerate/fsdp2.yaml, needs torch >= 2.6 "
        "and accelerate >= 1.6)"
    )


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


def _advice_attention(report: dict[str, Any]) -> list[str]:
    probe = report.get("sdpa_probe") or {}
    if probe and not probe["ok"]:
        failed = ", ".join(
            f"{dtype}: {found.get('error') or 'error {:.2g}'.format(found['relative_error'])}"
            for dtype, found in probe["dtypes"].items()
            if not found["ok"]
        )
        return [
            f"SDPA attention failed its check on {probe['device']} ({failed}): train with "
            "model.attn_implementation=eager, and install a torch_musa / torch build whose "
            "attention kernels pass (python -m recipes.env repeats the check)."
        ]
    if report["backend"] == device.MUSA and report["default_attn_implementation"] == "eager":
        return [
            f"Attention defaults to eager: torch_musa {report['versions']['torch_musa'] or ''} "
            "predates SDPA with a backward pass (v1.2.1)."
        ]
    return []


def _advice_image(report: dict[str, Any]) -> list[str]:
    built_for = report.get("image_gpu")
    if built_for is None:
        return []
    names = {dev["name"] for dev in report["devices"]}
    if report["backend"] != device.MUSA or any(built_for in name.upper() for name in names):
        return [f"This container's base image is the {built_for} build ({report['image']})."]
    return [
        f"This container's base image is the {built_for} build ({report['image']}), but the "
        f"devices are {', '.join(sorted(names))}: rebuild with --build-arg BASE_IMAGE=<the tag "
        "for your GPU> (README.md, Docker)."
    ]


def _advice_grad_scaler(report: dict[str, Any]) -> list[str]:
    version = report["versions"].get("accelerate")
    if report["backend"] != device.MUSA or not version or _version_tuple(version) >= (1, 0):
        return []
    # accelerate 0.33-0.34 assign the MUSA scaler to ``self.scalar`` (fixed by PR #3116).
    return [
        f"accelerate {version} creates no fp16 grad scaler on MUSA (fixed in 1.0), so fp16 runs "
        "are refused: pip install 'accelerate>=1.0', or train in bf16 / fp32 "
        "(trainer.mixed_precision=bf16 on S4000, no elsewhere)."
    ]


def _advice_other(report: dict[str, Any]) -> list[str]:
    lines = []
    unlisted = {
        dev["name"]
        for dev in report["devices"]
        if all(value is None for value in dev["peak_flops"].values())
    }
    lines.extend(
        f"{name} is not in the peak FLOP/s table: MFU will not be reported."
        for name in sorted(unlisted)
    )
    precision = report.get("default_mixed_precision")
    lines.extend(
        f"{dev['name']}: no published {precision} peak ({dev['peak_flops_note']}); runs in "
        f"{precision} log TFLOP/s but no MFU."
        for dev in _distinct_devices(report)
        if dev.get("peak_flops_note") and not dev["peak_flops"].get(precision or "")
    )
    torch_version = report["versions"]["torch"]
    if _version_tuple(torch_version) < _MIN_TORCH:
        lines.append(f"torch {torch_version} is older than the supported 2.2.")
    return lines


def _distinct_devices(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One device entry per device name (eight S5000s give one line of advice, not eight)."""
    return list({dev["name"]: dev for dev in report["devices"]}.values())


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
        *_advice_grad_scaler(report),
        *_advice_precision(report),
        *_advice_attention(report),
        *_advice_image(report),
        *_advice_fsdp2_overlap(report),
        *_advice_packages(report),
        *_advice_other(report),
    ]


def _advice_packages(report: dict[str, Any]) -> list[str]:
    problem = report.get("peft_torchao", {}).get("problem")
    return [f"peft=lora runs refuse to start: {problem}."] if problem else []


def _advice_fsdp2_overlap(report: dict[str, Any]) -> list[str]:
    problem = report.get("decisions", {}).get("fsdp2_overlap_problem")
    if not problem:
        return []
    value = report["decisions"]["fsdp2_overlap_level"]
    return [f"{device.FSDP2_OVERLAP_ENV}={value}: {problem}; runs refuse it until then."]


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


def _decision_rows(report: dict[str, Any]) -> list[tuple[str, Any]]:
    found = report.get("decisions")
    if not found:
        return []
    switches = found["tf32_switches"]
    tf32 = (
        f"{' and '.join(switches)} (on now: {_fmt(found['tf32_on_now'])}; trainer.tf32 sets "
        "them before a run)"
        if switches
        else "none on cpu"
    )
    rows = [
        ("tf32 switches", tf32),
        ("compile default", f"{_fmt(found['compile'])} ({found['compile_why']})"),
        ("AdamW (fused=null)", found["adamw"]),
    ]
    memory = report.get("allocator")
    if memory:
        how = "set by the user" if memory["set_by_user"] else "training runs set it"
        rows.append(("allocator", f"{memory['variable']}={memory['training_runs']} ({how})"))
        if memory["visible_devices_derived"] is not None:
            derived = memory["visible_devices_derived"]
            rows.append(("visible devices", f"MUSA_VISIBLE_DEVICES={derived} (from CUDA's)"))
    agreement = report.get("peft_torchao")
    if agreement:
        rows.append(("peft / torchao", _agreement_text(agreement)))
    if "fsdp2_overlap_level" in found:
        override, level = found["tf32_override"], found["fsdp2_overlap_level"]
        problem = found["fsdp2_overlap_problem"]
        shown = f"{device.FSDP2_OVERLAP_ENV}={level or ''}"
        rows.append(("tf32 override", f"{device.MUBLAS_TF32_OVERRIDE}={override or ''}"))
        rows.append(("FSDP2 overlap", f"{shown} (refused: {problem})" if problem else shown))
    return rows


def _agreement_text(found: dict[str, Any]) -> str:
    versions = f"peft {_fmt(found['peft'])}, torchao {_fmt(found['torchao'])}"
    return f"{versions}: {'agree' if found['agree'] else 'LoRA refused (see Advice)'}"


def _probe_text(probe: dict[str, Any]) -> str:
    parts = [
        f"{dtype} {'ok' if found['ok'] else 'FAILED'}"
        + (f" (error {found['relative_error']:.1e})" if "relative_error" in found else "")
        for dtype, found in probe["dtypes"].items()
    ]
    return f"{probe['device']}: {', '.join(parts)}"


def _device_row(dev: dict[str, Any]) -> tuple[str, str]:
    memory = dev["total_memory_bytes"]
    basis = dev.get("peak_flops_basis", {})
    peak_text = ", ".join(
        f"{dtype} {value / 1e12:g}" + (f" ({basis[dtype]} figure)" if dtype in basis else "")
        for dtype, value in dev["peak_flops"].items()
        if value
    )
    return (
        f"device {dev['index']}",
        f"{dev['name']}  capability {_fmt(dev['capability'])}  "
        f"{'-' if memory is None else f'{memory / _GIB:.1f} GiB'}  "
        f"bf16 {_fmt(dev['bf16'])}  tf32 {_fmt(dev['tf32'])}  fp8 {_fmt(dev.get('fp8'))}  "
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
                ("base image", report["image"]),
            ],
        ),
        ("Versions", list(report["versions"].items())),
        (
            "torch_musa",
            [
                ("installed", musa["installed"]),
                ("imported", musa["imported"]),
                ("import error", musa["error"]),
                ("built for torch", " or ".join(musa["expected_torch"] or []) or None),
                ("what changed", musa.get("release_changes")),
                ("serving", musa.get("vllm_musa")),
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
                ("flash attention", report.get("flash_attention", "not checked")),
                ("SDPA check", _probe_text(report["sdpa_probe"])),
            ],
        ),
        ("Run decisions", _decision_rows(report)),
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
                    for name, tool in backends.VENDOR_TOOLS.items()
                ),
                *(
                    (f"{module} driver loaded", report["kernel_modules"][name])
                    for name, module in backends.KERNEL_MODULES.items()
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

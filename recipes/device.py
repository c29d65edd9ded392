"""The one place that names an accelerator backend.

Everything hardware-related in the project goes through ``accelerate`` or through this module;
no other module may spell ``torch.cuda``, ``torch.musa``, ``"cuda"``, ``"nccl"`` or ``"mccl"``
(``tests/test_device_env.py`` enforces it). That keeps MUSA a first-class target: a behaviour
that differs between Moore Threads, NVIDIA and CPU machines is decided here, once.

``torch_musa`` is optional. Older releases only create ``torch.musa`` after an explicit
``import torch_musa``, so every MUSA query goes through :func:`_import_torch_musa` first.
``torchada`` (which makes ``torch.cuda`` answer on MUSA hosts) is tolerated because MUSA is
probed before CUDA and this module never imports ``torchada`` itself.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import types
from pathlib import Path
from typing import Any

import torch

# Backend names as torch spells them; other modules compare against these constants instead of
# writing the literals, so the literals live in this file only.
MUSA = "musa"
CUDA = "cuda"
CPU = "cpu"

# Collective-communication backends for torch.distributed.
MCCL = "mccl"
NCCL = "nccl"
GLOO = "gloo"

# Environment variables that hide or expose devices; reported by ``recipes.env`` because a stray
# empty value is the most common reason a container sees no accelerator.
VISIBLE_DEVICES_ENV_VARS: tuple[str, ...] = (
    "MUSA_VISIBLE_DEVICES",
    "MTHREADS_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)
# The ones read by the container runtimes (mt-container-toolkit, NVIDIA Container Toolkit), where
# ``all`` exposes every card; the other two take device indices.
CONTAINER_VISIBLE_DEVICES_ENV_VARS: tuple[str, ...] = (
    "MTHREADS_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)
# Values of those variables that leave the process no device at all.
HIDE_ALL_DEVICES_VALUES = frozenset({"", "-1", "none", "void"})

# Vendor management tools: their presence on PATH says which driver stack the host has, even
# when torch cannot see a device.
VENDOR_TOOLS: dict[str, str] = {MUSA: "mthreads-gmi", CUDA: "nvidia-smi"}

# Kernel drivers; ``/sys/module`` is the host kernel's, so a container sees them too, and a
# loaded driver with no device in torch points at the container runtime, not at the host.
KERNEL_MODULES: dict[str, str] = {MUSA: "mtgpu", CUDA: "nvidia"}
_SYS_MODULE = "/sys/module"

# torch_musa releases from which MuDNN's flash SDPA has a backward pass (``MuDNNFlashSDPABwd`` in
# torch_musa/csrc/aten/ops/attention/mudnn/SDP.cpp, first in v1.2.1); before it only eager
# attention trains. Where flash does not apply (arch < 2.2, fp32, head_dim > 128) torch_musa
# dispatches SDPA to its math kernel, which has a backward in those releases too.
_MUSA_SDPA_BACKWARD = (1, 2, 1)

# MUSA compute capability from which bf16 and TF32 are native (MTT S4000, arch QY2).
_MUSA_BF16_CAPABILITY = (2, 2)
# NVIDIA Ampere and newer have TF32 tensor cores.
_CUDA_TF32_CAPABILITY = (8, 0)

_torch_musa_error: str | None = None


def _import_torch_musa() -> bool:
    """Make ``torch.musa`` usable if torch_musa is installed.

    Returns:
        True when ``torch.musa`` exists after the attempt.
    """
    global _torch_musa_error
    if hasattr(torch, MUSA):
        return True
    if importlib.util.find_spec("torch_musa") is None:
        return False
    try:
        importlib.import_module("torch_musa")
    except (
        Exception
    ) as exc:  # an image without mt-container-toolkit fails with OSError, not ImportError
        _torch_musa_error = f"{type(exc).__name__}: {exc}"
        return False
    return hasattr(torch, MUSA)


def torch_musa_info() -> dict[str, str | bool | None]:
    """Describe the torch_musa installation.

    Returns:
        ``installed`` (a distribution is importable), ``imported`` (``torch.musa`` exists),
        ``version`` and ``error`` (why the import failed, if it did).
    """
    installed = importlib.util.find_spec("torch_musa") is not None
    imported = _import_torch_musa()
    version = None
    if installed and imported:
        version = getattr(importlib.import_module("torch_musa"), "__version__", None)
    return {
        "installed": installed,
        "imported": imported,
        "version": None if version is None else str(version),
        "error": _torch_musa_error,
    }


def _release(version: str) -> tuple[int, ...] | None:
    """``(1, 3, 0)`` from ``"1.3.0+abc1234"`` / ``"v2.0.0-pt25"``; None when unreadable."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    return None if match is None else tuple(int(part or 0) for part in match.groups())


def torch_version() -> tuple[int, int]:
    """This torch's major.minor (vendor builds such as ``2.2.0a0+git8ac9b20`` count as 2.2)."""
    release = _release(torch.__version__)
    assert release is not None, torch.__version__
    return release[0], release[1]


def torch_accelerator_build() -> str | None:
    """Say which GPU toolkit this torch was built with.

    Returns:
        ``"CUDA 12.1"`` / ``"ROCm 6.0"``; None for a CPU-only build (the ``+cpu`` wheels). A MUSA
        torch is a CPU torch plus torch_musa, so None is normal on MUSA hosts.
    """
    cuda = getattr(torch.version, CUDA, None)
    if cuda:
        return f"CUDA {cuda}"
    hip = getattr(torch.version, "hip", None)
    return f"ROCm {hip}" if hip else None


def kernel_modules_loaded() -> dict[str, bool | None]:
    """Say which vendor kernel drivers are loaded.

    Returns:
        ``{"musa": ..., "cuda": ...}`` from :data:`KERNEL_MODULES`; None where ``/sys/module``
        cannot be read (not Linux).
    """
    if not os.path.isdir(_SYS_MODULE):
        return dict.fromkeys(KERNEL_MODULES)
    return {
        name: os.path.isdir(os.path.join(_SYS_MODULE, module))
        for name, module in KERNEL_MODULES.items()
    }


def accelerate_sees_musa() -> bool | None:
    """Ask accelerate whether it would drive a MUSA device.

    Returns:
        accelerate's answer, or None when this accelerate predates MUSA support (< 0.33) or
        cannot be imported (a torch_musa that fails to load breaks ``import accelerate``).
    """
    # accelerate imports torch_musa itself (even at ``import accelerate``), so a broken
    # torch_musa surfaces here as any exception, not only ImportError.
    try:
        from accelerate.utils import is_musa_available

        return bool(is_musa_available())
    except Exception:
        return None


def _musa_available() -> bool:
    if not _import_torch_musa():
        return False
    try:
        return bool(torch.musa.is_available())
    except RuntimeError:  # raised instead of False when the driver is missing
        return False


@functools.cache
def backend() -> str:
    """Name the accelerator backend of this machine.

    MUSA is probed first (as in accelerate's device order), so a MUSA host with ``torchada``
    installed, where ``torch.cuda`` also answers, is still reported as MUSA.

    Returns:
        ``"musa"``, ``"cuda"`` or ``"cpu"``.
    """
    if _musa_available():
        return MUSA
    if torch.cuda.is_available():
        return CUDA
    return CPU


def device_module(name: str | None = None) -> types.ModuleType | None:
    """Return the ``torch.<backend>`` namespace.

    Args:
        name: A backend or ``torch.device.type``; defaults to :func:`backend`.

    Returns:
        ``torch.musa`` / ``torch.cuda`` (or any other ``torch.<type>`` module), None for cpu.
    """
    name = backend() if name is None else name
    if name == CPU:
        return None
    if name == MUSA and not _import_torch_musa():
        return None
    module = getattr(torch, name, None)
    return module if isinstance(module, types.ModuleType) else None


def device_count() -> int:
    """Count the accelerator devices visible to this process.

    Returns:
        The number of devices of :func:`backend`; 0 on cpu.
    """
    module = device_module()
    return 0 if module is None else int(module.device_count())


def device_names() -> list[str]:
    """List the names of the visible accelerator devices.

    Returns:
        One name per device (for example ``"MTT S4000"``); empty on cpu.
    """
    module = device_module()
    if module is None:
        return []
    return [str(module.get_device_name(index)) for index in range(device_count())]


def device_capability(index: int = 0) -> tuple[int, int] | None:
    """Return the compute capability of one device.

    Args:
        index: Device index.

    Returns:
        ``(major, minor)``, or None on cpu or when the device does not exist.
    """
    module = device_module()
    if module is None or index >= device_count():
        return None
    getter = getattr(module, "get_device_capability", None)
    if getter is not None:
        major, minor = getter(index)
        return int(major), int(minor)
    # Older torch_musa exposes the capability only through the properties object.
    props = module.get_device_properties(index)
    return int(props.major), int(props.minor)


def device_total_memory(index: int = 0) -> int | None:
    """Return the memory of one device.

    Args:
        index: Device index.

    Returns:
        Bytes, or None on cpu or when the device does not exist.
    """
    module = device_module()
    if module is None or index >= device_count():
        return None
    return int(module.get_device_properties(index).total_memory)


def device_supports_bf16(index: int) -> bool:
    """Say whether one accelerator device has native bf16.

    Args:
        index: Device index of :func:`backend`.

    Returns:
        musa: capability >= 2.2; cuda: capability >= 8.0 (ROCm: torch's answer); False on cpu
        and for a device that does not exist.
    """
    name = backend()
    capability = device_capability(index)
    if name == CPU or capability is None:
        return False
    if name == CUDA and getattr(torch.version, "hip", None):
        return supports_bf16(CUDA)
    return capability >= (_MUSA_BF16_CAPABILITY if name == MUSA else _CUDA_TF32_CAPABILITY)


def device_supports_tf32(index: int) -> bool:
    """Say whether one accelerator device has TF32 units.

    Args:
        index: Device index of :func:`backend`.

    Returns:
        True on S4000-class MUSA devices and NVIDIA Ampere or newer; False elsewhere.
    """
    name = backend()
    capability = device_capability(index)
    if name == CPU or capability is None:
        return False
    return capability >= (_MUSA_BF16_CAPABILITY if name == MUSA else _CUDA_TF32_CAPABILITY)


def cpu_bf16_autocast() -> bool:
    """Try bf16 autocast on the CPU for real.

    Returns:
        True when a matmul under ``torch.autocast("cpu", dtype=torch.bfloat16)`` yields bf16.
    """
    try:
        with torch.autocast(CPU, dtype=torch.bfloat16):
            out = torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    except (RuntimeError, TypeError, ValueError):
        return False
    return out.dtype == torch.bfloat16


def cpu_bf16_native(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Say whether the CPU has bf16 instructions (AVX512-BF16, AMX, Arm BF16).

    Without them bf16 autocast on CPU converts in software and is usually slower than fp32.

    Args:
        cpuinfo: The Linux CPU description to read.

    Returns:
        True or False from the CPU flags; None where they cannot be read.
    """
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in {"flags", "features"}:
            return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()))
    return None


def supports_bf16(name: str | None = None) -> bool:
    """Say whether bf16 runs natively.

    Args:
        name: A backend; defaults to :func:`backend`.

    Returns:
        musa: capability >= 2.2 (S4000 class; S80/S3000 are fp16 only). cuda: what torch reports,
        not counting emulation. cpu: True, because autocast accepts bf16 there; whether it is a
        good default is :func:`default_mixed_precision`'s call.
    """
    name = backend() if name is None else name
    if name == MUSA:
        if not _musa_available():
            return False
        capability = device_capability(torch.musa.current_device())
        return capability is not None and capability >= _MUSA_BF16_CAPABILITY
    if name == CUDA:
        if not torch.cuda.is_available():
            return False
        try:
            # torch >= 2.3 counts pre-Ampere emulation as support unless told otherwise; an
            # emulated bf16 is slower than fp16, so it must not win the default.
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:
            return bool(torch.cuda.is_bf16_supported())
    return name == CPU


def supports_tf32(name: str | None = None) -> bool:
    """Say whether TF32 matmuls run natively.

    Args:
        name: A backend; defaults to :func:`backend`.

    Returns:
        True on S4000-class MUSA devices and NVIDIA Ampere or newer; False elsewhere.
    """
    name = backend() if name is None else name
    if name != backend() or name == CPU:
        return False
    return device_supports_tf32(device_module(name).current_device())


def default_mixed_precision(name: str | None = None) -> str:
    """Choose the mixed-precision mode a recipe uses when it does not say.

    Args:
        name: A backend; defaults to :func:`backend` (``cpu`` under ``accelerate launch --cpu``).

    Returns:
        ``"bf16"`` on accelerators that have it, ``"fp16"`` on those that do not (S80/S3000,
        pre-Ampere NVIDIA; accelerate adds the grad scaler). On cpu, :func:`cpu_mixed_precision`.
    """
    name = backend() if name is None else name
    if name == CPU:
        return cpu_mixed_precision(cpu_bf16_native(), cpu_bf16_autocast())
    return "bf16" if supports_bf16(name) else "fp16"


def cpu_mixed_precision(native: bool | None, autocast: bool) -> str:
    """The CPU's default: bf16 autocast only where the CPU has bf16 instructions.

    With AVX512-BF16 or AMX, oneDNN runs the matmuls in bf16 and a training step is faster (the
    README's speed section measures it). Without them autocast converts in software and is
    slower than fp32; where the flags cannot be read, fp32 is the safe choice.

    Args:
        native: :func:`cpu_bf16_native`'s answer.
        autocast: :func:`cpu_bf16_autocast`'s answer.

    Returns:
        ``"bf16"`` or ``"no"``.
    """
    return "bf16" if native and autocast else "no"


def musa_sdpa_trains(version: str | None) -> bool:
    """Whether a torch_musa release has SDPA kernels with a backward pass (v1.2.1 and later)."""
    release = None if version is None else _release(version)
    return release is not None and release >= _MUSA_SDPA_BACKWARD


def default_attn_implementation() -> str:
    """Choose the transformers ``attn_implementation`` for this machine.

    Returns:
        ``"sdpa"``, except on MUSA with a torch_musa older than v1.2.1, whose SDPA had no
        backward pass (``"eager"`` there). ``python -m recipes.env`` checks SDPA against eager on
        the device, so a torch_musa build whose kernels are wrong is caught before a run.
    """
    if backend() == MUSA:
        return "sdpa" if musa_sdpa_trains(torch_musa_info()["version"]) else "eager"
    return "sdpa"


def _fused_kernel_devices(release: tuple[int, int]) -> frozenset[str]:
    # torch/utils/_foreach_utils.py::_get_fused_kernels_supported_devices: torch 2.2 and 2.3 list
    # cuda, xpu and the PrivateUse1 backend; torch 2.4 adds cpu and mps. AdamW(fused=True)
    # checks its parameters against this list when it is built, not when it steps.
    kinds = {CUDA, "xpu", torch._C._get_privateuse1_backend_name()}
    if release >= (2, 4):
        kinds |= {CPU, "mps"}
    return frozenset(kinds)


def fused_adamw_ok(
    target: torch.device | str,
    params_on: torch.device | str,
    release: tuple[int, int] | None = None,
) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` can be built and stepped for this run.

    Args:
        target: The device the parameters train on.
        params_on: Where the parameters are when the optimizer is built (before
            ``accelerator.prepare``: the CPU).
        release: torch's major.minor; defaults to this torch's.

    Returns:
        True where that torch accepts the parameters' current device and the target has the
        kernel; False on MUSA, where torch's fused AdamW fails and torch_musa has its own
        (:func:`musa_fused_adamw`).
    """
    # Device types as strings: "musa" only parses as a torch.device once torch_musa is loaded.
    target_kind, params_kind = (
        where.type if isinstance(where, torch.device) else str(where).partition(":")[0]
        for where in (target, params_on)
    )
    if target_kind not in (CUDA, CPU):
        return False
    kinds = _fused_kernel_devices(torch_version() if release is None else release)
    return target_kind in kinds and params_kind in kinds


def musa_fused_adamw() -> type[torch.optim.Optimizer] | None:
    """torch_musa's ``FusedAdamW`` (v2.5 and later; the vendor's recommendation on MUSA), or None.

    It takes AdamW's hyper-parameters (no ``fused`` / ``foreach``) and keeps the same state
    (``step``, ``exp_avg``, ``exp_avg_sq``), so its checkpoints load into ``torch.optim.AdamW``.
    """
    if not _import_torch_musa():
        return None
    try:
        optim = importlib.import_module("torch_musa.optim")
    except ImportError:
        return None
    return getattr(optim, "FusedAdamW", None)


def compile_unsupported_reason(name: str | None = None) -> str | None:
    """Why ``torch.compile`` cannot train on this backend, or None when it can.

    torch_musa registers its dynamo device interface and inductor backend from v2.0
    (``torch_musa/_dynamo``, ``torch_musa/_inductor``); v1.3 has neither.
    """
    name = backend() if name is None else name
    if name != MUSA or importlib.util.find_spec("torch_musa._dynamo") is not None:
        return None
    version = torch_musa_info()["version"] or "this version"
    return (
        f"torch_musa {version} has no torch.compile (dynamo/inductor) backend for MUSA; it "
        "first ships in torch_musa v2.0"
    )


def pin_memory_kwargs(pin: bool, target: torch.device) -> dict[str, Any]:
    """DataLoader arguments that page-lock batches for ``target``'s copies (none on cpu).

    torch before 2.6 pins for CUDA only unless ``pin_memory_device`` names the backend; later
    releases pin for the current accelerator and deprecate the argument.
    """
    kind = torch.device(target).type
    if not pin or kind == CPU:
        return {"pin_memory": False}
    if hasattr(torch, "accelerator"):  # torch >= 2.6
        return {"pin_memory": True}
    return {"pin_memory": True, "pin_memory_device": kind}


def mccl_available() -> bool:
    """Say whether torch.distributed can use MCCL.

    Returns:
        True when torch_musa registered the ``mccl`` backend (S4000 builds; S80/S3000 builds
        ship without it).
    """
    if not _import_torch_musa():
        return False
    import torch.distributed as dist

    if not dist.is_available():
        return False
    checker = getattr(dist, "is_backend_available", None)  # torch >= 2.3
    if checker is not None:
        try:
            return bool(checker(MCCL))
        except (RuntimeError, ValueError):
            pass
    return MCCL in getattr(dist.Backend, "backend_list", []) or hasattr(dist.Backend, "MCCL")


def _distributed_backend_and_reason() -> tuple[str | None, str]:
    import torch.distributed as dist

    if not dist.is_available():
        return None, "this torch build has no torch.distributed"
    name = backend()
    if name == MUSA:
        if mccl_available():
            return MCCL, "MCCL (registered by torch_musa)"
        return None, (
            "this torch_musa build has no MCCL (MTT S80/S3000 builds ship none), so multi-GPU "
            "training is unsupported here: run on one device (conf/accelerate/single_device.yaml)"
        )
    if name == CUDA:
        if dist.is_nccl_available():
            return NCCL, "NCCL"
        return None, "this torch build has no NCCL, so multi-GPU training is unsupported here"
    if dist.is_gloo_available():
        return GLOO, "gloo (CPU processes)"
    return None, "this torch build has no gloo backend"


def distributed_backend() -> str | None:
    """Name the collective backend a multi-process run on this machine would use.

    Returns:
        ``"mccl"`` on MUSA, ``"nccl"`` on CUDA, ``"gloo"`` on cpu; None when the needed backend
        is missing (see :func:`distributed_backend_reason` for why).
    """
    return _distributed_backend_and_reason()[0]


def distributed_backend_reason() -> str:
    """Explain :func:`distributed_backend`'s answer.

    Returns:
        A short sentence; when the backend is None it says what to do instead.
    """
    return _distributed_backend_and_reason()[1]


def accelerate_distributed_type(num_processes: int, name: str | None = None) -> str:
    """Map a machine to accelerate's ``distributed_type`` for a local launch.

    Args:
        num_processes: Processes the launch would start.
        name: The machine's backend; defaults to :func:`backend`.

    Returns:
        ``"NO"`` for one process, else ``"MULTI_MUSA"``, ``"MULTI_GPU"`` or ``"MULTI_CPU"``.
    """
    if num_processes <= 1:
        return "NO"
    name = backend() if name is None else name
    return {MUSA: "MULTI_MUSA", CUDA: "MULTI_GPU"}.get(name, "MULTI_CPU")


def _has_fp32_precision() -> bool:
    # torch >= 2.9: the fine-grained ``fp32_precision`` settings; setting the older
    # ``allow_tf32`` flags there is deprecated and warns (pytorch/pytorch#166387).
    try:
        torch.backends.cuda.matmul.fp32_precision  # noqa: B018
        torch.backends.cudnn.conv.fp32_precision  # noqa: B018
    except AttributeError:
        return False
    return True


def set_tf32(enabled: bool) -> bool:
    """Turn TF32 for fp32 matmuls and convolutions on or off, on every backend.

    Both ways matter: torch_musa 2.7 enables TF32 by default (``allow_tf32_ = true`` in
    ``csrc/aten/utils/Context.h``; false up to 2.5), so ``trainer.tf32=false`` must switch it off.

    Returns:
        Whether fp32 matmuls now run in TF32 (read back from the backend), for MFU.
    """
    name = backend()
    if name == MUSA:
        mudnn = getattr(torch.backends, "mudnn", None)
        if mudnn is not None:
            mudnn.allow_tf32 = enabled
    elif name == CUDA:
        if _has_fp32_precision():
            precision = "tf32" if enabled else "ieee"
            torch.backends.cuda.matmul.fp32_precision = precision
            torch.backends.cudnn.conv.fp32_precision = precision
        else:
            torch.backends.cuda.matmul.allow_tf32 = enabled
            torch.backends.cudnn.allow_tf32 = enabled
    return tf32_enabled()


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on this machine's accelerator run in TF32 now (False on cpu)."""
    name = backend()
    if name == MUSA:
        return bool(getattr(getattr(torch.backends, "mudnn", None), "allow_tf32", False))
    if name == CUDA:
        if _has_fp32_precision():
            return torch.backends.cuda.matmul.fp32_precision == "tf32"
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return False


def _module_for(device: torch.device | str) -> tuple[torch.device, types.ModuleType | None]:
    device = torch.device(device)
    return device, device_module(device.type)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that wall-clock timings are honest.

    Args:
        device: The device to wait for; cpu returns at once.
    """
    device, module = _module_for(device)
    sync = getattr(module, "synchronize", None)
    if sync is not None:
        sync(device)


def max_memory_allocated(device: torch.device) -> int | None:
    """Return the peak memory allocated by tensors on the device.

    Args:
        device: The device to query.

    Returns:
        Bytes since the last :func:`reset_peak_memory_stats`; None on cpu.
    """
    device, module = _module_for(device)
    getter = getattr(module, "max_memory_allocated", None)
    return None if getter is None else int(getter(device))


def reset_peak_memory_stats(device: torch.device) -> None:
    """Start a new peak-memory window on the device.

    Args:
        device: The device to reset; cpu is a no-op.
    """
    device, module = _module_for(device)
    reset = getattr(module, "reset_peak_memory_stats", None)
    if reset is not None:
        reset(device)


def _tflops(**figures: float) -> dict[str, float]:
    return {dtype: value * 1e12 for dtype, value in figures.items()}


# Peak dense FLOP/s per device (vendor datasheets and whitepapers, no structured sparsity),
# matched in order against the device name, so the more specific patterns come first
# ("H100 ... PCIe" before "H100", "A100" never matching "A10"). fp16/bf16 figures are for
# tensor-core math with fp32 accumulation, which is what torch autocast uses. A dtype missing
# from an entry is not guessed: the caller reports "not in table".
_PEAK_FLOPS: tuple[tuple[re.Pattern[str], dict[str, float]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), figures)
    for pattern, figures in (
        # Moore Threads (vendor figures).
        (r"\bS5000\b", _tflops(fp8=1000)),  # about 1,000 FP8 (920 air-cooled); others unpublished
        (r"\bS4000\b", _tflops(fp32=25, tf32=50, fp16=100, bf16=100)),
        (r"\bS3000\b", _tflops(fp32=15.2)),
        (r"\bS80\b", _tflops(fp32=14.4)),
        # NVIDIA data centre.
        (r"\bH200\b.*\bNVL\b", _tflops(fp32=60, tf32=417.5, fp16=835.5, bf16=835.5)),
        (r"\bH200\b", _tflops(fp32=66.9, tf32=494.7, fp16=989.4, bf16=989.4)),
        (r"\bH100\b.*\bNVL\b", _tflops(fp32=60, tf32=417.5, fp16=835.5, bf16=835.5)),
        (r"\bH100\b.*\bPCIe\b", _tflops(fp32=51.2, tf32=378, fp16=756, bf16=756)),
        (r"\bH100\b", _tflops(fp32=66.9, tf32=494.7, fp16=989.4, bf16=989.4)),  # SXM5
        (r"\bA100\b", _tflops(fp32=19.5, tf32=156, fp16=312, bf16=312)),
        (r"\bV100S\b", _tflops(fp32=16.4, fp16=130)),
        (r"\bV100\b.*\bPCIe\b", _tflops(fp32=14, fp16=112)),
        (r"\bV100\b", _tflops(fp32=15.7, fp16=125)),  # SXM2
        (r"\bA10\b", _tflops(fp32=31.2, tf32=62.5, fp16=125, bf16=125)),
        (r"\bL40S\b", _tflops(fp32=91.6, tf32=183, fp16=362, bf16=362)),
        (r"\bL4\b", _tflops(fp32=30.3, tf32=60, fp16=121, bf16=121)),
        # NVIDIA GeForce (the 4090 D is a different, slower part).
        (r"\bRTX 4090\b(?!\s*D\b)", _tflops(fp32=82.6, tf32=82.6, fp16=165.2, bf16=165.2)),
    )
)

_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "no": "fp32",
    "tf32": "tf32",
    "fp16": "fp16",
    "float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp8": "fp8",
}


def _lookup_peak(name: str, dtype: str) -> float | None:
    """Look a device name up in the peak FLOP/s table.

    Args:
        name: Device name as the driver reports it (``"MTT S4000"``, ``"NVIDIA A100-SXM4-80GB"``).
        dtype: ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"`` (or ``"fp8"``, or the long names).

    Returns:
        Peak dense FLOP/s, or None when the device or the dtype is not in the table.

    Raises:
        ValueError: For a dtype the table does not know, which is a caller bug, not a device gap.
    """
    key = _DTYPE_ALIASES.get(dtype.lower())
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}")
    for pattern, figures in _PEAK_FLOPS:
        if pattern.search(name):
            if key == "tf32" and key not in figures:
                # Without TF32 units, "TF32 enabled" matmuls run at full fp32 rate.
                return figures.get("fp32")
            return figures.get(key)
    return None


def peak_flops_by_name(name: str, dtype: str) -> float | None:
    """Look a device name up in the peak FLOP/s table (for reports about other machines).

    Args:
        name: Device name as the driver reports it.
        dtype: ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.

    Returns:
        Peak dense FLOP/s, or None when not in the table.
    """
    return _lookup_peak(name, dtype)


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Return the peak dense FLOP/s of a device, for MFU.

    Args:
        device: The device the model runs on.
        dtype: ``"fp32"``, ``"tf32"``, ``"fp16"`` or ``"bf16"``.

    Returns:
        FLOP/s, or None on cpu and for devices not in the table (say "not in table" rather than
        guess).
    """
    device, module = _module_for(device)
    if module is None or not hasattr(module, "get_device_name"):
        return None
    index = device.index if device.index is not None else module.current_device()
    return _lookup_peak(str(module.get_device_name(index)), dtype)

"""The one place training code asks about the accelerator.

The loop, the optimizer builder and the MFU counter go through ``accelerate`` or through this
module; no other training module may spell ``torch.cuda``, ``torch.musa``, ``"cuda"`` or ``"musa"``
(``tests/test_device_env.py`` enforces it). What only the environment doctor needs (driver
modules, vendor tools, release tables, collective backends) is in :mod:`recipes.backends`.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Backend names as torch spells them; other modules compare against these constants instead of
# writing the literals.
MUSA = "musa"
CUDA = "cuda"
CPU = "cpu"
# Collective-communication backends for torch.distributed (the environment doctor reports them).
MCCL = "mccl"
NCCL = "nccl"
GLOO = "gloo"

# torch_musa releases from which MuDNN's flash SDPA has a backward pass (``MuDNNFlashSDPABwd`` in
# torch_musa/csrc/aten/ops/attention/mudnn/SDP.cpp, first in v1.2.1); before it only eager
# attention trains. Where flash does not apply (arch < 2.2, fp32, head_dim > 128) torch_musa
# dispatches SDPA to its math kernel, which has a backward in those releases too.
_MUSA_SDPA_BACKWARD = (1, 2, 1)

# torch_musa releases from which GEMMs read their own TF32 switch, off by default:
# ``torch.backends.musa.matmul.allow_tf32`` or the environment variable below (v2.9.0 release
# notes, github.com/MooreThreads/torch_musa/releases/tag/v2.9.0). Before, one switch,
# ``torch.backends.mudnn.allow_tf32``, covered matmuls and convolutions (on by default in v2.7.x).
_MUSA_MATMUL_TF32_SWITCH = (2, 9, 0)
MUBLAS_TF32_OVERRIDE = "TORCH_ALLOW_TF32_MUBLAS_OVERRIDE"
_MUDNN_TF32 = "torch.backends.mudnn.allow_tf32"
_MUSA_MATMUL_TF32 = "torch.backends.musa.matmul.allow_tf32"
# Releases whose compiled kernels are slower than v2.7.0's ("Known && blocked issues" of the
# v2.9.0 release notes; not reported fixed in v2.9.1 or 2.11.0.post1).
_MUSA_COMPILE_SLOWER = (2, 9, 0)
# torch_musa's FSDP2 overlap of communication with computation, 0 (none, the default) to 4, read
# once when torch_musa is imported: from v2.7.1
# (torch_musa/distributed/_composable/fsdp/custom_overlap_patch.py; v2.7.0 has only
# TORCH_MUSA_FSDP2_DISABLE_OVERLAP). Set it in the launch's environment.
FSDP2_OVERLAP_ENV = "TORCH_MUSA_FSDP2_OVERLAP_LEVEL"
_MUSA_FSDP2_OVERLAP = (2, 7, 1)
_FSDP2_OVERLAP_LEVELS = range(5)

# Compute capability from which bf16 and TF32 are native: MTT S4000 (arch QY2) on MUSA, Ampere
# on NVIDIA (torch's own bf16 test, not counting emulation, which is slower than fp16).
_NATIVE_BF16_TF32 = {MUSA: (2, 2), CUDA: (8, 0)}
# Compute capability from which FP8 matmul units exist: MUSA 3.1, the MTT S5000 (the first MUSA
# card with FP8; sglang sets its FP8 minimum to "SM 31" on MUSA, sgl-project/sglang PR #22774),
# NVIDIA 8.9 (Ada, Hopper). Reported, not used: no recipe trains in fp8.
_NATIVE_FP8 = {MUSA: (3, 1), CUDA: (8, 9)}

_torch_musa_error: str | None = None


def _import_torch_musa() -> bool:
    """Make ``torch.musa`` usable if torch_musa is installed; True when it exists afterwards."""
    global _torch_musa_error
    if hasattr(torch, MUSA):
        return True
    if importlib.util.find_spec("torch_musa") is None:
        return False
    try:
        importlib.import_module("torch_musa")
    except Exception as exc:  # an image without mt-container-toolkit fails with OSError
        _torch_musa_error = f"{type(exc).__name__}: {exc}"
        return False
    return hasattr(torch, MUSA)


def torch_musa_info() -> dict[str, str | bool | None]:
    """``installed``, ``imported`` (``torch.musa`` exists), ``version`` and the import ``error``."""
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
    found = _release(torch.__version__)
    assert found is not None, torch.__version__
    return found[0], found[1]


def _musa_available() -> bool:
    if not _import_torch_musa():
        return False
    try:
        return bool(torch.musa.is_available())
    except RuntimeError:  # raised instead of False when the driver is missing
        return False


@functools.cache
def backend() -> str:
    """``"musa"``, ``"cuda"`` or ``"cpu"``. MUSA is probed first (as in accelerate's device
    order), so a MUSA host with ``torchada``, where ``torch.cuda`` also answers, stays MUSA.
    The first probe starts the runtime: the visible devices are settled before it."""
    sync_visible_devices()
    if _musa_available():
        return MUSA
    if torch.cuda.is_available():
        return CUDA
    return CPU


def device_module(name: str | None = None) -> types.ModuleType | None:
    """``torch.musa`` / ``torch.cuda`` (or any ``torch.<type>``) for a backend or device type,
    :func:`backend` by default; None for cpu."""
    name = backend() if name is None else name
    if name == CPU:
        return None
    if name == MUSA and not _import_torch_musa():
        return None
    module = getattr(torch, name, None)
    return module if isinstance(module, types.ModuleType) else None


def device_count() -> int:
    """Accelerator devices visible to this process (0 on cpu)."""
    module = device_module()
    return 0 if module is None else int(module.device_count())


def device_names() -> list[str]:
    """One name per visible accelerator device (``"MTT S4000"``); empty on cpu."""
    module = device_module()
    if module is None:
        return []
    return [str(module.get_device_name(index)) for index in range(device_count())]


def device_capability(index: int = 0) -> tuple[int, int] | None:
    """``(major, minor)`` of one device; None on cpu or when the device does not exist."""
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


def own_device_index(module: types.ModuleType) -> int:
    """The device this process trains on: its ``LOCAL_RANK`` under a launcher (accelerate and
    torchrun give each local process the device of its rank), else the current device.

    Asked before accelerate has set each rank's device, ``current_device()`` is 0 in every rank,
    and reading device 0 may open a context on card 0 in all eight processes of a node.
    """
    local_rank = os.environ.get("LOCAL_RANK", "")
    if local_rank.isdigit():
        count = int(module.device_count())
        return int(local_rank) % count if count else 0
    return int(module.current_device())


def _native(index: int | None, table: dict[str, tuple[int, int]] = _NATIVE_BF16_TF32) -> bool:
    """Whether a device of this backend (this process's own by default) reaches the capability
    from which a ``table``'s precisions are native (bf16 and TF32 by default)."""
    name = backend()
    module = device_module(name)
    if module is None:
        return False
    capability = device_capability(own_device_index(module) if index is None else index)
    return capability is not None and capability >= table.get(name, (99, 0))


def supports_bf16(index: int | None = None) -> bool:
    """Whether bf16 runs natively on a device (the current one by default).

    MUSA: capability >= 2.2 (S4000, S5000; S80/S3000 are fp16 only); NVIDIA: Ampere or newer;
    ROCm: every device; cpu: True, because autocast accepts bf16 there (whether it is a good
    default is :func:`default_mixed_precision`'s call).
    """
    name = backend()
    if name == CPU:
        return True
    if name == CUDA and getattr(torch.version, "hip", None):
        index = own_device_index(torch.cuda) if index is None else index
        return index < device_count()
    return _native(index)


def supports_tf32(index: int | None = None) -> bool:
    """Whether a device (the current one by default) has TF32 units: S4000-class MUSA devices
    and NVIDIA Ampere or newer; never on cpu."""
    return backend() != CPU and _native(index)


def supports_fp8(index: int | None = None) -> bool:
    """Whether a device (the current one by default) has FP8 matmul units: MUSA capability 3.1
    (MTT S5000) and NVIDIA 8.9 or newer; never on cpu. The doctor reports it; the recipes train in
    bf16 there (accelerate's fp8 needs TransformerEngine, torchao or MS-AMP, none set up here)."""
    return backend() != CPU and _native(index, _NATIVE_FP8)


def cpu_bf16_autocast() -> bool:
    """Whether a matmul under ``torch.autocast("cpu", dtype=torch.bfloat16)`` yields bf16 here."""
    try:
        with torch.autocast(CPU, dtype=torch.bfloat16):
            out = torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    except (RuntimeError, TypeError, ValueError):
        return False
    return out.dtype == torch.bfloat16


def cpu_bf16_native(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether the CPU has bf16 instructions (AVX512-BF16, AMX, Arm BF16); None where the flags
    cannot be read. Without them bf16 autocast converts in software and is slower than fp32."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in {"flags", "features"}:
            return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()))
    return None


def default_mixed_precision(name: str | None = None) -> str:
    """The mixed-precision mode a recipe uses when it does not say, for a backend (:func:`backend`
    by default; ``cpu`` under ``accelerate launch --cpu``).

    ``"bf16"`` on accelerators that have it, ``"fp16"`` on those that do not (S80/S3000,
    pre-Ampere NVIDIA; accelerate adds the grad scaler); on cpu, :func:`cpu_mixed_precision`.
    """
    name = backend() if name is None else name
    if name == CPU:
        return cpu_mixed_precision(cpu_bf16_native(), cpu_bf16_autocast())
    return "bf16" if name == backend() and supports_bf16() else "fp16"


def cpu_mixed_precision(native: bool | None, autocast: bool) -> str:
    """``"bf16"`` only where the CPU has bf16 instructions and autocast works, else ``"no"``.

    With AVX512-BF16 or AMX, oneDNN runs the matmuls in bf16 and a step is faster; without them
    autocast converts in software and is slower than fp32; unknown flags mean fp32, the safe side.
    """
    return "bf16" if native and autocast else "no"


def musa_sdpa_trains(version: str | None) -> bool:
    """Whether a torch_musa release has SDPA kernels with a backward pass (v1.2.1 and later)."""
    found = None if version is None else _release(version)
    return found is not None and found >= _MUSA_SDPA_BACKWARD


def hub_kernels_run_here(name: str | None = None) -> bool:
    """Whether the ``kernels`` library (transformers 5's hub kernels, on by default when it is
    installed) can run a model on this backend. It knows cpu, cuda, rocm, mps, npu, xpu, tpu
    and neuron, not musa: there ``model.train()`` / ``.eval()`` re-kernelize the model and raise
    "Unsupported device type 'musa'" (found on the emulated MUSA device)."""
    return (backend() if name is None else name) != MUSA


@dataclass(frozen=True)
class FlashAttention:
    """Whether transformers' ``flash_attention_2`` (flash-attention's variable-length kernels)
    runs on this device, and a line that says which kernel or why not."""

    usable: bool
    detail: str


# The first transformers whose is_flash_attn_2_available() accepts a MUSA device
# (huggingface/transformers PR #48612, merged 2026-09-08); 4.57, the last 4.x, asks for CUDA or
# MLU only (transformers/utils/import_utils.py).
_TRANSFORMERS_FLASH_ON_MUSA = "PR #48612 (transformers 5.x)"


def musa_flash_attention() -> FlashAttention:
    """``flash_attention_2`` on a MUSA device: flash-attention's API imports (flash-attn built
    for MUSA, or MATE's, installed as the ``flash_attn`` package transformers looks for) with a
    variable-length function, and this transformers detects it on MUSA."""
    if backend() != MUSA:
        return FlashAttention(False, "not a MUSA device")
    if importlib.util.find_spec("flash_attn") is None:
        return FlashAttention(False, "flash_attn is not installed (flash-attn or MATE)")
    try:
        module = importlib.import_module("flash_attn")
    except Exception as exc:  # a build for another device fails to load its extension
        return FlashAttention(False, f"flash_attn does not import ({type(exc).__name__}: {exc})")
    if not callable(getattr(module, "flash_attn_varlen_func", None)):
        return FlashAttention(False, "flash_attn has no flash_attn_varlen_func")
    import transformers
    from transformers.utils import is_flash_attn_2_available

    version = getattr(module, "__version__", "?")
    if not is_flash_attn_2_available():
        return FlashAttention(
            False,
            f"flash_attn {version} imports, but transformers {transformers.__version__} does not "
            f"detect it on MUSA (it needs {_TRANSFORMERS_FLASH_ON_MUSA}, and flash-attn >= 2.3.3)",
        )
    where = Path(module.__file__ or "?").parent
    return FlashAttention(True, f"flash_attn {version} ({where}), variable-length kernels")


def default_attn_implementation(precision: str | None = None) -> str:
    """``"sdpa"``, except on MUSA: ``"eager"`` with a torch_musa older than v1.2.1 (its SDPA had
    no backward), ``"flash_attention_2"`` where flash-attention runs there
    (:func:`musa_flash_attention`) and the run computes in fp16 / bf16 (``precision``, the
    accelerate mixed precision; flash kernels take no fp32): packing without cross-talk and
    padding-free DPO / KTO / GRPO through its variable-length kernels, as under flash attention
    on CUDA. ``python -m recipes.env`` checks SDPA against eager on the device."""
    if backend() == MUSA:
        if not musa_sdpa_trains(torch_musa_info()["version"]):
            return "eager"
        if precision in ("bf16", "fp16") and musa_flash_attention().usable:
            return "flash_attention_2"
    return "sdpa"


def _fused_kernel_devices(found: tuple[int, int]) -> frozenset[str]:
    # torch/utils/_foreach_utils.py::_get_fused_kernels_supported_devices: torch 2.2 and 2.3 list
    # cuda, xpu and the PrivateUse1 backend; torch 2.4 adds cpu and mps. AdamW(fused=True)
    # checks its parameters against this list when it is built, not when it steps.
    kinds = {CUDA, "xpu", torch._C._get_privateuse1_backend_name()}
    if found >= (2, 4):
        kinds |= {CPU, "mps"}
    return frozenset(kinds)


def _has_fused_adamw_kernel(kind: str) -> bool:
    """Whether torch's ``_fused_adamw_`` has a kernel for an out-of-tree device type: torch_musa
    registers one for MUSA from v2.1.1 (``musa_functions.yaml``); before, AdamW(fused=True)
    builds on MUSA and fails at its first step."""
    if kind != torch._C._get_privateuse1_backend_name():
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_adamw_", "PrivateUse1")
    except RuntimeError:  # a torch without the operator
        return False


def fused_adamw_ok(
    target: torch.device | str,
    params_on: torch.device | str,
    release: tuple[int, int] | None = None,
) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` can be built where the parameters are now
    (``params_on``: the device, or the CPU where a launcher places the model later) and stepped
    on ``target``, under torch ``release`` (this torch's by default)."""
    # Device types as strings: "musa" only parses as a torch.device once torch_musa is loaded.
    target_kind, params_kind = (
        where.type if isinstance(where, torch.device) else str(where).partition(":")[0]
        for where in (target, params_on)
    )
    kinds = _fused_kernel_devices(torch_version() if release is None else release)
    if target_kind not in kinds or params_kind not in kinds:
        return False
    return target_kind in (CUDA, CPU) or _has_fused_adamw_kernel(target_kind)


def torch_fused_adamw_default(target: torch.device | str, params_on: torch.device | str) -> bool:
    """Whether ``optimizer.fused=null`` builds torch's ``AdamW(fused=True)``: where
    :func:`fused_adamw_ok`, except on MUSA. There torch_musa's ``FusedAdamW`` is the fused
    choice, and where it refuses (CPU parameters under FSDP up to v2.7.0) the foreach AdamW
    follows: the vendor's engineers found ``AdamW(fused=True)`` unsupported on MUSA (ms-swift
    PR #10224 turns it off for ``adamw_torch``). ``optimizer.fused=true`` still asks for it."""
    kind = torch.device(target).type if isinstance(target, torch.device) else str(target)
    return kind.partition(":")[0] != MUSA and fused_adamw_ok(target, params_on)


def musa_fused_adamw() -> type[torch.optim.Optimizer] | None:
    """torch_musa's ``FusedAdamW`` (v2.1.1 and later; the vendor's recommendation on MUSA), or
    None.

    It takes AdamW's hyper-parameters (no ``fused`` / ``foreach``) and keeps the same state
    (``step``, ``exp_avg``, ``exp_avg_sq``), so its checkpoints load into ``torch.optim.AdamW``.
    Up to v2.7.0 its constructor refuses parameters that are not on the MUSA device yet
    (``optim/fused_adamw.py``: "musa only"); v2.7.1 also takes CPU ones.
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

    torch_musa registers its dynamo device interface and inductor backend from v1.3.2
    (``torch_musa/_dynamo``, ``torch_musa/_inductor``); v1.3.0 has neither.
    """
    name = backend() if name is None else name
    if name != MUSA or (
        importlib.util.find_spec("torch_musa") is not None
        and importlib.util.find_spec("torch_musa._dynamo") is not None
    ):
        return None
    version = torch_musa_info()["version"] or "this version"
    return (
        f"torch_musa {version} has no torch.compile (dynamo/inductor) backend for MUSA; it "
        "first ships in torch_musa v1.3.2"
    )


def checkpointing_autocast_unsupported_reason(
    mixed_precision: str, name: str | None = None, release: tuple[int, int] | None = None
) -> str | None:
    """Why activation checkpointing cannot recompute under autocast here, or None when it can.

    Before torch 2.4, ``torch.utils.checkpoint`` asks the device module itself for the autocast
    state (``torch.musa.is_autocast_enabled`` / ``get_autocast_dtype``); torch_musa has them from
    v1.3.2 (v1.3.0 names them ``is_autocast_musa_enabled`` / ``get_autocast_musa_dtype``).
    Without them the backward pass recomputes each layer without autocast, in fp32, and torch's
    check of the recomputed tensors stops the run at its first backward.
    """
    name = backend() if name is None else name
    release = torch_version() if release is None else release
    if mixed_precision not in ("fp16", "bf16") or name != MUSA or release >= (2, 4):
        return None
    module = device_module(MUSA)
    if module is None or all(
        hasattr(module, attr) for attr in ("is_autocast_enabled", "get_autocast_dtype")
    ):
        return None
    version = torch_musa_info()["version"] or "this version"
    return (
        f"torch_musa {version} lacks torch.musa.is_autocast_enabled / get_autocast_dtype, which "
        f"torch {release[0]}.{release[1]}'s checkpointing calls (they arrive in torch_musa "
        f"v1.3.2), so the recomputed layers would run without {mixed_precision} autocast"
    )


DS_ACCELERATOR_ENV = "DS_ACCELERATOR"


def deepspeed_musa_accelerator() -> Path | None:
    """The installed DeepSpeed's MUSA accelerator module (``deepspeed/accelerator/
    musa_accelerator.py``, class ``MUSA_Accelerator``, as in deepspeedai/DeepSpeed PR #8191 and
    Moore Threads' builds), or None. Found on disk: importing DeepSpeed builds or loads its ops."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        module = Path(folder) / "accelerator" / "musa_accelerator.py"
        if module.is_file():
            return module
    return None


def deepspeed_unsupported_reason(name: str | None = None) -> str | None:
    """Why a DeepSpeed launch cannot train on this backend, or None where it can.

    Upstream DeepSpeed has no MUSA accelerator: its port (deepspeedai/DeepSpeed PR #8191, "add
    MUSA accelerator and op_builder") was closed unmerged. Moore Threads' own DeepSpeed (0.19.3
    in the training-suite:v2.1.7-rc4 image, 0.17.2 in earlier containers) ships one and is
    selected with ``DS_ACCELERATOR=musa``, which those images set. So: on MUSA, a DeepSpeed with
    that module and ``DS_ACCELERATOR=musa`` runs (conf/accelerate/zero*_musa.yaml); any other is
    refused, in one line that names what is missing.
    """
    if (backend() if name is None else name) != MUSA:
        return None
    if importlib.util.find_spec("deepspeed") is None:
        return (
            "DeepSpeed is not installed: on MUSA it needs MT DeepSpeed (Moore Threads' build, in "
            "its training images, run with DS_ACCELERATOR=musa; upstream's port, "
            "deepspeedai/DeepSpeed PR #8191, was closed unmerged)"
        )
    module = deepspeed_musa_accelerator()
    if module is None:
        return (
            "the installed DeepSpeed has no MUSA accelerator (deepspeed/accelerator/"
            "musa_accelerator.py): upstream DeepSpeed has none (its port, deepspeedai/DeepSpeed "
            "PR #8191, was closed unmerged); Moore Threads' build, in its training images, has it"
        )
    chosen = os.environ.get(DS_ACCELERATOR_ENV)
    if chosen != MUSA:
        return (
            f"the installed DeepSpeed has a MUSA accelerator, but {DS_ACCELERATOR_ENV}="
            f"{chosen or '(unset)'}: set {DS_ACCELERATOR_ENV}=musa in the launch's environment, "
            "as Moore Threads' training images do"
        )
    return None


@dataclass(frozen=True)
class Default:
    """A ``trainer.*`` setting decided by the device when the recipe leaves it null."""

    name: str  # the TrainerConfig field
    value: Any
    why: str


# Lengths are rounded up to this on an accelerator: at most max_length / 64 distinct shapes (6 for
# SQuAD's 384), so kernels, their heuristics and the allocator's blocks are reused from the
# first steps on, at under 64 padding tokens a row.
ACCELERATOR_LENGTH_BUCKET = 64


def training_defaults(
    kind: str, *, generates: bool, whole_model: bool, musa_version: str | None = None
) -> tuple[Default, ...]:
    """The speed settings of the loop for a device kind (``cpu``, ``cuda``, ``musa``): padding,
    the length multiple, sub-batches, pinned memory and ``torch.compile``; the optimizer's fused
    kernel is :func:`fused_adamw_ok`'s call (``optimizer.fused=null``).

    ``generates``: the task generates text (a compiled forward would recompile for every KV-cache
    length); ``whole_model``: one device or DDP (FSDP and DeepSpeed wrap the model after it would
    be compiled); ``musa_version``: the torch_musa release, for its compile support.

    A CPU keeps what won there (docs/results.md, ``scripts/throughput.py qa``): each padded
    token costs a CPU its full price and a new shape nothing, so batches are padded to their own
    longest and split into sub-batches of similar lengths. A GPU is the other way round: on an
    H200 four sub-batches ran bert-large 5.7x slower than one (docs/results.md, "GPU check"),
    because each new shape pays first-call costs and each sub-batch its own launches and
    weight casts, so batches run whole, in a few length buckets.
    """
    if kind == CPU:
        return (
            Default("padding", "longest", "a CPU pays for every padding token"),
            Default("pad_to_multiple_of", 8, "lengths rounded to 8"),
            Default(
                "sub_batches",
                4,
                "sub-batches of similar lengths pad less, faster on a CPU (docs/results.md)",
            ),
            Default("pin_memory", False, "no copy to a device"),
            Default("compile", False, "compiling costs a CPU more than a short run saves"),
        )
    compiled, compile_why = _compile_default(kind, generates, whole_model, musa_version)
    return (
        Default("padding", "longest", "each batch to its longest row, in length buckets"),
        Default(
            "pad_to_multiple_of",
            ACCELERATOR_LENGTH_BUCKET,
            "length buckets: few shapes, so kernels and memory blocks are reused",
        ),
        Default(
            "sub_batches",
            1,
            "each micro-batch whole: sub-batches multiply launches and new shapes (5.7x slower "
            "on an H200, docs/results.md)",
        ),
        Default("pin_memory", True, "page-locked batches copy while the device computes"),
        Default("compile", compiled, compile_why),
    )


def _compile_default(
    kind: str, generates: bool, whole_model: bool, musa_version: str | None
) -> tuple[bool, str]:
    """Whether ``torch.compile`` is on by default on an accelerator, and why."""
    if kind == MUSA:
        if compile_unsupported_reason(MUSA) is not None:
            return False, f"torch_musa {musa_version or '(this release)'} has no compile backend"
        found = None if musa_version is None else _release(musa_version)
        if found is not None and found >= _MUSA_COMPILE_SLOWER:
            return False, (
                f"torch_musa {musa_version}: compiled kernels are slower than v2.7.0's (a known "
                "issue in the v2.9.0 release notes)"
            )
        return False, "not measured on a MUSA card"
    if generates:
        return False, "generation would recompile the model for every KV-cache length"
    if not whole_model:
        return False, "FSDP and DeepSpeed wrap the model after it would be compiled"
    return True, "1.44x faster on bert-large on an H200 (docs/results.md); the first steps compile"


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
    """Turn TF32 for fp32 matmuls and convolutions on or off; returns whether it is now on
    (read back from the backend, for MFU).

    Both ways matter: torch_musa 2.7 enables TF32 by default (``allow_tf32_ = true`` in
    ``csrc/aten/utils/Context.h``; false up to 2.5), so ``trainer.tf32=false`` must switch it off.
    On MUSA every switch the release has is set (:func:`musa_tf32_switches`): from v2.9 GEMMs
    read ``torch.backends.musa.matmul.allow_tf32``, and muDNN keeps its own.
    """
    name = backend()
    if name == MUSA:
        for switch in musa_tf32_switches(torch_musa_info()["version"]):
            owner = _switch_owner(switch)
            if owner is not None:
                owner.allow_tf32 = enabled
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
        # The first switch is the one the release's GEMMs read (the override forces it on).
        version = torch_musa_info()["version"]
        if musa_tf32_override(version):
            return True
        owner = _switch_owner(musa_tf32_switches(version)[0])
        return bool(getattr(owner, "allow_tf32", False))
    if name == CUDA:
        if _has_fp32_precision():
            return torch.backends.cuda.matmul.fp32_precision == "tf32"
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return False


def tf32_switches(name: str | None = None) -> tuple[str, ...]:
    """The switches :func:`set_tf32` sets on a backend (:func:`backend` by default), the one
    its matmuls read first; none on cpu."""
    name = backend() if name is None else name
    if name == MUSA:
        return musa_tf32_switches(torch_musa_info()["version"])
    if name == CUDA:
        if _has_fp32_precision():
            return (
                "torch.backends.cuda.matmul.fp32_precision",
                "torch.backends.cudnn.conv.fp32_precision",
            )
        return ("torch.backends.cuda.matmul.allow_tf32", "torch.backends.cudnn.allow_tf32")
    return ()


def musa_tf32_switches(version: str | None) -> tuple[str, ...]:
    """The TF32 switches a torch_musa release reads, the one its GEMMs read first:
    ``torch.backends.musa.matmul.allow_tf32`` then muDNN's from v2.9.0 (off by default),
    ``torch.backends.mudnn.allow_tf32`` alone before."""
    found = None if version is None else _release(version)
    if found is not None and found >= _MUSA_MATMUL_TF32_SWITCH:
        return (_MUSA_MATMUL_TF32, _MUDNN_TF32)
    return (_MUDNN_TF32,)


def _switch_owner(switch: str) -> Any:
    """The object whose ``allow_tf32`` a switch's dotted name ends in; None where this build
    lacks it."""
    owner: Any = torch
    for part in switch.split(".")[1:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def musa_tf32_override(version: str | None) -> bool:
    """Whether ``TORCH_ALLOW_TF32_MUBLAS_OVERRIDE=1`` turns TF32 on for this release's GEMMs
    (v2.9.0 and later), whatever ``torch.backends.musa.matmul.allow_tf32`` says."""
    switches = musa_tf32_switches(version)
    return _MUSA_MATMUL_TF32 in switches and os.environ.get(MUBLAS_TF32_OVERRIDE) == "1"


def tf32_unsupported_reason(enabled: bool, name: str | None = None) -> str | None:
    """Why ``trainer.tf32`` cannot take effect here, or None: ``false`` with
    ``TORCH_ALLOW_TF32_MUBLAS_OVERRIDE=1`` on a torch_musa that reads it (GEMMs stay in TF32)."""
    name = backend() if name is None else name
    version = torch_musa_info()["version"] if name == MUSA else None
    if enabled or name != MUSA or not musa_tf32_override(version):
        return None
    return (
        f"{MUBLAS_TF32_OVERRIDE}=1 is set, which turns TF32 on for every GEMM of torch_musa "
        f"{version}"
    )


def fsdp2_overlap_unsupported_reason(name: str | None = None) -> str | None:
    """Why ``TORCH_MUSA_FSDP2_OVERLAP_LEVEL`` (set in the launch's environment) would not apply
    here, or None where it is unset or this torch_musa reads it (v2.7.1 and later, 0 to 4)."""
    value = os.environ.get(FSDP2_OVERLAP_ENV)
    name = backend() if name is None else name
    if value is None or name != MUSA:
        return None
    version = torch_musa_info()["version"]
    found = None if version is None else _release(version)
    if found is None or found < _MUSA_FSDP2_OVERLAP:
        return (
            f"torch_musa {version or '(unknown version)'} does not read it (torch_musa v2.7.1 "
            "is the first that does): unset it, or use a MUSA image with v2.7.1 or later"
        )
    if not value.strip().isdigit() or int(value) not in _FSDP2_OVERLAP_LEVELS:
        return "torch_musa takes a level from 0 (no overlap, its default) to 4: set one of those"
    return None


def default_adamw(name: str | None = None) -> str:
    """The AdamW ``optimizer.fused=null`` builds for parameters on a backend's device
    (:func:`recipes.optim.build_optimizer`'s choice), as the environment doctor reports it."""
    name = backend() if name is None else name
    if name == MUSA and musa_fused_adamw() is not None:
        return "torch_musa.optim.FusedAdamW"
    if name != CPU and device_module(name) is None:
        return "torch.optim.AdamW (foreach)"
    return (
        "torch.optim.AdamW(fused=True)"
        if torch_fused_adamw_default(name, name)
        else "torch.optim.AdamW (foreach)"
    )


def _module_for(device: torch.device | str) -> tuple[torch.device, types.ModuleType | None]:
    device = torch.device(device)
    return device, device_module(device.type)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that wall-clock timings are honest (cpu: no-op)."""
    device, module = _module_for(device)
    sync = getattr(module, "synchronize", None)
    if sync is not None:
        sync(device)


def max_memory_allocated(device: torch.device) -> int | None:
    """Peak bytes allocated by tensors on the device since :func:`reset_peak_memory_stats`;
    None on cpu."""
    device, module = _module_for(device)
    getter = getattr(module, "max_memory_allocated", None)
    return None if getter is None else int(getter(device))


def reset_peak_memory_stats(device: torch.device) -> None:
    """Start a new peak-memory window on the device (cpu: no-op)."""
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
        # S5000: only the press figure of about 1,000 dense FP8 TFLOPS (920 air-cooled); see
        # _PEAK_NOTES for what is not published.
        (r"\bS5000\b", _tflops(fp8=1000)),
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

# What a vendor does not publish for a device in the table, said wherever its MFU is missing
# (the doctor, the run's log) rather than filled with a guess.
_PEAK_NOTES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), note)
    for pattern, note in (
        (
            r"\bS5000\b",
            "Moore Threads publishes only an FP8 figure for the MTT S5000 (about 1,000 dense "
            "TFLOPS, press figures); no fp32, TF32, fp16 or bf16 peak, so MFU is not reported in "
            "those precisions",
        ),
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


def peak_flops_basis(name: str, dtype: str) -> str | None:
    """Which column of the peak table a device's peak for ``dtype`` is read from: the dtype's
    own, ``"fp32"`` where the device has no figure of its own for it, None where none applies.

    Without TF32 units, "TF32 enabled" matmuls run at the fp32 rate. Moore Threads publishes no
    fp16 figure for the MTT S80 / S3000, whose default precision is fp16: half precision runs at
    least at the fp32 rate, so the fp32 figure bounds their peak from below and MFU from above.
    An unknown dtype raises ValueError: that is a caller bug, not a device gap.
    """
    key = _DTYPE_ALIASES.get(dtype.lower())
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}")
    for pattern, figures in _PEAK_FLOPS:
        if pattern.search(name):
            if key in figures:
                return key
            return "fp32" if key in ("tf32", "fp16") and "fp32" in figures else None
    return None


def peak_flops_by_name(name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a device named as its driver names it (``"MTT S4000"``,
    ``"NVIDIA A100-SXM4-80GB"``) for ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``
    (or the long names), from the column :func:`peak_flops_basis` names; None when the device
    or the dtype is not in the table (not guessed)."""
    basis = peak_flops_basis(name, dtype)
    if basis is None:
        return None
    return next(figures[basis] for pattern, figures in _PEAK_FLOPS if pattern.search(name))


def peak_flops_note(name: str) -> str | None:
    """What the peak table lacks for a device because its vendor does not publish it (the MTT
    S5000's bf16 peak); None for devices without such a gap."""
    return next((note for pattern, note in _PEAK_NOTES if pattern.search(name)), None)


def device_name(device: torch.device) -> str | None:
    """The driver's name of the device the model runs on (``"MTT S4000"``); None on cpu."""
    device, module = _module_for(device)
    if module is None or not hasattr(module, "get_device_name"):
        return None
    index = device.index if device.index is not None else module.current_device()
    return str(module.get_device_name(index))


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak dense FLOP/s of the device the model runs on, for MFU; None on cpu and for devices
    not in the table."""
    name = device_name(device)
    return None if name is None else peak_flops_by_name(name, dtype)


def mccl_available() -> bool:
    """Whether torch_musa registered the ``mccl`` backend (S4000 / S5000 builds; S80/S3000
    builds ship without it).

    Read from ``torch.distributed.Backend.backend_list``, which ``register_backend`` extends only
    in builds with MCCL: ``dist.is_backend_available("mccl")`` resolves to torch_musa's patched
    ``is_mccl_available``, a constant True (``torch_patches/torch_distributed_distributed_c10d``).
    """
    if not torch_musa_info()["imported"]:
        return False
    import torch.distributed as dist

    return dist.is_available() and MCCL in getattr(dist.Backend, "backend_list", [])


def distributed_backend() -> tuple[str | None, str]:
    """The collective backend a multi-process run here would use (``"mccl"`` on MUSA, ``"nccl"``
    on CUDA, ``"gloo"`` on cpu; None when it is missing) and a short sentence saying why, which
    says what to do instead when there is none."""
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


# --- the process environment a run sets before the device runtime starts ---

# Device-hiding variables each backend's runtime reads when it initialises.
VISIBLE_DEVICES_ENV = {MUSA: "MUSA_VISIBLE_DEVICES", CUDA: "CUDA_VISIBLE_DEVICES"}
# The caching allocator's settings per backend, and torch >= 2.9's name for every backend.
ALLOC_CONF_ENV = {MUSA: "PYTORCH_MUSA_ALLOC_CONF", CUDA: "PYTORCH_CUDA_ALLOC_CONF"}
GENERIC_ALLOC_CONF_ENV = "PYTORCH_ALLOC_CONF"
# What training runs get where the user set none: segments that grow in place instead of new
# blocks per new size, so the varying batch shapes of a run fragment less. The vendor's engineers
# run it on MUSA (ms-swift PR #10224's MUSA backend and its S5000 page), as does the NVIDIA side of
# torch's own memory notes for variable shapes.
EXPANDABLE_SEGMENTS = "expandable_segments:True"
_environment_notes: list[str] = []


def installed_backend() -> str:
    """The accelerator this Python is set up for, asked without starting a device runtime: MUSA
    where torch_musa is installed, CUDA where torch is a CUDA build, else cpu."""
    if importlib.util.find_spec("torch_musa") is not None:
        return MUSA
    return CUDA if getattr(torch.version, CUDA, None) else CPU


def derived_visible_devices(environ: dict[str, str] | os._Environ, name: str) -> str | None:
    """The ``MUSA_VISIBLE_DEVICES`` a MUSA host takes from ``CUDA_VISIBLE_DEVICES`` where only
    that one is set (as ms-swift's launchers do: scripts written for CUDA keep choosing the
    cards), None where there is nothing to derive."""
    musa, cuda = VISIBLE_DEVICES_ENV[MUSA], VISIBLE_DEVICES_ENV[CUDA]
    if name != MUSA or musa in environ or cuda not in environ:
        return None
    return environ[cuda]


def sync_visible_devices(
    environ: dict[str, str] | os._Environ = os.environ, name: str | None = None
) -> str | None:
    """Set ``MUSA_VISIBLE_DEVICES`` from ``CUDA_VISIBLE_DEVICES`` (:func:`derived_visible_devices`)
    before torch_musa starts its runtime, which reads it once; the line that says so, or None.
    ``name``: the installed backend (:func:`installed_backend` by default)."""
    value = derived_visible_devices(environ, installed_backend() if name is None else name)
    if value is None:
        return None
    environ[VISIBLE_DEVICES_ENV[MUSA]] = value
    note = (
        f"{VISIBLE_DEVICES_ENV[MUSA]}={value} (taken from {VISIBLE_DEVICES_ENV[CUDA]}, the only "
        "one set: torch_musa reads only its own)"
    )
    _environment_notes.append(note)
    return note


def allocator_setting(
    name: str, environ: dict[str, str] | os._Environ = os.environ
) -> tuple[str, str | None, bool] | None:
    """The allocator variable of a backend, its value and whether the user set it (theirs or
    torch's generic ``PYTORCH_ALLOC_CONF``); None on cpu."""
    variable = ALLOC_CONF_ENV.get(name)
    if variable is None:
        return None
    for given in (variable, GENERIC_ALLOC_CONF_ENV):
        if given in environ:
            return given, environ[given], True
    return variable, None, False


def prepare_environment(
    training: bool, environ: dict[str, str] | os._Environ = os.environ, name: str | None = None
) -> list[str]:
    """What a run sets in its environment before its device runtime and allocator start, one
    line each for its log: the visible devices derived on MUSA, and for training the allocator's
    expandable segments unless the user set the allocator.

    torch_musa, as torch.cuda, starts its runtime and caching allocator lazily (its
    ``core/_lazy_init``; at import it reads only ``PYTORCH_MUSA_ALLOC_CONF``'s ``cpu:unified``),
    so this runs before the first device query, not before ``import torch``.
    """
    name = installed_backend() if name is None else name
    sync_visible_devices(environ, name)
    lines = list(_environment_notes)
    _environment_notes.clear()
    found = allocator_setting(name, environ) if training else None
    if found is not None:
        variable, value, by_user = found
        if by_user:
            lines.append(f"{variable}={value} (set by the user)")
        else:
            environ[variable] = EXPANDABLE_SEGMENTS
            lines.append(
                f"{variable}={EXPANDABLE_SEGMENTS} (the training default: fewer fragments from "
                f"varying batch shapes; set {variable} to choose another)"
            )
    return lines


# --- what scripts ask about the device ---


def hidden_devices_env() -> dict[str, str]:
    """The variables that hide every accelerator from a child process (its runs on the CPU)."""
    return dict.fromkeys(VISIBLE_DEVICES_ENV.values(), "")


def profiler_activity(name: str | None = None) -> Any:
    """The ``torch.profiler.ProfilerActivity`` of a backend's kernels (:func:`backend` by
    default): CUDA's, or PrivateUse1's for an out-of-tree device such as MUSA; None on cpu."""
    name = backend() if name is None else name
    activity = torch.profiler.ProfilerActivity
    if name == CPU:
        return None
    if name == CUDA or not hasattr(activity, "PrivateUse1"):
        return activity.CUDA
    return activity.PrivateUse1

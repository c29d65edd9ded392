"""What the environment doctor (:mod:`recipes.env`) knows about MUSA and CUDA hosts.

Training never needs these facts: kernel drivers, vendor tools, device-hiding variables,
collective backends, which torch each torch_musa release is built against, and the GPU family
a vendor image is built for. They let the doctor say why a machine sees no device and what to
install; :mod:`recipes.device` answers what training asks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

from recipes import device
from recipes.device import CUDA, MUSA

# Environment variables that hide or expose devices; a stray empty value is the most common
# reason a container sees no accelerator.
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

# Where torch_musa wheels and the images that ship them come from (not on PyPI).
TORCH_MUSA_RELEASES_URL = "https://github.com/MooreThreads/torch_musa/releases"
MUSA_IMAGE = "registry.mthreads.com/mcconline/musa-pytorch-release-public:<tag>"

# The torch each torch_musa release is built against, and the oldest it imports with, as each
# tag's torch_musa/__init__.py checks them: it raises below ``TORCH_MIN_VERSION`` (compared by
# base version, so 2.2.0a0 counts as 2.2.0) and warns unless the build's version string is in
# ``torch.__version__``. Rows: (release as Moore Threads names it, the version prefix it reports,
# built against, TORCH_MIN_VERSION). v2.0.0 and v2.0.0-pt25 both report ``2.0.0+<sha>`` (setup.py
# writes version.txt plus the commit), so 2.0 maps to two torch releases and either one matches.
_TORCH_MUSA_BUILDS: tuple[tuple[str, tuple[int, int], str, str], ...] = (
    ("v1.0-v1.2", (1, 0), "2.0.0", "2.0.0"),
    ("v1.0-v1.2", (1, 1), "2.0.0", "2.0.0"),
    ("v1.0-v1.2", (1, 2), "2.0.0", "2.0.0"),
    ("v1.3.x", (1, 3), "2.2.0", "2.0.0"),
    ("v2.0.x", (2, 0), "2.2.0", "2.0.0"),
    ("v2.0.0-pt25", (2, 0), "2.5.0", "2.5.0"),
    ("v2.1.x", (2, 1), "2.5.0", "2.5.0"),
    ("v2.5.0", (2, 5), "2.5.0", "2.5.0"),
    ("v2.7.x", (2, 7), "2.7.1", "2.7.1"),
    # Releases without a readable tag: the torch each release note names ("Along with torch2.9.0",
    # tag v2.9.0; "the first release based on PyTorch 2.11", 2.11.0.post1), and that torch as the
    # oldest, as at every tag from v2.1.
    ("v2.9.x", (2, 9), "2.9.0", "2.9.0"),
    ("2.11.x", (2, 11), "2.11.0", "2.11.0"),
    # Reported, unconfirmed (LATE_MUSA_RELEASES): the torch its name carries.
    ("2.13.x (reported, unconfirmed)", (2, 13), "2.13.0", "2.13.0"),
)


@dataclass(frozen=True)
class LateRelease:
    """A torch_musa release published without a tag or notes: what changed that a run here can
    see, the vllm-musa line that pins it (to serve what was trained), and where that was read."""

    name: str  # as its pull request or pin names it
    changes: str
    vllm_musa: str | None  # the vllm-musa release line pinning it; None where none is known
    sdk: str | None
    confirmed: bool
    source: str


# Newest first. torchada (the torch.cuda-on-MUSA layer vllm-musa depends on) overrides
# aten::log, log_ and multinomial on torch_musa before 2.11.0.post2 and leaves them to
# torch_musa from it (torchada PR #106; #113 adds float64 log_ in place, which older releases
# refuse).
LATE_MUSA_RELEASES: tuple[LateRelease, ...] = (
    LateRelease(
        "2.13.0.post1",
        "reported as the reference stack of the vllm-musa 0.32 line (with MUSA SDK 5.2.0); no "
        "tag, pull request or notes found",
        "v0.32",
        "5.2.0",
        False,
        "issue 57 (no public source found)",
    ),
    LateRelease(
        "2.11.0.post2",
        "its own kernels provide log / log_ (float64 in place too), so torchada stops "
        "overriding log, log_ and multinomial",
        "v0.28",
        "5.2.0",
        True,
        "torch_musa PR #155 (2026-09-21); torchada PRs #106 and #113; vllm-musa "
        "requirements/musa_private.txt (torch_musa==2.11.0.post2+musa5.2.0, torchada 0.1.95 "
        "per issue 57)",
    ),
    LateRelease(
        "2.9.1.post1",
        "no notes; still no log / log_ kernels of its own (torchada keeps overriding them)",
        None,
        None,
        True,
        "torch_musa PR #144; torchada PR #106 (its boundary is 2.11.0.post2)",
    ),
)


def late_musa_release(version: str | None) -> LateRelease | None:
    """The :data:`LATE_MUSA_RELEASES` row of a torch_musa version (``"2.11.0.post2+musa5.2.0"``),
    None for any other."""
    if not version:
        return None
    try:
        public = Version(version.lstrip("v")).public
    except InvalidVersion:
        return None
    return next((row for row in LATE_MUSA_RELEASES if Version(row.name).public == public), None)


def vllm_musa_for_torch_musa(version: str | None) -> str:
    """Which vllm-musa release serves with a torch_musa version, in one sentence (the doctor's)."""
    row = late_musa_release(version)
    if row is not None and row.vllm_musa is not None:
        sure = "" if row.confirmed else " (reported, unconfirmed)"
        return (
            f"vllm-musa {row.vllm_musa}{sure}: it pins torch_musa {row.name} (MUSA SDK {row.sdk})"
        )
    pinned = next(r for r in LATE_MUSA_RELEASES if r.confirmed and r.vllm_musa)
    return (
        f"no vllm-musa release is known to pin torch_musa {version or '(none installed)'}; "
        f"vllm-musa {pinned.vllm_musa} pins {pinned.name} (MUSA SDK {pinned.sdk}): serve "
        "from that image"
    )


# The Dockerfile passes its base image on; the vendor's tags name the GPU family they are built
# for (``rc3.1.0-v1.3.0-S4000-py310``).
BASE_IMAGE_ENV_VAR = "RECIPES_BASE_IMAGE"


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"v?(\d+)\.(\d+)", version.strip())
    return None if match is None else (int(match[1]), int(match[2]))


def _builds(version: str) -> list[tuple[str, str]]:
    """(built against, TORCH_MIN_VERSION) of the releases a torch_musa version may be."""
    key = _major_minor(version)
    found = [(built, low) for _, release, built, low in _TORCH_MUSA_BUILDS if release == key]
    if "pt25" in version:
        found = [(built, low) for built, low in found if built == "2.5.0"]
    return found


def torch_for_torch_musa(version: str) -> tuple[str, ...]:
    """The torch releases a torch_musa ``__version__`` (``"2.0.0+8b583b3"``) or release name
    (``"v2.0.0-pt25"``) may be built against: ``("2.2.0",)``, both for a 2.0 build that does not
    say which, empty for a release not in the table (not guessed)."""
    return tuple(dict.fromkeys(built for built, _ in _builds(version)))


def torch_musa_minimum_torch(version: str) -> str | None:
    """The oldest torch a torch_musa version imports with (its ``TORCH_MIN_VERSION``; the lower
    one where the version string does not say which build it is); None when not in the table."""
    lows = [low for _, low in _builds(version)]
    return min(lows, key=Version) if lows else None


def torch_base_version(torch_version: str) -> Version:
    """``2.2.0`` of a vendor build's ``2.2.0a0+git8ac9b20``: what torch_musa compares."""
    return Version(Version(torch_version).base_version)


def torch_musa_releases_for_torch(torch_version: str) -> list[str]:
    """The torch_musa releases built for a torch's major.minor that also import with it (not
    below their ``TORCH_MIN_VERSION``: v2.7.x refuses torch 2.7.0), e.g. ``["v1.3.x",
    "v2.0.x"]``; empty when none is."""
    key = _major_minor(torch_version)
    have = torch_base_version(torch_version)
    releases = [
        label
        for label, _, built, low in _TORCH_MUSA_BUILDS
        if _major_minor(built) == key and have >= Version(low)
    ]
    return list(dict.fromkeys(releases))


def torches_with_torch_musa() -> list[str]:
    """Every torch release some torch_musa release is built against, oldest first."""
    return sorted({built for _, _, built, _ in _TORCH_MUSA_BUILDS}, key=Version)


def image_gpu(image: str | None) -> str | None:
    """The GPU family a MUSA image tag is built for (``"S4000"``, ``"S80"``), None if unnamed."""
    if not image:
        return None
    tag = image.rpartition(":")[2]
    match = re.search(r"(?:^|-)(S\d{2,4})(?:-|$)", tag, re.IGNORECASE)
    return None if match is None else match[1].upper()


def torch_accelerator_build() -> str | None:
    """The GPU toolkit this torch was built with (``"CUDA 12.1"``, ``"ROCm 6.0"``); None for a
    CPU-only build, which is normal on MUSA hosts (torch_musa extends a CPU torch)."""
    cuda = getattr(torch.version, CUDA, None)
    if cuda:
        return f"CUDA {cuda}"
    hip = getattr(torch.version, "hip", None)
    return f"ROCm {hip}" if hip else None


def kernel_modules_loaded() -> dict[str, bool | None]:
    """Per backend, whether its vendor kernel driver is loaded; None where ``/sys/module``
    cannot be read (not Linux)."""
    if not os.path.isdir(_SYS_MODULE):
        return dict.fromkeys(KERNEL_MODULES)
    return {
        name: os.path.isdir(os.path.join(_SYS_MODULE, module))
        for name, module in KERNEL_MODULES.items()
    }


def accelerate_sees_musa() -> bool | None:
    """accelerate's own answer to "is there a MUSA device"; None when this accelerate predates
    MUSA support (< 0.33) or cannot be imported."""
    # accelerate imports torch_musa itself (even at ``import accelerate``), so a broken
    # torch_musa surfaces here as any exception, not only ImportError.
    try:
        from accelerate.utils import is_musa_available

        return bool(is_musa_available())
    except Exception:
        return None


def device_total_memory(index: int = 0) -> int | None:
    """Bytes of memory of one device; None on cpu or when the device does not exist."""
    module = device.device_module()
    if module is None or index >= device.device_count():
        return None
    return int(module.get_device_properties(index).total_memory)


def accelerate_distributed_type(num_processes: int, name: str) -> str:
    """accelerate's ``distributed_type`` for a local launch of ``num_processes`` on a backend:
    ``"NO"`` for one process, else ``"MULTI_MUSA"``, ``"MULTI_GPU"`` or ``"MULTI_CPU"``."""
    if num_processes <= 1:
        return "NO"
    return {MUSA: "MULTI_MUSA", CUDA: "MULTI_GPU"}.get(name, "MULTI_CPU")


def visible_devices_env() -> dict[str, Any]:
    """The device-hiding variables as this process sees them (None where unset)."""
    return {var: os.environ.get(var) for var in VISIBLE_DEVICES_ENV_VARS}

"""Stand-ins for torch_musa releases, for testing MUSA decisions on a machine without MUSA.

Each release is written as an importable ``torch_musa`` package (plus its distribution metadata)
with the layout, ``torch.musa`` functions, version string and defaults read in that tag of
github.com/MooreThreads/torch_musa:

- ``__version__``: setup.py's dump_version writes version.txt + "+" + the first 7 hex digits of
  the commit it builds (here the tag's), so v2.0.0 and v2.0.0-pt25 both report ``2.0.0+<sha>``.
- ``torch.backends.mudnn.allow_tf32``: csrc/aten/utils/Context.h, false up to v2.5.0, true in
  v2.7.x.
- ``torch_musa._dynamo`` (the torch.compile backend): from v1.3.2.
- ``torch.musa.is_autocast_enabled`` / ``get_autocast_dtype`` (what torch 2.2's checkpointing
  calls): v1.3.2 to v2.5.0; v1.3.0 has ``is_autocast_musa_enabled`` / ``get_autocast_musa_dtype``;
  v2.7.x has neither (torch >= 2.4 keeps the autocast state itself).
- ``torch.musa.get_amp_supported_dtype()``: fp16, bf16 and fp32 whatever the card up to v2.5.0;
  v2.7.x lists bf16 only on cards of capability 2.2 or more (S4000).
- ``torch_musa.optim.FusedAdamW``: from v2.1.1; state ``step`` (a CPU float32 tensor),
  ``exp_avg``, ``exp_avg_sq``, and ``fused: True`` in its groups (optim/fused_adamw.py). Its
  constructor refuses parameters on any device but MUSA up to v2.7.0 ("musa only"); v2.7.1 also
  takes CPU ones.
- torch's own ``_fused_adamw_`` registered for MUSA (csrc/aten/ops/musa_functions.yaml): from
  v2.1.1.
- MCCL: ``Backend.register_backend("mccl", ...)`` runs only in builds with MCCL (the S4000's;
  ``USE_MCCL`` in Module.cpp), while the patched ``torch.distributed.is_mccl_available``
  returns a constant True in every build (torch_patches/torch_distributed_distributed_c10d).
- the ``torch.backends`` entry point (torch loads it on ``import torch``): from v2.0.0-pt25.
- ``TORCH_MUSA_FSDP2_OVERLAP_LEVEL`` read (an int below 5, asserted) when torch_musa is imported:
  from v2.7.1 (distributed/_composable/fsdp/custom_overlap_patch.py).

Releases without a readable tag (v2.9.0, v2.9.1, 2.11.0.post1; 2.9.1.post1, 2.11.0.post2 and the
unconfirmed 2.13.0.post1 from their pull requests and pins, see ``recipes/backends.py``'s
``LATE_MUSA_RELEASES``) are written from their release notes
(github.com/MooreThreads/torch_musa/releases): ``__version__`` from the commit each release
page names (the wheel's version where a pin names it, none where nothing does); GEMMs in FP32 by default, in TF32 only with ``torch.backends.musa.matmul.allow_tf32``
or ``TORCH_ALLOW_TF32_MUBLAS_OVERRIDE=1`` (v2.9.0's notes). What the notes do not mention is
kept as at v2.7.1 (FusedAdamW for musa and cpu, the autocast names, the entry point), and
``torch.backends.mudnn.allow_tf32`` stays (for muDNN's kernels), off as the GEMMs' switch.
``torch.musa._gemm_tf32()`` says whether a GEMM of the release would run in TF32 now: the switch
the release reads, which the project never calls (tests ask it).

The devices are simulated (cards of the given name and capability; the indices whose
capability or properties are read are kept in ``torch.musa.queried``); tensors cannot be moved
to them, which is what a broken build looks like to the doctor's SDPA check. With
``emulated=True`` the same release runs on the emulated device instead (``tests/musa_emulator``):
cards that hold tensors and run every operator, as ``scripts/emulated_musa.py`` uses it.
"""

from __future__ import annotations

import atexit
import json
import os
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Release:
    tag: str
    version: str  # torch_musa.__version__ as that tag's setup.py writes it
    tf32_default: bool
    has_dynamo: bool
    fused_adamw: tuple[str, ...]  # the devices FusedAdamW's constructor takes; () for none
    fused_adamw_kernel: bool  # torch's _fused_adamw_ registered for MUSA
    autocast_names: str  # "musa": is_autocast_musa_enabled...; "plain": is_autocast_enabled...
    autoload_entry_point: bool
    amp_bf16_by_capability: bool = False  # get_amp_supported_dtype() asks the card
    matmul_tf32_switch: bool = False  # GEMMs read torch.backends.musa.matmul.allow_tf32 (v2.9+)
    fsdp2_overlap_env: bool = False  # reads TORCH_MUSA_FSDP2_OVERLAP_LEVEL at import (v2.7.1+)

    @property
    def parts(self) -> tuple[int, int, int]:
        """``(2, 11, 0)`` of ``2.11.0.post1``: the release, for comparisons."""
        major, minor, patch = self.tag.lstrip("v").split(".")[:3]
        return int(major), int(minor), int(patch)


MUSA_ONLY = ("musa",)
MUSA_CPU = ("musa", "cpu")


def _since_v2_7_1(tag: str, version: str, *, tf32_default: bool, gemm_switch: bool) -> Release:
    return Release(
        tag, version, tf32_default, True, MUSA_CPU, True, "none", True, True, gemm_switch, True
    )


RELEASES = {
    "v1.3.0": Release("v1.3.0", "1.3.0+73c9f5b", False, False, (), False, "musa", False),
    "v1.3.2": Release("v1.3.2", "1.3.2+af1592c", False, True, (), False, "plain", False),
    "v2.0.0": Release("v2.0.0", "2.0.0+8c8e412", False, True, (), False, "plain", False),
    "v2.5.0": Release("v2.5.0", "2.5.0+0dbf6f1", False, True, MUSA_ONLY, True, "plain", True),
    "v2.7.0": Release("v2.7.0", "2.7.0+7a6f07a", True, True, MUSA_ONLY, True, "none", True, True),
    "v2.7.1": _since_v2_7_1("v2.7.1", "2.7.1+0bc05bf", tf32_default=True, gemm_switch=False),
    "v2.9.0": _since_v2_7_1("v2.9.0", "2.9.0+1dc7872", tf32_default=False, gemm_switch=True),
    "v2.9.1": _since_v2_7_1("v2.9.1", "2.9.1+467bb87", tf32_default=False, gemm_switch=True),
    "2.11.0.post1": _since_v2_7_1(
        "2.11.0.post1", "2.11.0.post1+246d43e", tf32_default=False, gemm_switch=True
    ),
    # PR #144: no notes and no commit named, so no local version part.
    "2.9.1.post1": _since_v2_7_1(
        "2.9.1.post1", "2.9.1.post1", tf32_default=False, gemm_switch=True
    ),
    # PR #155; the version of the wheel vllm-musa v0.28 pins (requirements/musa_private.txt).
    "2.11.0.post2": _since_v2_7_1(
        "2.11.0.post2", "2.11.0.post2+musa5.2.0", tf32_default=False, gemm_switch=True
    ),
    # Reported for the vllm-musa 0.32 line, unconfirmed: no tag, PR or notes found.
    "2.13.0.post1": _since_v2_7_1(
        "2.13.0.post1", "2.13.0.post1+musa5.2.0", tf32_default=False, gemm_switch=True
    ),
}
NEWEST = "2.11.0.post2"  # what CI's emulated runs stand in for (the newest confirmed)
# A file the stand-in writes at exit: whether its GEMMs would run in TF32 then (true / false).
GEMM_TF32_REPORT = "FAKE_TORCH_MUSA_GEMM_TF32_REPORT"


class _Matmul:
    """``torch.backends.musa.matmul`` of v2.9 and later: GEMMs' TF32 switch, off by default."""

    allow_tf32 = False


def install_tf32_switches(release: Release) -> None:
    """``torch.backends.mudnn`` (every release) and, from v2.9, ``torch.backends.musa``, as the
    release has them, and ``torch.musa._gemm_tf32``: what its GEMMs read."""
    import torch

    mudnn = types.ModuleType("torch_musa.core.mudnn")
    mudnn.allow_tf32 = release.tf32_default
    torch.backends.mudnn = mudnn
    if release.matmul_tf32_switch:
        backends = types.ModuleType("torch.backends.musa")
        backends.matmul = _Matmul()
        torch.backends.musa = backends

        def gemm_tf32() -> bool:
            override = os.environ.get("TORCH_ALLOW_TF32_MUBLAS_OVERRIDE") == "1"
            return override or bool(torch.backends.musa.matmul.allow_tf32)
    else:

        def gemm_tf32() -> bool:
            return bool(torch.backends.mudnn.allow_tf32)

    torch.musa._gemm_tf32 = gemm_tf32
    report = os.environ.get(GEMM_TF32_REPORT)
    if report:  # what a process's last GEMM would have run in, for tests of whole runs
        atexit.register(lambda: Path(report).write_text(json.dumps(gemm_tf32())))
    if release.fsdp2_overlap_env and "TORCH_MUSA_FSDP2_OVERLAP_LEVEL" in os.environ:
        level = int(os.environ["TORCH_MUSA_FSDP2_OVERLAP_LEVEL"])
        assert level < 5  # as torch_musa's _get_fsdp2_overlap_level
        torch.musa._fsdp2_overlap_level = level


_INIT = """
import sys
import types

import torch
import torch.distributed as dist

__version__ = {version!r}

if {broken!r}:
    # What an image without mt-container-toolkit raises.
    raise OSError("libsrv_um_MUSA.so: cannot open shared object file: No such file or directory")


def _autoload():
    pass


torch.utils.rename_privateuse1_backend("musa")


class _Properties:
    name = {name!r}
    major, minor = {capability!r}
    total_memory = 48 * 1024**3
    multi_processor_count = 128


_current = 0
queried = []  # device indices whose capability or properties were read


def is_available():
    return True


def device_count():
    return {devices!r}


def current_device():
    return _current


def set_device(index):
    global _current
    _current = int(index)


def synchronize(device=None):
    pass


def get_device_name(index=None):
    return _Properties.name


def get_device_capability(index=None):
    queried.append(_current if index is None else int(index))
    return (_Properties.major, _Properties.minor)


def get_device_properties(index=None):
    queried.append(_current if index is None else int(index))
    return _Properties()


def memory_allocated(device=None):
    return 0


max_memory_allocated = memory_allocated


def reset_peak_memory_stats(device=None):
    pass


def manual_seed_all(seed):
    pass


_autocast = {{"enabled": False, "dtype": torch.float16}}


def {is_autocast}():
    return _autocast["enabled"]


def {get_autocast_dtype}():
    return _autocast["dtype"]


torch.musa = sys.modules[__name__]

if {tests!r} not in sys.path:
    sys.path.append({tests!r})
from fake_torch_musa import RELEASES as _RELEASES, install_tf32_switches as _tf32

_tf32(_RELEASES[{tag!r}])

# The vendor's patched distributed_c10d: a constant, in builds with and without MCCL.
dist.distributed_c10d.is_mccl_available = lambda: True
dist.is_mccl_available = dist.distributed_c10d.is_mccl_available
if {mccl!r}:
    def _mccl_creator(store, rank, world_size, timeout):
        raise RuntimeError("a simulated MUSA device has no MCCL process group")

    dist.Backend.register_backend("mccl", _mccl_creator, devices=["musa"])

if {fused_adamw_kernel!r}:
    def _fused_adamw_(*args, **kwargs):
        raise RuntimeError("a simulated MUSA device runs no kernels")

    _library = torch.library.Library("aten", "IMPL", "PrivateUse1")
    _library.impl("_fused_adamw_", _fused_adamw_)
"""

_EMULATED_INIT = """
import sys

if {tests!r} not in sys.path:
    sys.path.append({tests!r})

from musa_emulator import install as _install
from fake_torch_musa import RELEASES as _RELEASES

__version__ = {version!r}


def _autoload():
    pass


_install(_RELEASES[{tag!r}], card={card!r}, cards={devices!r}, module=sys.modules[__name__])
"""

_FUSED_ADAMW = """
import torch

# optim/fused_adamw.py of this release: the devices its constructor takes.
_DEVICES = {devices!r}


class FusedAdamW(torch.optim.Optimizer):
    \"\"\"AdamW with torch_musa's FusedAdamW signature, constructor check and state layout (a
    CPU reference).\"\"\"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, capturable=False, differentiable=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, capturable=capturable,
                        differentiable=differentiable, fused=True)
        super().__init__(params, defaults)
        supported = [torch._C._get_privateuse1_backend_name() if d == "musa" else d
                     for d in _DEVICES]
        if not all(
            p.device.type in supported and torch.is_floating_point(p)
            for group in self.param_groups
            for p in group["params"]
        ):
            raise RuntimeError(
                "FusedAdamW requires all the params to be floating point Tensors of "
                f"supported devices: {{supported}}."
            )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"].item()
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))
"""


def write_release(
    root: Path,
    tag: str,
    *,
    device_name: str = "MTT S4000",
    capability: tuple[int, int] = (2, 2),
    devices: int = 1,
    mccl: bool = True,
    broken: bool = False,
    emulated: str | None = None,
) -> Path:
    """Write ``torch_musa`` of release ``tag`` under ``root`` (put ``root`` on PYTHONPATH); a
    build for ``devices`` cards, with MCCL or (as S80 / S3000 builds) without.

    ``emulated``: a card of ``musa_emulator.CARDS`` (``"S4000"``, ``"S80"``): the release runs on
    ``devices`` emulated cards of that kind, which set the name, capability and MCCL."""
    release = RELEASES[tag]
    autocast = ("is_autocast", "get_autocast_dtype")
    names = {
        "musa": ("is_autocast_musa_enabled", "get_autocast_musa_dtype"),
        "plain": ("is_autocast_enabled", "get_autocast_dtype"),
        "none": ("_autocast_enabled", "_autocast_dtype"),
    }[release.autocast_names]
    package = root / "torch_musa"
    package.mkdir(parents=True)
    if emulated is not None:
        init = textwrap.dedent(_EMULATED_INIT).format(
            tests=str(Path(__file__).resolve().parent),
            version=release.version,
            tag=tag,
            card=emulated,
            devices=devices,
        )
    else:
        init = textwrap.dedent(_INIT).format(
            version=release.version,
            broken=broken,
            name=device_name,
            capability=capability,
            devices=devices,
            tests=str(Path(__file__).resolve().parent),
            tag=tag,
            mccl=mccl,
            fused_adamw_kernel=release.fused_adamw_kernel,
            **dict(zip(autocast, names, strict=True)),
        )
    (package / "__init__.py").write_text(init, encoding="utf-8")
    if release.has_dynamo:
        (package / "_dynamo").mkdir()
        (package / "_dynamo" / "__init__.py").write_text("", encoding="utf-8")
    if release.fused_adamw:
        (package / "optim").mkdir()
        (package / "optim" / "__init__.py").write_text(
            _FUSED_ADAMW.format(devices=release.fused_adamw), encoding="utf-8"
        )
    dist = root / f"torch_musa-{release.version.split('+')[0]}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch_musa\nVersion: {release.version}\n",
        encoding="utf-8",
    )
    if release.autoload_entry_point:
        (dist / "entry_points.txt").write_text(
            "[torch.backends]\ntorch_musa = torch_musa:_autoload\n", encoding="utf-8"
        )
    return root

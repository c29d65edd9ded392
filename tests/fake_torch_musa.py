"""Stand-ins for torch_musa releases, for testing MUSA decisions on a machine without MUSA.

Each release is written as an importable ``torch_musa`` package (plus its distribution metadata)
with the layout, ``torch.musa`` functions, version string and defaults read in that tag of
github.com/MooreThreads/torch_musa:

- ``__version__``: setup.py's dump_version writes version.txt + "+" + the commit's first 7 hex
  digits, so v2.0.0 and v2.0.0-pt25 both report ``2.0.0+<sha>``.
- ``torch.backends.mudnn.allow_tf32``: csrc/aten/utils/Context.h, false up to v2.5.0, true in
  v2.7.x.
- ``torch_musa._dynamo`` (the torch.compile backend): from v2.0.0.
- ``torch_musa.optim.FusedAdamW``: from v2.5.0; state ``step`` (a CPU float32 tensor),
  ``exp_avg``, ``exp_avg_sq``, and ``fused: True`` in its groups (optim/fused_adamw.py).
- the ``torch.backends`` entry point (torch loads it on ``import torch``): from v2.0.0-pt25.

The device is simulated (one card of the given name and capability); tensors cannot be moved to
it, which is what a broken build looks like to the doctor's SDPA check.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Release:
    tag: str
    version: str  # torch_musa.__version__ as that tag's setup.py writes it
    tf32_default: bool
    has_dynamo: bool
    has_fused_adamw: bool
    autoload_entry_point: bool


RELEASES = {
    "v1.3.0": Release("v1.3.0", "1.3.0+aa63a73", False, False, False, False),
    "v2.0.0": Release("v2.0.0", "2.0.0+1c4c9f2", False, True, False, False),
    "v2.7.1": Release("v2.7.1", "2.7.1+101c131", True, True, True, True),
}

_INIT = """
import sys
import types

import torch

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


def is_available():
    return True


def device_count():
    return 1


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
    return (_Properties.major, _Properties.minor)


def get_device_properties(index=None):
    return _Properties()


def memory_allocated(device=None):
    return 0


max_memory_allocated = memory_allocated


def reset_peak_memory_stats(device=None):
    pass


def manual_seed_all(seed):
    pass


torch.musa = sys.modules[__name__]

mudnn = types.ModuleType("torch_musa.core.mudnn")
mudnn.allow_tf32 = {tf32_default!r}
torch.backends.mudnn = mudnn
"""

_FUSED_ADAMW = '''
import torch


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with torch_musa's FusedAdamW signature and state layout (a CPU reference)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, capturable=False, differentiable=False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, capturable=capturable,
                        differentiable=differentiable, fused=True)
        super().__init__(params, defaults)

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
'''


def write_release(
    root: Path,
    tag: str,
    *,
    device_name: str = "MTT S4000",
    capability: tuple[int, int] = (2, 2),
    broken: bool = False,
) -> Path:
    """Write ``torch_musa`` of release ``tag`` under ``root`` (put ``root`` on PYTHONPATH)."""
    release = RELEASES[tag]
    package = root / "torch_musa"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        textwrap.dedent(_INIT).format(
            version=release.version,
            broken=broken,
            name=device_name,
            capability=capability,
            tf32_default=release.tf32_default,
        ),
        encoding="utf-8",
    )
    if release.has_dynamo:
        (package / "_dynamo").mkdir()
        (package / "_dynamo" / "__init__.py").write_text("", encoding="utf-8")
    if release.has_fused_adamw:
        (package / "optim").mkdir()
        (package / "optim" / "__init__.py").write_text(_FUSED_ADAMW, encoding="utf-8")
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

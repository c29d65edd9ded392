"""Installed packages that must agree with each other, read from their metadata.

Checked when a run's settings are validated (before torch loads: no import here may load it)
and reported by the environment doctor (``python -m recipes.env``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from packaging.version import InvalidVersion, Version

# peft's own torchao check (``peft/import_utils.py``, ``is_torchao_available``): where torchao
# can be found (``importlib.util.find_spec``) and its distribution has a version
# (``importlib.metadata.version``) below peft's minimum, it raises ImportError ("Found an
# incompatible version of torchao") when it builds LoRA layers (``dispatch_torchao``). The
# minimum is 0.4.0 up to peft 0.18.1 and 0.16.0 from peft 0.19.0 (huggingface/peft PR #3101,
# "FIX Broken tests with torchao >= 0.16"). The vendor's training image ships torchao 0.9.0,
# so any LoRA run there fails with peft 0.19-0.21 (ms-swift pins peft 0.18.1). From peft 0.22.0
# the same check warns instead ("torchao support in PEFT is disabled") and returns False: LoRA
# trains, only torchao-quantized models lose peft's torchao layers (its import_utils: "Raising
# would break PEFT for all models, not just torchao-quantized ones").
_PEFT_TORCHAO_MINIMUM: tuple[tuple[Version, Version], ...] = (
    (Version("0.19.0"), Version("0.16.0")),
    (Version("0"), Version("0.4.0")),
)
PEFT_WARNS_FROM = Version("0.22.0")


def installed_version(name: str) -> str | None:
    """A distribution's version from its metadata (no import), None where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torchao_minimum_for_peft(peft: str) -> Version:
    """The oldest torchao a peft release accepts (its ``TORCHAO_MINIMUM_VERSION``)."""
    found = Version(peft)
    return next(low for since, low in _PEFT_TORCHAO_MINIMUM if found >= since)


def peft_torchao_conflict(peft: str | None, torchao: str | None) -> str | None:
    """Why this peft refuses this torchao at its first LoRA layer (one sentence that names both
    versions and the two fixes), or None where they agree or either is missing."""
    if peft is None or torchao is None:
        return None
    try:
        minimum = torchao_minimum_for_peft(peft)
        if Version(torchao) >= minimum or Version(peft) >= PEFT_WARNS_FROM:
            return None
    except InvalidVersion:  # a version peft could not parse either: not this check's to judge
        return None
    return (
        f"peft {peft} needs torchao >= {minimum} and torchao {torchao} is installed, so LoRA "
        f'stops with an ImportError at its first layer: pip install "peft<0.19" (as ms-swift '
        f'pins 0.18.1) or "peft>={PEFT_WARNS_FROM}" (which only turns its torchao support off), '
        f'or install a newer torchao (pip install "torchao>={minimum}", one built for this torch)'
    )


def installed_peft_torchao_conflict() -> str | None:
    """:func:`peft_torchao_conflict` for the installed peft and torchao, read as peft reads
    torchao: found on the path and with distribution metadata."""
    if importlib.util.find_spec("torchao") is None:
        return None
    return peft_torchao_conflict(installed_version("peft"), installed_version("torchao"))

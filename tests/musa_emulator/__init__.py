"""An emulated MUSA device for tests: tensors on ``musa`` held in host memory.

``csrc/emulator.cpp`` is torch's PrivateUse1 backend (host allocator, a device guard with N
cards, copies, a fallback that runs every other operator's CPU kernel on the same memory and
refuses mixed devices as torch's device wrappers do, a generator per card that random operators
insist on and CPU ones refuse, non-blocking copies to the host that land only at the next
synchronisation (poison before it), autocast, an ``mccl`` backend of gloo over the same memory
that takes card tensors only, and the bad-fork refusal of a child forked after the card was
used). It is compiled at first use with ``torch.utils.cpp_extension`` and cached per torch
build and source (``$MUSA_EMULATOR_CACHE``, else ``~/.cache/musa-recipes/emulated-musa``).

:func:`install` puts ``torch.musa`` on top of it as a torch_musa release has it: the functions,
autocast dtypes, TF32 default, optimizer kernels and MCCL of that tag (the tables in
``tests/fake_torch_musa.py``). ``scripts/emulated_musa.py`` runs any command with a generated
``torch_musa`` stand-in that calls :func:`install`.

What it cannot show: muDNN kernels, real numerics, speed, memory limits, MCCL topology and the
driver. Those need a card (``scripts/gpu_check.py`` on a lent device).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch
from emulator_build import CARDS, NAME, SOURCE, Card, build_dir


@functools.cache
def extension(verbose: bool = False) -> types.ModuleType:
    """The compiled emulator, built on first use (about a minute on 2 cores) and loaded from the
    cache afterwards."""
    import torch.distributed  # noqa: F401  (the c10d types the extension's functions take)

    folder = build_dir()
    library = folder / f"{NAME}.so"
    if not (folder / "built").exists():
        from torch.utils import cpp_extension

        folder.mkdir(parents=True, exist_ok=True)
        print(
            f"emulated MUSA: compiling {SOURCE.name} into {folder} (once per torch build)",
            file=sys.stderr,
        )
        module = cpp_extension.load(
            name=NAME,
            sources=[str(SOURCE)],
            build_directory=str(folder),
            extra_cflags=["-O1"],
            verbose=verbose,
        )
        (folder / "built").write_text(str(library), encoding="utf-8")
        return module
    spec = importlib.util.spec_from_file_location(
        NAME, library, loader=importlib.machinery.ExtensionFileLoader(NAME, str(library))
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def visible_cards(physical: int, env: str | None) -> int:
    """How many cards a process sees: all ``physical`` ones without ``MUSA_VISIBLE_DEVICES``,
    else the listed ordinals up to the first that does not exist (as CUDA's runtime reads
    ``CUDA_VISIBLE_DEVICES``)."""
    if env is None:
        return physical
    seen: list[int] = []
    for item in env.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= physical or int(item) in seen:
            break
        seen.append(int(item))
    return len(seen)


def _index(device: torch.device | str | int | None, ext: types.ModuleType) -> int:
    """A card ordinal from what torch.cuda-style functions accept (None: the current card)."""
    if device is None:
        return int(ext.current_device())
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "musa":
        raise ValueError(f"Expected a musa device, but got: {device}")
    return int(ext.current_device()) if device.index is None else int(device.index)


def _properties(ext: types.ModuleType, card: Card, index: int) -> types.SimpleNamespace:
    if not 0 <= index < ext.device_count():
        raise AssertionError("Invalid device id")
    major, minor = card.capability
    return types.SimpleNamespace(
        name=card.name,
        major=major,
        minor=minor,
        total_memory=card.memory_gib << 30,
        multi_processor_count=128 if card.mccl else 32,
    )


def _capability(props: types.SimpleNamespace) -> tuple[int, int]:
    return props.major, props.minor


def _tag(tag: str) -> tuple[int, ...]:
    return tuple(int(part) for part in tag.lstrip("v").split(".")[:3])  # 2.11.0.post1: 2.11.0


# Names of torch.musa that came or went between the tags (read at each tag; every other name
# defined below is in all of v1.3.0 to v2.7.1): name -> (first tag, last tag).
_SPANS = {
    "is_bf16_supported": ("v2.5.0", None),
    "is_initialized": ("v2.5.0", None),
    "reset_max_memory_allocated": ("v2.5.0", None),
    "is_tf32_supported": ("v2.7.1", None),
    "StreamContext": ("v2.7.1", None),
    "reset_peak_stats": (None, "v1.3.2"),
    "MUSAGraph": ("v2.0.0", None),  # torch_musa/musa_graph, star-imported by __init__.py
    "graph": ("v2.0.0", None),
}


class MUSAGraph:
    """torch_musa's graph class (``torch_musa/musa_graph/graphs.py``, from v2.0.0), which
    torchada aliases as ``torch.cuda.CUDAGraph`` (transformers 5 names it in annotations at
    import). The emulator captures no graphs: building one works, capturing or replaying it
    refuses."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def _not_emulated(self, *args, **kwargs):
        raise RuntimeError("MUSA graphs are not emulated (tests/musa_emulator)")

    capture_begin = capture_end = replay = reset = pool = _not_emulated


class graph:
    """``torch.musa.graph(musa_graph, ...)``, the capture context: refused, as capturing is."""

    def __init__(self, musa_graph, *args, **kwargs) -> None:
        self.musa_graph = musa_graph

    def __enter__(self):
        self.musa_graph.capture_begin()

    def __exit__(self, *exc) -> bool:
        return False


_AUTOCAST_NAMES = {
    "musa": (
        "is_autocast_musa_enabled",
        "set_autocast_musa_enabled",
        "get_autocast_musa_dtype",
        "set_autocast_musa_dtype",
    ),
    "plain": (
        "is_autocast_enabled",
        "set_autocast_enabled",
        "get_autocast_dtype",
        "set_autocast_dtype",
    ),
    "none": (),
}


def _in_release(name: str, tag: str) -> bool:
    first, last = _SPANS.get(name, (None, None))
    return (first is None or _tag(tag) >= _tag(first)) and (last is None or _tag(tag) <= _tag(last))


def _populate(musa: types.ModuleType, ext: types.ModuleType, card: Card, release) -> None:
    """``torch.musa`` (the torch_musa module itself, as torch_musa sets it) as ``release`` has it,
    on the emulated cards."""
    index = functools.partial(_index, ext=ext)

    def device_count() -> int:
        ext.poison_fork()  # as torch_musa's _musa_getDeviceCount: a later fork is a bad one
        return int(ext.device_count())

    def is_available() -> bool:
        return device_count() > 0

    def set_device(device) -> None:
        ext.set_device(index(device))

    class device:
        def __init__(self, device):
            self.idx = index(device) if device is not None else -1
            self.prev_idx = -1

        def __enter__(self):
            self.prev_idx = ext.current_device()
            if self.idx >= 0:
                ext.set_device(self.idx)

        def __exit__(self, *exc):
            ext.set_device(self.prev_idx)
            return False

    def get_rng_state(device="musa") -> torch.Tensor:
        return ext.get_rng_state(index(device))

    def set_rng_state(new_state: torch.Tensor, device="musa") -> None:
        ext.set_rng_state(index(device), new_state.to("cpu", torch.uint8))

    def manual_seed(seed: int) -> None:
        ext.manual_seed(ext.current_device(), int(seed) & 0xFFFF_FFFF_FFFF_FFFF)

    def manual_seed_all(seed: int) -> None:
        for i in range(ext.device_count()):
            ext.manual_seed(i, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)

    def seed_all() -> None:
        chosen = ext.seed(0) if ext.device_count() else 0
        for i in range(1, ext.device_count()):
            ext.manual_seed(i, chosen)

    def mem_get_info(device=None) -> tuple[int, int]:
        total = card.memory_gib << 30
        return total - int(ext.memory_allocated(index(device))), total

    def get_amp_supported_dtype() -> list[torch.dtype]:
        # Up to v2.5.0 a constant; v2.7.x asks the current card for bf16 (capability >= 2.2).
        if not release.amp_bf16_by_capability:
            return [torch.float16, torch.bfloat16, torch.float32]
        return [torch.float16, *([torch.bfloat16] if card.capability >= (2, 2) else [])]

    class GradScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            kwargs.pop("device", None)
            super().__init__("musa", *args, **kwargs)

    amp = types.ModuleType("torch_musa.amp")
    amp.GradScaler = GradScaler
    amp.autocast = functools.partial(torch.autocast, "musa")

    class Stream(torch.Stream):
        def __new__(cls, device=None, priority=0, **kwargs):
            if kwargs:  # torch.Stream(stream_id=..., device_index=..., device_type=...)
                return super().__new__(cls, **kwargs)
            return super().__new__(
                cls, device=torch.device("musa", index(device)), priority=priority
            )

    class Event(torch.Event):
        def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
            return super().__new__(cls, device="musa", enable_timing=enable_timing)

    def current_stream(device=None) -> torch.Stream:
        return Stream(device)

    @contextlib.contextmanager
    def stream(s):
        yield s

    def properties(device) -> types.SimpleNamespace:  # the device is not optional here
        return _properties(ext, card, index(device))

    autocast_functions = (
        lambda: torch.is_autocast_enabled("musa"),
        lambda enabled: torch.set_autocast_enabled("musa", enabled),
        lambda: torch.get_autocast_dtype("musa"),
        lambda dtype: torch.set_autocast_dtype("musa", dtype),
    )
    functions = {
        "is_available": is_available,
        "is_initialized": lambda: bool(ext.initialized()),
        "_initialized": True,
        # torch calls _lazy_init before it makes the first musa tensor; in a process forked after
        # the card was used it refuses, as torch_musa's core/_lazy_init.py does.
        "_lazy_init": ext.lazy_init,
        "_is_in_bad_fork": lambda: bool(ext.in_bad_fork()),
        "device_count": device_count,
        "current_device": lambda: int(ext.current_device()),
        "set_device": set_device,
        "device": device,
        # Lands the card's non-blocking copies to the host (csrc: Pending), as a card's does.
        "synchronize": lambda device=None: ext.synchronize(index(device)),
        "get_device_name": lambda device=None: _properties(ext, card, index(device)).name,
        "get_device_capability": lambda device=None: _capability(properties(device)),
        "get_device_properties": properties,
        "is_bf16_supported": lambda: card.capability >= (2, 2),
        "is_tf32_supported": lambda: card.capability >= (2, 2),
        "memory_allocated": lambda device=None: int(ext.memory_allocated(index(device))),
        "max_memory_allocated": lambda device=None: int(ext.max_memory_allocated(index(device))),
        "memory_reserved": lambda device=None: int(ext.memory_allocated(index(device))),
        "max_memory_reserved": lambda device=None: int(ext.max_memory_allocated(index(device))),
        "reset_peak_memory_stats": lambda device=None: ext.reset_peak_memory_stats(index(device)),
        "reset_max_memory_allocated": lambda device=None: ext.reset_peak_memory_stats(
            index(device)
        ),
        "reset_peak_stats": lambda device=None: ext.reset_peak_memory_stats(index(device)),
        "mem_get_info": mem_get_info,
        "empty_cache": lambda: None,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "seed": lambda: ext.seed(ext.current_device()),
        "seed_all": seed_all,
        "initial_seed": lambda: int(ext.initial_seed(ext.current_device())),
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [ext.get_rng_state(i) for i in range(ext.device_count())],
        "set_rng_state_all": lambda states: [
            ext.set_rng_state(i, state.to("cpu", torch.uint8)) for i, state in enumerate(states)
        ],
        "get_amp_supported_dtype": get_amp_supported_dtype,
        "amp": amp,
        "Stream": Stream,
        "StreamContext": stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": current_stream,
        "set_stream": lambda s: None,
        "stream": stream,
        "MUSAGraph": MUSAGraph,
        "graph": graph,
        **dict(zip(_AUTOCAST_NAMES[release.autocast_names], autocast_functions, strict=False)),
    }
    for name, value in functions.items():
        if _in_release(name, release.tag):
            setattr(musa, name, value)
    sys.modules[f"{musa.__name__}.amp"] = amp
    # torch_musa/core/stream.py and core/_utils.py (every tag), where torchada looks for
    # torch.cuda.StreamContext, torch.cuda.streams and torch.cuda._get_device_index.
    core = types.ModuleType(f"{musa.__name__}.core")
    core.stream = types.ModuleType(f"{musa.__name__}.core.stream")
    for name, value in (("Stream", Stream), ("Event", Event), ("StreamContext", stream)):
        setattr(core.stream, name, value)
    for name in ("stream", "current_stream", "default_stream", "set_stream"):
        setattr(core.stream, name, functions[name])
    core._utils = types.ModuleType(f"{musa.__name__}.core._utils")
    core._utils._get_musa_device_index = lambda device, optional=False, allow_cpu=False: index(
        device
    )
    musa.core = core
    for module in (core, core.stream, core._utils):
        sys.modules[module.__name__] = module


def checked_ops() -> list[str]:
    """The aten operators whose device wrappers refuse a tensor on another device, a 0-dim CPU
    one included: those without ``device_check: NoCheck`` in the native_functions.yaml this
    torch was generated from (shipped in ``torchgen/packaged``; torchgen's
    ``RegisterDispatchKey.gen_device_check`` writes the check)."""
    import torchgen
    import yaml

    path = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    entries = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    return [
        "aten::" + entry["func"].split("(", 1)[0]
        for entry in entries
        if entry.get("device_check") != "NoCheck"
    ]


def _patch_sharded_grad_scaler() -> None:
    """torch_musa's ShardedGradScaler (FSDP with fp16): torch's defaults to device "cuda"; the
    vendor's replaces it with one on musa that takes no device."""
    import torch.distributed as dist
    from torch.distributed.fsdp import sharded_grad_scaler

    class ShardedGradScaler(sharded_grad_scaler.ShardedGradScaler):
        def __init__(
            self,
            init_scale=2.0**16,
            backoff_factor=0.5,
            growth_factor=2.0,
            growth_interval=2000,
            enabled=True,
            process_group=dist.group.WORLD,
        ):
            super().__init__(
                "musa",
                init_scale=init_scale,
                backoff_factor=backoff_factor,
                growth_factor=growth_factor,
                growth_interval=growth_interval,
                enabled=enabled,
                process_group=process_group,
            )

    sharded_grad_scaler.ShardedGradScaler = ShardedGradScaler


def install(release, card: str = "S4000", cards: int = 1, module: types.ModuleType | None = None):
    """Make ``musa`` a device of this process: ``cards`` emulated cards of kind ``card``
    (``CARDS``), of which ``MUSA_VISIBLE_DEVICES`` shows some, and ``torch.musa`` as torch_musa
    ``release`` (a ``fake_torch_musa.Release``) has it, on ``module`` (the torch_musa stand-in;
    a new module by default). Returns ``torch.musa``."""
    import torch.distributed as dist

    kind = CARDS[card]
    ext = extension()
    visible = visible_cards(cards, os.environ.get("MUSA_VISIBLE_DEVICES"))
    ext.configure(visible)  # the card's name and figures are the stand-in's (_properties)
    torch.utils.rename_privateuse1_backend("musa")
    musa = module if module is not None else types.ModuleType("torch_musa")
    _populate(musa, ext, kind, release)
    torch.musa = musa  # as torch_musa does: torch.musa is the torch_musa module
    # torch 2.13 imports "torch.musa" by name when autocast starts (torch_musa's tags, built for
    # torch <= 2.7, set only the attribute); torch._register_device_module would do the same.
    sys.modules.setdefault("torch.musa", musa)
    # torch_musa adds Tensor.musa / Module.musa / UntypedStorage.musa by hand; torch's generator
    # writes the same methods.
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    ext.set_checked_ops(checked_ops())
    from fake_torch_musa import install_tf32_switches

    install_tf32_switches(release)  # torch.backends.mudnn; torch.backends.musa from v2.9
    kernels = ["_fused_adamw_", "_fused_adam_"]
    if release.fused_adamw_kernel:
        ext.register_kernels(kernels)
    else:
        ext.set_missing_ops([f"aten::{name}" for name in kernels])
    # The vendor's patched distributed_c10d: a constant, in builds with and without MCCL.
    dist.distributed_c10d.is_mccl_available = lambda: True
    dist.is_mccl_available = dist.distributed_c10d.is_mccl_available
    if kind.mccl:  # torch_musa: register_backend("mccl", creator, False, "musa") (its patched
        # torch reads the device string as ["musa"])

        def _create_mccl(store, rank, size, timeout):
            return ext.collectives(dist.ProcessGroupGloo(store, rank, size, timeout))

        dist.Backend.register_backend("mccl", _create_mccl, devices=["musa"])
    _patch_sharded_grad_scaler()
    musa._emulator = ext
    return musa

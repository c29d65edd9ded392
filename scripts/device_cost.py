"""What a training step costs a device: host syncs, operator launches, host-to-device copies and
input shapes per optimizer step of each recipe's smoke run, counted on the emulated MUSA card.

    python scripts/throughput.py device-cost                        # every recipe, ~2 min
    python scripts/throughput.py device-cost --recipes bert_squad llama_sft --json cost.json
    python scripts/device_cost.py --recipes gpt2_clm                # the same, directly

Each recipe runs ``train.py``'s own code (``recipes.modes.run``) with ``debug=smoke`` for
``--steps`` optimizer steps, logging every ``--log-every`` steps, with no evaluation or
checkpoint, in the recipe's own precision on the card (``trainer.mixed_precision=auto``: bf16
autocast on the emulated S4000). All recipes run in one child process on the emulated card
(``scripts/emulated_musa.py``, through ``tests/conftest.py``'s ``on_musa`` and ``run_train``, as
``tests/test_emulated_recipes.py`` runs them), and every ATen operator that touches a ``musa``
tensor passes through a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that counts it.
The emulated card runs CPU kernels, so this counts what a step asks of a device, not how long it
takes: the counts are exact and the same on every machine, which is what lets a test bound them.

Step boundaries: the loop's ``Trainer._finish_step`` ends each optimizer step (what runs from
the end of one to the end of the next is that step). A step whose ``_finish_step`` called
``Trainer._log_step`` closes a logging window (``trainer.log_every_n_steps``): what runs inside
that ``_finish_step`` is counted "at close", apart from the step. The first ``--warmup`` steps
(optimizer state being created, first-call caches) are left out; the figures are medians over
the steps after them.

How to read the table (one row per recipe):

* ``launches/step``: operators run on the device in a step (forward, backward, clipping, the
  optimizer, the loop's bookkeeping); views and bare allocations, which launch nothing, are not
  counted, copies are. On a real card each costs a few microseconds of host time at least: a
  tiny model's step is launch-bound when this is large.
* ``launches/close``: the extra operators of a window close (the logged sums and their
  reduction).
* ``syncs/step``: host syncs inside a step: the host waits for the device to finish everything
  queued (no overlap of host work with device work), then goes on. Counted: reads of a device
  value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, all
  ``aten._local_scalar_dense`` or a copy to the CPU), operators whose output size depends on
  device data (``nonzero``, ``masked_select``, boolean indexing, ``unique``, ...: the host needs
  the size), and blocking host-to-device copies (``.to(device)`` without ``non_blocking``,
  ``torch.tensor(data, device=...)``): torch's CUDA copy synchronises the stream after a blocking
  copy (``memcpy_and_sync``, which ``torch.cuda.set_sync_debug_mode`` reports as a sync), and
  torch_musa copies as it does. The goal is 0 outside named library syncs; the second table
  names every one by the first Python frame outside torch that caused it (a batch
  container's own ``.to``, transformers' ``BatchEncoding.to``, is passed over for its caller:
  the batch's copy is named the same whatever container it comes in).
* ``syncs/close``: syncs at a window close (reading the logged values is one: expected there).
* ``H2D/step``: host-to-device copies in a step and their size (the batch, and any tensor
  built on the host and sent over).
* ``shapes/step`` and ``shapes/run``: distinct shapes of what the loop hands the task's
  ``loss(model, batch)`` (every tensor of each sub-batch: ``input_ids`` and its companions), per
  step and over all measured steps. These are the model's forward inputs; each new one costs a
  recompile under ``torch.compile``, a new kernel choice or autotune on a real device and
  allocator fragmentation. Shapes of all op inputs would say the same at once per layer, mixed
  with the weights' fixed shapes; the batch's shapes are the cause and stay readable. ``shapes
  /run`` is what catches churn: sub-batches padded to ever new lengths keep ``shapes/step`` at
  the number of sub-batches but grow the run's set.

The second table lists each sync site: ``kind`` (``read``: a device value read on the host;
``shape``: a data-dependent output size; ``h2d``: a blocking copy to the device), its file,
line and function, and how often it ran per step and per window close.

``tests/test_device_cost.py`` bounds these figures for every recipe (``tests/
device_cost_bounds.json``; ``python tests/test_device_cost.py --record`` rewrites it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

RECIPES = tuple(sorted(path.stem for path in (ROOT / "conf" / "recipe").glob("*.yaml")))
# Cases beyond the recipes as they ship, "<recipe>+<override>+...": the CPU's sub-batches on the
# card (where a recipe runs whole micro-batches), so that what the sub-batches launch and the
# shapes they meet stay bounded too.
VARIANTS = ("bert_squad+trainer.sub_batches=4",)
CASES = RECIPES + VARIANTS
STEPS, LOG_EVERY, WARMUP = 6, 3, 1
# A smoke run cut to its training steps: no evaluation, checkpoint, final model or tracker.
RUN = (
    "debug=smoke",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.mixed_precision=auto",  # the card's own precision (run_train would pin fp32)
    "trainer.eval_at_start=false",
    "trainer.eval_at_end=false",
    "trainer.eval_every_n_steps=0",
    "trainer.load_best_model_at_end=false",  # bert_swag's smoke keeps its best checkpoint
    "trainer.save_every_n_steps=0",
    "trainer.save_at_epoch_end=false",
    "trainer.save_final_model=false",
)
DEVICE = "musa"


# --------------------------------------------------------------------------- counting


@dataclass
class Sync:
    kind: str  # read, shape or h2d (see the module docstring)
    where: str  # path:line
    function: str

    @property
    def site(self) -> str:
        """What names a sync in the bounds: its kind, file and function (lines move)."""
        return f"{self.kind}: {self.where.rsplit(':', 1)[0]} ({self.function})"


@dataclass
class Tally:
    """What one stretch of a step asked of the device."""

    launches: int = 0
    syncs: list[Sync] = field(default_factory=list)
    h2d_copies: int = 0
    h2d_bytes: int = 0
    shapes: list[tuple] = field(default_factory=list)


@dataclass
class Step:
    number: int
    closes_window: bool
    body: Tally  # the step itself (the non-logging part of its _finish_step included)
    close: Tally  # what ran inside a window-closing _finish_step


def _skipped_files() -> tuple[str, ...]:
    """Frames that are not "who asked": torch itself, this module, the emulated card."""
    import torch

    return (
        str(Path(torch.__file__).parent) + os.sep,
        str(Path(__file__).resolve()),
        str(TESTS / "musa_emulator") + os.sep,
        str(Path(contextlib.__file__).resolve()),
    )


@functools.cache
def _site_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(
        sorted({str(Path(p)) + os.sep for p in (paths["purelib"], paths["platlib"])}, key=len)
    )


def _short(filename: str) -> str:
    """A path as the report shows it: relative to site-packages (asked first: a virtual
    environment may live inside the checkout) or to the checkout."""
    for root in _site_roots():
        if filename.startswith(root):
            return filename[len(root) :]
    if filename.startswith(str(ROOT) + os.sep):
        return filename[len(str(ROOT)) + 1 :]
    return filename


# Frames that only pass a call on: a batch container's ``.to`` (whoever moves the batch is named,
# whatever container it comes in).
PASSING_ON = {("transformers/tokenization_utils_base.py", "to"), ("transformers/tokenization_utils_base.py", "<dictcomp>")}  # fmt: skip


def _passes_on(frame: Any, skipped: tuple[str, ...]) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith(skipped) or "torch_musa" in filename:
        return True
    return (_short(filename), frame.f_code.co_name) in PASSING_ON


def _caller(skipped: tuple[str, ...]) -> tuple[str, str]:
    frame = sys._getframe(1)
    while frame is not None and _passes_on(frame, skipped):
        frame = frame.f_back
    if frame is None:
        return "<torch>:0", "?"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}", frame.f_code.co_name


def _make_counter_class() -> type:
    """The dispatch mode, built once torch is imported (the parent process never imports it)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    # Values read on the host, and output sizes read from device data; by name where an older
    # torch lacks the tag.
    read_tag = getattr(torch.Tag, "data_dependent_output", None)
    read_ops = {"_local_scalar_dense", "equal", "is_nonzero", "allclose", "is_set_to"}
    dynamic = getattr(torch.Tag, "dynamic_output_shape", None)
    dynamic_ops = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                   "unique_consecutive", "index", "index_put", "index_put_", "repeat_interleave",
                   "bincount", "histc", "masked_scatter"}  # fmt: skip
    needs_bool_index = {"index", "index_put", "index_put_", "_index_put_impl_"}
    no_launch = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                 "detach", "alias", "lift_fresh", "_unsafe_view", "set_", "resize_",
                 "_reshape_alias", "as_strided", "_local_scalar_dense"}  # fmt: skip

    def _copy_ends(op: str, args: tuple, out: Any) -> tuple[Any, Any]:
        """The source and destination of a copy operator (None, None for any other)."""
        if op == "_to_copy":
            return args[0], out
        if op == "copy_":
            return args[1], args[0]
        if op in ("_copy_from", "_copy_from_and_resize"):
            return args[0], args[1]
        return None, None

    def name(func: Any) -> str:
        return func._schema.name.split("::")[-1]

    @functools.cache
    def is_view(func: Any) -> bool:
        returns = func._schema.returns
        return any(r.alias_info is not None and not r.alias_info.is_write for r in returns)

    def on(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == DEVICE

    class DeviceCounter(TorchDispatchMode):
        """Counts launches, syncs and copies of operators that touch the device into
        :attr:`tally` (replaced by the step watcher at each boundary)."""

        def __init__(self) -> None:
            super().__init__()
            self.tally = Tally()
            self.skipped = _skipped_files()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            device_in, device_out = any(map(on, inputs)), any(map(on, outputs))
            if not (device_in or device_out):
                return out
            op, tally = name(func), self.tally
            if op not in no_launch and not is_view(func):
                tally.launches += 1
            kind = None
            src, dst = _copy_ends(op, args, out)
            if op == "_local_scalar_dense" or (src is not None and on(src) and not on(dst)):
                kind = "read"
            elif op == "lift_fresh" or (src is not None and on(dst) and not on(src)):
                # lift_fresh: torch.tensor(data, device=...), built on the host and copied over
                copied = dst if dst is not None else outputs[0]
                tally.h2d_copies += 1
                tally.h2d_bytes += copied.numel() * copied.element_size()
                blocking = not kwargs.get("non_blocking", op == "copy_" and args[2:3] == (True,))
                if op == "lift_fresh" or blocking:
                    kind = "h2d"
            elif (read_tag in func.tags) if read_tag is not None else op in read_ops:
                kind = "read"
            elif (dynamic in func.tags) if dynamic is not None else op in dynamic_ops:
                if op in needs_bool_index:
                    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                    if any(
                        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                        for i in indices or ()
                    ):
                        kind = "shape"
                elif not (op == "repeat_interleave" and kwargs.get("output_size") is not None):
                    kind = "shape"
            if kind is not None:
                tally.syncs.append(Sync(kind, *_caller(self.skipped)))
            return out

    return DeviceCounter


class StepWatcher:
    """Cuts the counter's tallies at the loop's step boundaries and records the shapes the loop
    hands the task; installed by patching :class:`recipes.loop.Trainer` for one run."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self.steps: list[Step] = []
        self.logged = False

    def start(self) -> None:
        self.counter.tally = Tally()

    def finish_step(self, trainer: Any, finish: Callable[[], None]) -> None:
        body = self.counter.tally
        self.counter.tally, self.logged = Tally(), False
        try:
            finish()
        finally:
            close = self.counter.tally
            if not self.logged:  # an ordinary step's own end
                body.launches += close.launches
                body.syncs += close.syncs
                body.h2d_copies += close.h2d_copies
                body.h2d_bytes += close.h2d_bytes
                close = Tally()
            self.steps.append(Step(trainer.state.step, self.logged, body, close))
            self.counter.tally = Tally()

    def loss(self, loss: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        @functools.wraps(loss)
        def recorded(model: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            self.counter.tally.shapes.append(
                tuple(
                    sorted(
                        (key, tuple(value.shape))
                        for key, value in batch.items()
                        if isinstance(value, torch.Tensor)
                    )
                )
            )
            return loss(model, batch, *args, **kwargs)

        return recorded


@contextlib.contextmanager
def watching(watcher_box: list) -> Iterator[None]:
    """Patch the loop for the runs inside: ``fit`` runs under a fresh counter, ``_finish_step``
    cuts steps, ``_log_step`` marks window closes, the task's ``loss`` records shapes. The
    finished watcher of each run is appended to ``watcher_box``."""
    from recipes.loop import Trainer

    counter_class = _make_counter_class()
    originals = {name: getattr(Trainer, name) for name in ("fit", "_finish_step", "_log_step")}

    def fit(self: Trainer) -> Any:
        watcher = StepWatcher(counter_class())
        watcher_box.append(watcher)
        self._device_cost = watcher
        self.task.loss = watcher.loss(self.task.loss)
        with watcher.counter:
            watcher.start()
            return originals["fit"](self)

    def finish_step(self: Trainer) -> None:
        self._device_cost.finish_step(self, lambda: originals["_finish_step"](self))

    def log_step(self: Trainer) -> None:
        self._device_cost.logged = True
        originals["_log_step"](self)

    Trainer.fit, Trainer._finish_step, Trainer._log_step = fit, finish_step, log_step
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(Trainer, name, original)


# --------------------------------------------------------------------------- summary


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarise(steps: list[Step], warmup: int) -> dict[str, Any]:
    """Per-step medians over the steps after ``warmup``, and every sync site with its counts."""
    measured = [s for s in steps if s.number > warmup]
    closes = [s for s in measured if s.closes_window]
    seen: set[tuple] = set()
    for s in measured:
        seen.update(s.body.shapes)
    sites: dict[str, dict[str, Any]] = {}
    for s in measured:
        for phase, tally in (("step", s.body), ("close", s.close)):
            for sync in tally.syncs:
                entry = sites.setdefault(
                    sync.site, {"kind": sync.kind, "where": sync.where, "step": 0, "close": 0}
                )
                entry[phase] += 1
    for entry in sites.values():
        entry["per_step"] = entry.pop("step") / max(len(measured), 1)
        entry["per_close"] = entry.pop("close") / max(len(closes), 1)
    return {
        "steps": [s.number for s in measured],
        "window_closes": [s.number for s in closes],
        "launches_per_step": _median([s.body.launches for s in measured]),
        "launches_per_close": _median([s.close.launches for s in closes]),
        "syncs_per_step": _median([len(s.body.syncs) for s in measured]),
        "syncs_per_close": _median([len(s.close.syncs) for s in closes]),
        "h2d_copies_per_step": _median([s.body.h2d_copies for s in measured]),
        "h2d_bytes_per_step": _median([s.body.h2d_bytes for s in measured]),
        "shapes_per_step": _median([len(set(s.body.shapes)) for s in measured]),
        "shapes_per_run": len(seen),
        "sub_batches_per_step": _median([len(s.body.shapes) for s in measured]),
        "sync_sites": dict(sorted(sites.items())),
    }


# --------------------------------------------------------------------------- runs


def _child(argv: list[str]) -> None:
    """In the child, on the emulated card: run each recipe in this process, write the JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipes", required=True)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    args, overrides = parser.parse_known_args(argv)
    sys.path.insert(0, str(ROOT))
    from hydra import compose, initialize_config_dir

    from recipes.config import register_resolvers, validate
    from recipes.modes import run
    from recipes.session import _reset_accelerate

    register_resolvers()
    results: dict[str, Any] = {}
    runs = Path(tempfile.mkdtemp(prefix="device-cost-"))
    for index, case in enumerate(args.recipes.split(",")):
        recipe, *variant = case.split("+")
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[
                    f"recipe={recipe}",
                    *overrides,
                    *variant,
                    f"output_dir={runs / f'{index}-{recipe}'}",
                ],
            )
        box: list[StepWatcher] = []
        with watching(box):
            run(validate(cfg))
        _reset_accelerate()  # the next recipe builds its own Accelerator
        results[case] = summarise(box[-1].steps, args.warmup)
        print(f"device-cost: {case}: {json.dumps(results[case])}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


def measure(
    recipes: tuple[str, ...] = CASES,
    *,
    steps: int = STEPS,
    log_every: int = LOG_EVERY,
    warmup: int = WARMUP,
    cache_dir: Path | None = None,
    extra: tuple[str, ...] = (),
    timeout: int = 1200,
) -> dict[str, Any]:
    """Every recipe of ``recipes`` in one child process on one emulated card; returns
    ``{recipe: summary}`` (:func:`summarise`). ``extra``: more overrides for every recipe."""
    sys.path.insert(0, str(TESTS))
    from conftest import on_musa, run_train

    with tempfile.TemporaryDirectory(prefix="device-cost-") as tmp:
        out = Path(tmp) / "cost.json"
        cache = cache_dir or Path(tmp) / "cache"
        script = on_musa(
            sys.executable,
            str(Path(__file__).resolve()),
            "_child",
            f"--out={out}",
            f"--recipes={','.join(recipes)}",
            f"--warmup={warmup}",
        )
        run_train(
            *RUN,
            f"trainer.max_steps={steps}",
            f"trainer.log_every_n_steps={log_every}",
            f"data.cache_dir={cache}",
            *extra,
            script=script,
            timeout=timeout,
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
        return json.loads(out.read_text())


def table(results: dict[str, Any]) -> str:
    """The two Markdown tables of the module docstring."""
    lines = [
        "| recipe | launches/step | launches/close | syncs/step | syncs/close | H2D/step "
        "| shapes/step | shapes/run | sub-batches/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for recipe, r in results.items():
        h2d = f"{r['h2d_copies_per_step']:g} ({r['h2d_bytes_per_step'] / 1024:.1f} KiB)"
        lines.append(
            f"| {recipe} | {r['launches_per_step']:g} | {r['launches_per_close']:g} "
            f"| {r['syncs_per_step']:g} | {r['syncs_per_close']:g} | {h2d} "
            f"| {r['shapes_per_step']:g} | {r['shapes_per_run']} "
            f"| {r['sub_batches_per_step']:g} |"
        )
    lines += ["", "| recipe | kind | where | function | per step | per close |", "|---|---|---|---|---:|---:|"]  # fmt: skip
    for recipe, r in results.items():
        for site, s in r["sync_sites"].items():
            function = site.rsplit(" (", 1)[1][:-1]
            lines.append(
                f"| {recipe} | {s['kind']} | {s['where']} | {function} "
                f"| {s['per_step']:.2g} | {s['per_close']:.2g} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/throughput.py device-cost",
        description="Host syncs, launches, copies and shapes per training step of each "
        "recipe's smoke run on the emulated MUSA card (see scripts/device_cost.py).",
    )
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=list(CASES),
        choices=CASES,
        metavar="RECIPE",
        help="which recipes (default: all); overrides go before this option or after --",
    )
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps ({STEPS})")
    parser.add_argument(
        "--log-every", type=int, default=LOG_EVERY, help=f"trainer.log_every_n_steps ({LOG_EVERY})"
    )
    parser.add_argument(
        "--warmup", type=int, default=WARMUP, help=f"first steps left out ({WARMUP})"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "overrides", nargs="*", help="more train.py overrides for every recipe (key=value)"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    results = measure(
        tuple(args.recipes),
        steps=args.steps,
        log_every=args.log_every,
        warmup=args.warmup,
        extra=tuple(args.overrides),
    )
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        _child(sys.argv[2:])
    else:
        sys.exit(main())

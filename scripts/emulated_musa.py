"""Run any command on an emulated MUSA device: no MUSA card needed.

    python scripts/emulated_musa.py -- python train.py recipe=bert_squad debug=smoke
    python scripts/emulated_musa.py --cards 2 -- accelerate launch \\
        --config_file conf/accelerate/multi_musa.yaml --num_processes 2 train.py recipe=gpt2_clm debug=smoke
    python scripts/emulated_musa.py --release v1.3.0 --card S80 -- python -m recipes.env
    python scripts/emulated_musa.py --card S5000 -- python -m recipes.env   # MUSA 3.1, FP8, 80 GB

The command runs with a ``torch_musa`` stand-in of the chosen release on its import path. Its
``musa`` device holds tensors in host memory and runs every operator through its CPU kernel on
the same memory (``tests/musa_emulator``, compiled once per torch build with g++ and ninja,
about 40 s on 2 cores); like real hardware it refuses an operator that mixes a ``musa`` tensor with a
CPU one. ``torch.musa`` has what that torch_musa tag has; ``mccl`` runs gloo over the same
memory (S4000, S5000; S80 and S3000 builds have no MCCL). ``--cards`` is the number of cards in the
machine; ``MUSA_VISIBLE_DEVICES`` (which accelerate sets from ``gpu_ids``) chooses among them.

What it cannot show: muDNN kernels, real numerics, speed, memory limits, MCCL topology and the
driver. Those need a card (``scripts/gpu_check.py`` on a lent device).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

from emulator_build import CARDS, build_dir, built, cache_root  # noqa: E402
from fake_torch_musa import NEWEST, RELEASES, write_release  # noqa: E402

DEFAULT_RELEASE = NEWEST


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1 :]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="python scripts/emulated_musa.py",
        description="Run a command on an emulated MUSA device (see the module docstring).",
    )
    parser.add_argument("--cards", type=int, default=1, help="cards in the machine (default 1)")
    parser.add_argument(
        "--release",
        default=DEFAULT_RELEASE,
        choices=sorted(RELEASES),
        help=f"the torch_musa release to stand in for (default {DEFAULT_RELEASE})",
    )
    parser.add_argument(
        "--card", default="S4000", choices=sorted(CARDS), help="the card's kind (default S4000)"
    )
    parser.add_argument(
        "--build", action="store_true", help="compile the device (if needed) and run nothing"
    )
    args = parser.parse_args(own)
    if args.cards < 1:
        parser.error("--cards: at least 1")
    if not command and not args.build:
        parser.error("give the command after --, e.g. -- python train.py recipe=bert_squad")
    return args, command


def site(release: str, card: str, cards: int) -> Path:
    """The stand-in's folder for this release, card and count (written once, atomically; the
    command then runs in this process's place, so signals and exit codes are its own)."""
    # Keyed on what the stand-in is written from, and where from: another checkout or an edit
    # of the stand-in never runs a stale copy.
    key = hashlib.sha256(str(TESTS).encode())
    for source in (TESTS / "fake_torch_musa.py", TESTS / "musa_emulator" / "__init__.py"):
        key.update(source.read_bytes())
    folder = (
        cache_root()
        / "site"
        / f"{release}-{card}-{cards}-{build_dir().name}-{key.hexdigest()[:12]}"
    )
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        write_release(partial, release, devices=cards, emulated=card)
        try:
            partial.rename(folder)
        except OSError:  # another process wrote it first
            shutil.rmtree(partial, ignore_errors=True)
    return folder


def environment(release: str, card: str, cards: int, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the stand-in of ``release`` on the import path."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site(release, card, cards)), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.pop("ACCELERATE_USE_CPU", None)  # the device is the point: a CPU launch hides it
    return env


def main(argv: list[str] | None = None) -> int:
    args, command = parse(sys.argv[1:] if argv is None else argv)
    if not built():  # compile here, once, rather than in each process of a launch
        from musa_emulator import extension

        extension()
    if args.build:
        return 0
    card = CARDS[args.card]
    print(
        f"emulated MUSA: {args.cards} x {card.name} (capability {card.capability[0]}."
        f"{card.capability[1]}), torch_musa {args.release} stand-in; host memory and CPU kernels, "
        "so no muDNN kernels, real numerics, speed, memory limits or MCCL topology",
        file=sys.stderr,
        flush=True,
    )
    env = environment(args.release, args.card, args.cards, dict(os.environ))
    executable = shutil.which(command[0], path=env.get("PATH"))
    if executable is None:
        print(f"emulated MUSA: no such command: {command[0]}", file=sys.stderr)
        return 127
    os.execve(executable, command, env)


if __name__ == "__main__":
    sys.exit(main())

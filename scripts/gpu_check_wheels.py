"""Fetch, into ``.whl/``, the wheels a device machine lacks to run ``scripts/gpu_check.py``.

    .venv/bin/python scripts/gpu_check_wheels.py             # download (and check) them
    .venv/bin/python scripts/gpu_check_wheels.py --list      # what it would fetch, and why

It also fetches TRL (``CHECK_EXTRAS``: the llm/*_vs_trl rows run its trainers) and stages slices
of ``../shared/data/squad`` (6,000 train and 1,000 dev questions, whole articles) into
``.whl/gpu_check_data/squad`` for bert_squad/f1 (``--no-data``: not), then prints what would
travel to the device (the checkout's tracked files and the folder) against its 64 MiB.

The device machine of this workplace (an NVIDIA H200; Python 3.12, torch, accelerate,
transformers, peft, pyarrow, pandas ... but no hydra-core, omegaconf or datasets) reaches no
package index. This walks the project's requirements (pyproject.toml) and their requirements,
stops at every package that machine has (``DEVICE_HAS``, its image's package list as read on
2026-11-17) and at what the check never imports (``NOT_NEEDED``), and downloads each remaining
one as a wheel for CPython 3.12 on manylinux x86-64, pinned to the version installed here, so the
device runs what the tests ran. A project published as a source archive only (antlr4's runtime
4.9.3) is built into a wheel here, which must come out pure Python. Other versions of the same
projects in the folder are removed (two versions of one stop the whole install there).

Then it reads every wheel's METADATA: none may require torch, numpy requirements are printed,
and each requirement must be met by another carried wheel or be left to the device (those are
printed with their version ranges; ``gpu_check.py --wheels`` checks them there before running).

On the device (the device README's install; nothing of the machine's is replaced):

    python3 scripts/gpu_check.py --wheels .whl --out $OUT/gpu
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# The device image's Python packages (/work/.library/device/KINDS.md, read on 2026-11-17).
_DEVICE_LIST = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
    ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
    psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
    werkzeug wheel wrapt xarray xxhash yarl zipp
"""
DEVICE_HAS = frozenset(map(canonicalize_name, _DEVICE_LIST.split()))
# Fetched although the project does not require them: the llm/*_vs_trl rows run TRL's trainers
# (scripts/throughput.py sft / grpo).
CHECK_EXTRAS = ("trl",)
# SQuAD v1.1 slices for bert_squad/f1 (whole articles; gpu_check.py reads <dest>/gpu_check_data).
SHARED_SQUAD = ROOT.parent / "shared" / "data" / "squad"
SLICES = {
    "train.json": ("train-v1.1-subset.json", 6000),
    "dev.json": ("dev-v1.1-part1.json", 1000),
}
DEVICE_TREE_MIB = 64  # what travels to the device machine: the checkout and carried folders
# Requirements the check never imports: every row trains with logger=none.
NOT_NEEDED = {"wandb": "every gpu_check row runs with logger=none"}
# The device's interpreter and platform, for requirement markers.
DEVICE_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
# The device README's download flags: CPython 3.12 wheels for manylinux x86-64.
DOWNLOAD = (
    "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
    "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
    "--platform", "manylinux1_x86_64",
)  # fmt: skip
NEVER = ("torch",)  # a carried wheel must not bring or want these


def project_requirements() -> list[Requirement]:
    """The project's own requirements, from pyproject.toml (its installed metadata on 3.10)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return [Requirement(r) for r in importlib.metadata.requires("musa-recipes") or []]
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return [Requirement(r) for r in data["project"]["dependencies"]]


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate(DEVICE_ENV)


def wanted(extra: list[str]) -> tuple[dict[str, str], list[str]]:
    """``{project: version installed here}`` for every package the device lacks, and one line
    per requirement left to the device or skipped (why)."""
    found: dict[str, str] = {}
    notes: list[str] = []
    queue = [*project_requirements(), *map(Requirement, extra)]
    seen: set[str] = set()
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if not applies(req) or name in seen:
            continue
        seen.add(name)
        forced = any(canonicalize_name(Requirement(e).name) == name for e in extra)
        if name in NOT_NEEDED:
            notes.append(f"not fetched: {req} ({NOT_NEEDED[name]})")
            continue
        if name in DEVICE_HAS and not forced:
            notes.append(f"the device has it: {req}")
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(
                f"{req.name} is not installed here: install the project first"
            ) from None
        found[name] = version
        queue.extend(Requirement(r) for r in importlib.metadata.requires(req.name) or [])
    return found, notes


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonicalize_name(name), version


def fetch(projects: dict[str, str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    have = {_wheel_name(p): p for p in dest.glob("*.whl")}
    for (name, version), path in have.items():
        if name in projects and Version(version) != Version(projects[name]):
            print(f"removing {path.name} (another version of {name})")
            path.unlink()
    for name, version in sorted(projects.items()):
        if any(n == name and Version(v) == Version(version) for n, v in have):
            continue
        pin = f"{name}=={version}"
        done = subprocess.run(
            [sys.executable, "-m", "pip", *DOWNLOAD, "-d", str(dest), pin],
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            continue
        if "No matching distribution" not in done.stderr:
            raise SystemExit(f"pip download {pin} failed:\n{done.stderr}")
        # Published as a source archive only: build it here; it must be pure Python.
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, pin],
                check=True,
            )
            (built,) = Path(tmp).glob("*.whl")
            if not built.name.endswith("-py3-none-any.whl"):
                raise SystemExit(f"{built.name}: not pure Python, cannot be built for the device")
            built.rename(dest / built.name)
            print(f"built {built.name} (no wheel on the index)")


def metadata(path: Path) -> list[Requirement]:
    """A wheel's ``Requires-Dist`` requirements, read from its METADATA."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(z.read(name).decode("utf-8"))
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def check(projects: dict[str, str], dest: Path) -> list[str]:
    """What each carried wheel requires: problems (torch, an unmet carried pin) and the
    requirements left to the device."""
    problems = []
    mine = {_wheel_name(p)[0]: p for p in dest.glob("*.whl") if _wheel_name(p)[0] in projects}
    missing = sorted(set(projects) - set(mine))
    if missing:
        problems.append(f"no wheel for {', '.join(missing)}")
    device_side: dict[str, list[str]] = {}
    for name, path in sorted(mine.items()):
        for req in metadata(path):
            if not applies(req):
                continue
            other = canonicalize_name(req.name)
            if other in NEVER:
                problems.append(f"{path.name} requires {req}")
            elif other in projects:
                if not req.specifier.contains(projects[other], prereleases=True):
                    problems.append(f"{path.name} requires {req}; {projects[other]} is carried")
            elif other in NOT_NEEDED:
                continue
            else:
                device_side.setdefault(other, []).append(f"{name}: {req.specifier or 'any'}")
    for other, wants in sorted(device_side.items()):
        flag = " (numpy: left as the device has it)" if other == "numpy" else ""
        print(f"  left to the device: {other} ({'; '.join(wants)}){flag}")
    return problems


def stage_data(dest: Path) -> list[str]:
    """Slices of the shared SQuAD files for bert_squad/f1 into ``dest/gpu_check_data/squad``
    (the device machine has no ../shared/data; the whole files would not fit what travels)."""
    sys.path.insert(0, str(ROOT))
    from scripts.gpu_check_data import DATA_FOLDER, squad_slice

    if not SHARED_SQUAD.is_dir():
        return [f"no {SHARED_SQUAD}: bert_squad/f1 will train on the bundled SQuAD slice"]
    lines = []
    for name, (source, questions) in SLICES.items():
        target = dest / DATA_FOLDER / "squad" / name
        count = squad_slice(SHARED_SQUAD / source, target, questions)
        lines.append(f"staged {target} ({count} questions of {source})")
    return lines


def tree_mib(paths: list[Path]) -> float:
    """MiB of this checkout's tracked files (they travel with every device call) and ``paths``."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    total = sum((ROOT / name.decode()).stat().st_size for name in tracked if name)
    for path in paths:
        total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return total / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--list", action="store_true", help="print what would be fetched")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="REQUIREMENT",
        help="fetch this too, even if the device has it (an older pyarrow there, say)",
    )
    parser.add_argument(
        "--no-data",
        action="store_true",
        help="do not stage the SQuAD slices of ../shared/data for bert_squad/f1",
    )
    args = parser.parse_args()
    projects, notes = wanted([*CHECK_EXTRAS, *args.also])
    for line in notes:
        print(line)
    print("fetch: " + ", ".join(f"{n}=={v}" for n, v in sorted(projects.items())))
    if args.list:
        return 0
    fetch(projects, args.dest)
    problems = check(projects, args.dest)
    total = 0
    for path in sorted(args.dest.glob("*.whl")):
        size = path.stat().st_size
        total += size
        mine = "" if _wheel_name(path)[0] in projects else "  (not ours: it travels too)"
        print(f"{size / 2**20:8.2f} MiB  {path.name}{mine}")
    print(f"{total / 2**20:8.2f} MiB in {args.dest}")
    if not args.no_data:
        for line in stage_data(args.dest):
            print(line)
    travels = tree_mib([args.dest])
    print(f"the checkout's tracked files and {args.dest}: {travels:.1f} MiB of {DEVICE_TREE_MIB}")
    if travels > DEVICE_TREE_MIB - 2:
        problems.append(f"{travels:.1f} MiB would travel: over the device's {DEVICE_TREE_MIB} MiB")
    for line in problems:
        print(f"PROBLEM: {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

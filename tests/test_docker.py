"""What the Docker image must get right, checked without a Docker engine.

hadolint lints the Dockerfile (.ci/run). Here: the default base is the documented MTT S4000
build, the CPU variant's torch satisfies the project's floor, the entry point composes, the
build context lets through what is copied, and the README's build arguments exist. The install
step itself (slow) runs in a throwaway virtual environment that sees this environment's
packages, offline (pip gets no index, only a folder of tiny fake wheels): it must keep the
installed torch, keep a vendor build's torch (versions like 2.2.0a0+git8ac9b20), refuse a
dependency that wants another torch, and refuse a torch below the project's floor.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from recipes import backends

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_TIMEOUT_S = 90


def instructions() -> list[tuple[str, str]]:
    """``(KEYWORD, arguments)`` per Dockerfile instruction, continuation lines joined (no comment
    sits inside an instruction in this Dockerfile)."""
    text = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", "")
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(" ", 1)) for line in lines if line and not line.startswith("#")]


def values(keyword: str) -> list[str]:
    return [value for key, value in instructions() if key == keyword]


def build_args() -> dict[str, str]:
    """``ARG NAME=default`` as a dict (the first default of each name)."""
    found: dict[str, str] = {}
    for value in values("ARG"):
        name, _, default = shlex.split(value)[0].partition("=")
        found.setdefault(name, default)
    return found


def pyproject_requirements(key: str) -> list[Requirement]:
    """The quoted requirements of a ``key = [...]`` list in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    listed = re.search(rf"^{key}\s*=\s*\[(.*?)\]", text, re.M | re.S)
    return [Requirement(item) for item in re.findall(r'^\s*"([^"]+)"', listed[1], re.M)]


def project_torch() -> Requirement:
    return next(r for r in pyproject_requirements("dependencies") if r.name == "torch")


def test_default_base_image_is_the_documented_s4000_build() -> None:
    default = build_args()["BASE_IMAGE"]
    assert values("FROM") == ["${BASE_IMAGE}"]
    assert backends.image_gpu(default) == "S4000"
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert any(default in path.read_text(encoding="utf-8") for path in documents), default
    # The doctor names the build the container runs on from this variable.
    assert any(f"{backends.BASE_IMAGE_ENV_VAR}=${{BASE_IMAGE}}" in env for env in values("ENV"))


def test_cpu_variant_torch_meets_the_project_floor() -> None:
    pins = [Requirement(spec) for spec in build_args()["TORCH_SPEC"].split()]
    torch_pin = next(pin for pin in pins if pin.name == "torch")
    pinned = next(iter(torch_pin.specifier)).version
    assert project_torch().specifier.contains(pinned, prereleases=True), (torch_pin, pinned)


def test_image_installs_the_project_and_its_requirements_under_the_torch_pins() -> None:
    (install,) = [v for v in values("RUN") if "pip install" in v]
    assert "pip install --no-deps ." in install  # the project, never weighing torch
    # Then every requirement the project declares (peft for LoRA among them), but torch,
    # constrained to the torch / numpy the image already has.
    assert "m.requires('musa-recipes')" in install
    assert '--constraint "$tmp/keep.txt" --requirement "$tmp/requirements.txt"' in install
    assert "peft" in {r.name for r in pyproject_requirements("dependencies")}


def test_entry_point_is_train_py_as_a_user_and_its_default_composes(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from recipes.config import register_resolvers, validate

    assert [json.loads(v) for v in values("ENTRYPOINT")] == [["python", "train.py"]]
    user = values("USER")[-1].strip("${}")
    assert build_args().get(user, user) not in ("", "0", "root")
    (command,) = [json.loads(v) for v in values("CMD")]
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        validate(compose("train", overrides=[*command, f"output_dir={tmp_path}"]))


def test_build_context_lets_through_what_is_copied() -> None:
    # .dockerignore is an allow-list: "*" first, then "!" for each copied path.
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for value in values("COPY"):
        for source in value.split()[:-1]:
            assert source.rstrip("/") in allowed, f"COPY {source}: kept out by .dockerignore"
            assert (ROOT / source).exists(), source


def test_documented_build_args_exist() -> None:
    documents = [ROOT / "README.md", DOCKERFILE, *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(path.read_text(encoding="utf-8") for path in documents)
    documented = set(re.findall(r"--build-arg\s+([A-Z_]+)=", text))
    assert documented and documented <= set(build_args()), documented - set(build_args())


# ---------------------------------------------------------------------------------------------
# The install step, run for real in a throwaway environment


def _write_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal pure-Python wheel: enough for pip to resolve and install it."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": "\n".join(
            ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
            + [f"Requires-Dist: {r}" for r in requires]
        )
        + "\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
        wheel.writestr(f"{dist}.dist-info/RECORD", record)


def _fake_installed(site: Path, name: str, version: str) -> None:
    """Installed-package metadata only (a vendor torch as pip sees it); it shadows the real one."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("vendor\n")
    (info / "RECORD").write_text("")


@dataclass
class Throwaway:
    root: Path
    python: Path
    site: Path
    links: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": f"{self.python.parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"),
            "LANG": "C.UTF-8",
            **extra,
            # Nothing is ever downloaded (a real torch is gigabytes), whatever the Dockerfile says.
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_INDEX": "1",
            "PIP_NO_INPUT": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            # pip reads this as the value of "build isolation": "0" turns it off, so the project
            # builds with the setuptools already installed instead of fetching one.
            "PIP_NO_BUILD_ISOLATION": "0",
            "PIP_FIND_LINKS": str(self.links),
        }

    def pins(self) -> dict[str, str]:
        """torch-family packages as the throwaway's pip sees them (name -> version)."""
        out = self.pip("list", "--format=freeze").stdout.splitlines()
        pairs = (line.split("==", 1) for line in out if "==" in line)
        return {n.lower(): v for n, v in pairs if n.lower().startswith("torch")}

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.python), "-m", "pip", *args],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=INSTALL_TIMEOUT_S,
        )

    def torch_origin(self) -> str:
        code = "import importlib.util as u; print(u.find_spec('torch').origin)"
        done = subprocess.run(
            [str(self.python), "-c", code], capture_output=True, text=True, env=self.env()
        )
        return done.stdout.strip()

    def run_install_step(self, **args: str) -> subprocess.CompletedProcess:
        """The Dockerfile's install RUN with its SHELL and ARGs, in the files its COPYs copy."""
        context = self.root / "context"
        for value in values("COPY"):
            *sources, destination = value.split()
            for source in sources:
                target = context / destination
                if destination.endswith("/"):
                    target = target / Path(source).name
                if (ROOT / source).is_dir():
                    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                    shutil.copytree(ROOT / source, target, ignore=ignore, dirs_exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / source, target)
        (shell,) = [json.loads(v) for v in values("SHELL")]
        (command,) = [v for v in values("RUN") if "pip install" in v]
        assert set(args) <= set(build_args()), f"no such ARG: {set(args) - set(build_args())}"
        return subprocess.run(
            [*shell, command],
            cwd=context,
            capture_output=True,
            text=True,
            env=self.env(**{**build_args(), **args}),
            timeout=INSTALL_TIMEOUT_S,
        )


@pytest.fixture
def throwaway(tmp_path: Path) -> Throwaway:
    """A virtual environment without pip or packages of its own that sees this environment's
    (torch, the project's dependencies, pip, setuptools) through a path file. pip installs into
    it and refuses to uninstall anything outside it, so this environment is never touched."""
    for need in pyproject_requirements("requires"):  # the build backend, used offline
        have = metadata.version(need.name) if find_spec(need.name) else None
        if have is None or not need.specifier.contains(have, prereleases=True):
            pytest.skip(f"cannot build the project offline: needs {need}, this has {have}")
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    site = Path(done.stdout.strip())
    (site / "parent-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for folder in ("home", "tmp", "links"):
        (tmp_path / folder).mkdir()
    return Throwaway(tmp_path, python, site, tmp_path / "links")


def _output(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"


@pytest.mark.slow
def test_install_step_keeps_the_installed_torch(throwaway: Throwaway) -> None:
    torch_version = metadata.version("torch")
    torch_origin = find_spec("torch").origin
    assert throwaway.pins()["torch"] == torch_version
    done = throwaway.run_install_step()
    assert done.returncode == 0, _output(done)
    # The project went into the throwaway, torch stayed where and what it was.
    assert (throwaway.site / "recipes").is_dir(), _output(done)
    assert throwaway.pins()["torch"] == torch_version
    assert throwaway.torch_origin() == torch_origin
    assert not list(throwaway.site.glob("torch*")), "something torch-like was installed"
    assert metadata.version("torch") == torch_version  # this environment untouched


def _wants_newer_torch(torch_version: str) -> dict[str, str]:
    """The project's requirements whose release installed here declares a torch requirement that
    ``torch_version`` does not meet (accelerate 1.16 wants torch>=2.6), each with the project's
    floor for it: name -> floor version."""
    found = {}
    for need in pyproject_requirements("dependencies"):
        if need.name == "torch":
            continue
        try:  # by distribution name: hydra-core's module is hydra
            wants = [Requirement(r) for r in metadata.requires(need.name) or []]
        except metadata.PackageNotFoundError:
            continue
        if any(
            r.name == "torch"
            and r.marker is None
            and not r.specifier.contains(torch_version, prereleases=True)
            for r in wants
        ):
            found[need.name] = min(spec.version for spec in need.specifier)
    return found


@pytest.mark.slow
def test_install_step_keeps_a_vendor_torch_build(throwaway: Throwaway) -> None:
    # What a torch_musa 1.3 image reports. Its torch is a pre-release by version number, so the
    # project's torch>=2.2 alone would not accept it; the install must keep it all the same.
    vendor_torch = "2.2.0a0+git8ac9b20"
    _fake_installed(throwaway.site, "torch", vendor_torch)
    _fake_installed(throwaway.site, "torch_musa", "1.3.0")
    # A requirement whose newest release wants a newer torch must resolve to an older release
    # that accepts the image's, as pip does against PyPI (accelerate 1.15 on torch 2.2). Offline,
    # the older release is a wheel at the project's floor that accepts any torch 2.
    older = _wants_newer_torch(vendor_torch)
    for name, version in older.items():
        _write_wheel(throwaway.links, name, version, requires=("torch>=2.0",))
    before = throwaway.pins()
    assert before == {"torch": vendor_torch, "torch_musa": "1.3.0"}
    done = throwaway.run_install_step()
    assert done.returncode == 0, _output(done)
    assert throwaway.pins() == before
    installer = throwaway.site / f"torch-{vendor_torch}.dist-info" / "INSTALLER"
    assert installer.read_text() == "vendor\n"
    for name, version in older.items():
        assert (throwaway.site / f"{name}-{version}.dist-info").is_dir(), _output(done)


@pytest.mark.slow
def test_install_step_refuses_a_requirement_that_wants_another_torch(
    throwaway: Throwaway,
) -> None:
    _write_wheel(throwaway.links, "torch", "99.0.0")
    _write_wheel(throwaway.links, "wants-newer-torch", "1.0", requires=("torch>=99",))
    # Unconstrained, pip would replace torch with the (fake) newer one it can reach...
    control = throwaway.pip("install", "--dry-run", "wants-newer-torch")
    assert control.returncode == 0, _output(control)
    assert "torch-99.0.0" in control.stdout, _output(control)
    # ...the Dockerfile's install step refuses instead, and torch stays.
    before = throwaway.pins()
    done = throwaway.run_install_step(EXTRA_REQUIREMENTS="wants-newer-torch")
    assert done.returncode != 0, _output(done)
    assert throwaway.pins() == before
    assert not list(throwaway.site.glob("torch*"))


@pytest.mark.slow
def test_install_step_refuses_a_torch_below_the_project_floor(throwaway: Throwaway) -> None:
    _fake_installed(throwaway.site, "torch", "2.0.0")  # torch_musa 1.0-1.2 images
    done = throwaway.run_install_step()
    assert done.returncode != 0, _output(done)
    assert "torch 2.0.0" in done.stderr, _output(done)
    assert throwaway.pins()["torch"] == "2.0.0"

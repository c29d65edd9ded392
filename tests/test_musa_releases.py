"""What the project decides on MUSA, per torch_musa release (fakes in ``fake_torch_musa.py``).

The per-release runs are marked slow (one fresh process per release); the rules they rest on
(fused AdamW per torch release, portable optimizer state) run in the default set.

Each release runs in its own process (torch_musa renames torch's PrivateUse1 backend, which
cannot be undone), which reports the decisions as JSON.
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_torch_musa import write_release

from recipes import backends, device
from recipes.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]

_DECISIONS = """
import functools, io, json
import torch
from recipes import device, env
from recipes.flops import precision_for_peak
from recipes.optim import build_optimizer

backend = device.backend()  # imports torch_musa where torch did not load it (before 2.0-pt25)
musa = torch.device("musa:0")
tf32_default = device.tf32_enabled()
off = device.set_tf32(False)
peak_off = device.peak_flops(musa, precision_for_peak("no", off))
on = device.set_tf32(True)
peak_on = device.peak_flops(musa, precision_for_peak("no", on))
model = torch.nn.Linear(4, 4)
explicit = build_optimizer(
    functools.partial(torch.optim.AdamW, lr=1e-3, fused=True), torch.nn.Linear(4, 4), musa
)
optimizer = build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-3, fused=None), model, musa)

def steps(opt, net, count):
    for i in range(count):
        net.zero_grad()
        net(torch.full((2, 4), float(i + 1))).pow(2).sum().backward()
        opt.step()


# A checkpoint of the optimizer built for MUSA continues in a plain AdamW elsewhere.
twin = torch.nn.Linear(4, 4)
steps(optimizer, model, 2)
plain = build_optimizer(
    functools.partial(torch.optim.AdamW, lr=1e-3, fused=False), twin, torch.device("cpu")
)
saved = io.BytesIO()  # through bytes, as a checkpoint: load_state_dict would share tensors
torch.save(optimizer.state_dict(), saved)
saved.seek(0)
plain.load_state_dict(torch.load(saved))
twin.load_state_dict(model.state_dict())
steps(optimizer, model, 2)
steps(plain, twin, 2)
portable = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))
report = env.collect()
print(json.dumps({
    "portable": portable,
    "plain_fused": [g["fused"] for g in plain.param_groups],
    "backend": backend,
    "names": device.device_names(),
    "mixed_precision": device.default_mixed_precision(),
    "attn": device.default_attn_implementation(),
    "compile": device.compile_unsupported_reason(),
    "tf32_default": tf32_default, "tf32_off": off, "tf32_on": on,
    "peak_off": peak_off, "peak_on": peak_on,
    "optimizer": type(optimizer).__module__ + "." + type(optimizer).__name__,
    "optimizer_fused": optimizer.defaults.get("fused"),
    "explicit_fused": type(explicit).__name__,
    "doctor": {k: report[k] for k in ("torch_musa", "sdpa_probe", "default_attn_implementation")},
    "advice": report["advice"],
}))
"""


def _env(root: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        **extra,
    }


@functools.cache
def _decisions(tag: str, device_name: str, capability: tuple[int, int]) -> dict[str, Any]:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=f"torch_musa_{tag}_"))
    write_release(root, tag, device_name=device_name, capability=capability)
    done = subprocess.run(
        [sys.executable, "-c", _DECISIONS],
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The images the vendor ships with each release: S80 for the 1.3 example, S4000 for the others.
CASES = {
    "v1.3.0": ("MTT S80", (2, 1)),
    "v2.0.0": ("MTT S4000", (2, 2)),
    "v2.7.1": ("MTT S4000", (2, 2)),
}


def decisions(tag: str) -> dict[str, Any]:
    return _decisions(tag, *CASES[tag])


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize("tag", sorted(CASES))
def test_detected_as_musa(tag: str) -> None:
    found = decisions(tag)
    assert found["backend"] == "musa"
    assert found["names"] == [CASES[tag][0]]
    assert found["doctor"]["torch_musa"]["imported"] is True


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize(
    ("tag", "expected"), [("v1.3.0", "fp16"), ("v2.0.0", "bf16"), ("v2.7.1", "bf16")]
)
def test_precision_follows_capability(tag: str, expected: str) -> None:
    assert decisions(tag)["mixed_precision"] == expected


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize("tag", sorted(CASES))
def test_sdpa_is_the_default_from_v1_2_1(tag: str) -> None:
    assert decisions(tag)["attn"] == "sdpa"
    assert decisions(tag)["doctor"]["default_attn_implementation"] == "sdpa"


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize(
    ("tag", "default"), [("v1.3.0", False), ("v2.0.0", False), ("v2.7.1", True)]
)
def test_tf32_is_set_both_ways(tag: str, default: bool) -> None:
    found = decisions(tag)
    assert found["tf32_default"] is default
    assert (found["tf32_off"], found["tf32_on"]) == (False, True)


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize("tag", ["v2.0.0", "v2.7.1"])
def test_mfu_uses_the_tf32_setting_in_effect(tag: str) -> None:
    found = decisions(tag)  # MTT S4000: 25 TFLOP/s fp32, 50 TF32
    assert (found["peak_off"], found["peak_on"]) == (25e12, 50e12)


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize(
    ("tag", "optimizer", "fused"),
    [
        ("v1.3.0", "torch.optim.adamw.AdamW", None),
        ("v2.0.0", "torch.optim.adamw.AdamW", None),
        ("v2.7.1", "torch_musa.optim.FusedAdamW", True),
    ],
)
def test_fused_optimizer_choice(tag: str, optimizer: str, fused: bool | None) -> None:
    found = decisions(tag)
    assert (found["optimizer"], found["optimizer_fused"]) == (optimizer, fused)
    # optimizer.fused=true on MUSA also means torch_musa's kernel where there is one.
    assert found["explicit_fused"] == optimizer.rpartition(".")[2]


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize("tag", sorted(CASES))
def test_optimizer_state_portable_to_adamw(tag: str) -> None:
    found = decisions(tag)
    assert found["portable"] < 1e-6
    assert found["plain_fused"] == [False, False]  # the loading optimizer keeps its own kernel


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize(
    ("tag", "refused"), [("v1.3.0", True), ("v2.0.0", False), ("v2.7.1", False)]
)
def test_compile_refused_without_a_dynamo_backend(tag: str, refused: bool) -> None:
    reason = decisions(tag)["compile"]
    if refused:
        assert "1.3.0+aa63a73" in reason  # names the installed release
    else:
        assert reason is None


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize("tag", sorted(CASES))
def test_doctor_versions_and_sdpa_check(tag: str) -> None:
    found = decisions(tag)
    advice = "\n".join(found["advice"])
    expected = backends.torch_for_torch_musa(found["doctor"]["torch_musa"]["version"])
    assert found["doctor"]["torch_musa"]["expected_torch"] == list(expected)
    assert f"torch=={expected[0]}" in advice  # the torch to pin next to this torch_musa
    # The simulated card cannot hold tensors: to the probe that is a build whose kernels fail.
    assert found["doctor"]["sdpa_probe"]["ok"] is False
    assert "musa:0" in advice and "model.attn_implementation=eager" in advice


@pytest.mark.slow  # a fresh process per simulated release
def test_broken_autoloaded_torch_musa_and_the_doctor(tmp_path: Path) -> None:
    write_release(tmp_path, "v2.7.1", broken=True)
    plain = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # torch >= 2.5 loads the entry point on import; a broken torch_musa takes torch down.
    assert plain.returncode != 0
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in plain.stderr
    doctor = subprocess.run(
        [sys.executable, "-m", "recipes.env", "--json"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    report = json.loads(doctor.stdout)
    assert report["backend"] == "cpu"
    assert report["torch_musa"]["installed"] is True
    assert "OSError: libsrv_um_MUSA.so" in report["advice"][0]


# --- the fused-kernel rule per torch release, and the state every AdamW variant shares ---


@pytest.mark.parametrize(
    ("release", "target", "params_on", "expected"),
    [
        ((2, 2), "cuda", "cpu", False),  # built before prepare: torch 2.2 refuses CPU params
        ((2, 3), "cuda", "cpu", False),
        ((2, 3), "cuda", "cuda", True),
        ((2, 4), "cuda", "cpu", True),
        ((2, 3), "cpu", "cpu", False),
        ((2, 4), "cpu", "cpu", True),
        ((2, 7), "cuda", "cpu", True),
        ((2, 7), "musa", "cpu", False),  # torch_musa's FusedAdamW instead
    ],
)
def test_fused_adamw_rule(
    release: tuple[int, int], target: str, params_on: str, expected: bool
) -> None:
    assert device.fused_adamw_ok(target, params_on, release) is expected


def test_fused_adamw_rule_matches_this_torch() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    try:
        optimizer = torch.optim.AdamW(params, fused=True)
        params[0].grad = torch.ones(3)
        optimizer.step()
        works = True
    except RuntimeError:
        works = False
    assert device.fused_adamw_ok("cpu", "cpu") is works


def _steps(optimizer: torch.optim.Optimizer, model: torch.nn.Module, count: int) -> None:
    for i in range(count):
        model.zero_grad()
        model(torch.full((2, 4), float(i + 1))).pow(2).sum().backward()
        optimizer.step()


def test_checkpoint_portable_between_fused_and_foreach_adamw() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    twin = torch.nn.Linear(4, 4)
    twin.load_state_dict(model.state_dict())
    make = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    fused = build_optimizer(functools.partial(make, fused=None), model, torch.device("cpu"))
    foreach = build_optimizer(functools.partial(make, fused=False), twin, torch.device("cpu"))
    assert fused.defaults["fused"] is device.fused_adamw_ok("cpu", "cpu")
    _steps(fused, model, 2)
    saved = io.BytesIO()  # through bytes, as a checkpoint: load_state_dict would share tensors
    torch.save(fused.state_dict(), saved)
    saved.seek(0)
    foreach.load_state_dict(torch.load(saved))
    twin.load_state_dict(model.state_dict())
    assert all(group["fused"] is False for group in foreach.param_groups)  # its own choice
    _steps(fused, model, 2)
    _steps(foreach, twin, 2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b)


# --- fp16 without a grad scaler (accelerate 0.33-0.34 on MUSA) ---


def test_fp16_refused_when_accelerate_made_no_scaler() -> None:
    from types import SimpleNamespace

    from recipes.config import ConfigError
    from recipes.loop import _check_grad_scaler

    # What accelerate 0.33 leaves on MUSA: native AMP on, ``self.scalar`` set instead of
    # ``self.scaler`` (a GPU path that cannot run here, hence the stand-in).
    typo = SimpleNamespace(
        native_amp=True, mixed_precision="fp16", scaler=None, device=torch.device("cpu")
    )
    with pytest.raises(ConfigError, match=r"trainer.mixed_precision=fp16: .*accelerate>=1.0"):
        _check_grad_scaler(typo)
    _check_grad_scaler(SimpleNamespace(**{**vars(typo), "scaler": object()}))
    _check_grad_scaler(SimpleNamespace(**{**vars(typo), "mixed_precision": "bf16"}))


def test_pin_memory_on_cpu_is_off() -> None:
    assert device.pin_memory_kwargs(True, torch.device("cpu")) == {"pin_memory": False}
    assert device.pin_memory_kwargs(False, torch.device("cpu")) == {"pin_memory": False}

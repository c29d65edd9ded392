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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate.utils import DistributedType
from fake_torch_musa import write_release

from recipes import backends, device
from recipes.loop import optimizer_where_it_steps, places_model_first
from recipes.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]

_DECISIONS = """
import functools, io, json, os
import torch
from recipes import device, env
from recipes.flops import precision_for_peak
from recipes.optim import build_optimizer

backend = device.backend()  # imports torch_musa where torch did not load it (before 2.0-pt25)
musa = torch.device("musa:0")
# Rank 3 of a launch, before accelerate has set its device: which cards does precision read?
os.environ["LOCAL_RANK"] = "3"
torch.musa.queried.clear()
device.default_mixed_precision()
queried_by_rank_3 = sorted(set(torch.musa.queried))
del os.environ["LOCAL_RANK"]
tf32_default = device.tf32_enabled()
gemm_default = torch.musa._gemm_tf32()  # the switch this release's GEMMs read
off = device.set_tf32(False)
gemm_off = torch.musa._gemm_tf32()
peak_off = device.peak_flops(musa, precision_for_peak("no", off))
# What the old set_tf32 did (muDNN's switch alone): does it reach this release's GEMMs?
torch.backends.mudnn.allow_tf32 = True
mudnn_alone = torch.musa._gemm_tf32()
on = device.set_tf32(True)
gemm_on = torch.musa._gemm_tf32()
peak_on = device.peak_flops(musa, precision_for_peak("no", on))
os.environ[device.MUBLAS_TF32_OVERRIDE] = "1"
override = [device.set_tf32(False), torch.musa._gemm_tf32(), device.tf32_unsupported_reason(False)]
del os.environ[device.MUBLAS_TF32_OVERRIDE]
device.set_tf32(True)
overlap = {}
for level in ("3", "9"):
    os.environ[device.FSDP2_OVERLAP_ENV] = level
    overlap[level] = device.fsdp2_overlap_unsupported_reason()
del os.environ[device.FSDP2_OVERLAP_ENV]
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
    "queried_by_rank_3": queried_by_rank_3,
    "tf32_after_doctor": device.tf32_enabled(),
    "mccl": device.mccl_available(),
    "collective": device.distributed_backend()[0],
    "launch": [report["launch_num_processes"], report["accelerate_distributed_type"]],
    "checkpointing_torch_2_2": device.checkpointing_autocast_unsupported_reason("bf16", release=(2, 2)),
    "checkpointing_fp32_torch_2_2": device.checkpointing_autocast_unsupported_reason("no", release=(2, 2)),
    "checkpointing_here": device.checkpointing_autocast_unsupported_reason("bf16"),
    "peak_fp16": device.peak_flops(musa, "fp16"),
    "fused_kernel_ok": device.fused_adamw_ok(musa, "cpu"),
    "portable": portable,
    "plain_fused": [g["fused"] for g in plain.param_groups],
    "backend": backend,
    "names": device.device_names(),
    "mixed_precision": device.default_mixed_precision(),
    "attn": device.default_attn_implementation(),
    "compile": device.compile_unsupported_reason(),
    "tf32_default": tf32_default, "tf32_off": off, "tf32_on": on,
    "gemm": [gemm_default, gemm_off, gemm_on], "mudnn_alone": mudnn_alone,
    "override": override, "overlap": overlap, "switches": list(device.tf32_switches()),
    "decisions": report["decisions"],
    "peak_off": peak_off, "peak_on": peak_on,
    "optimizer": type(optimizer).__module__ + "." + type(optimizer).__name__,
    "optimizer_fused": optimizer.defaults.get("fused"),
    "groups_fused": [g.get("fused") for g in optimizer.param_groups],
    "explicit_fused": type(explicit).__name__,
    "explicit_flag": explicit.defaults["fused"] if type(explicit).__name__ == "AdamW" else None,
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


@dataclass(frozen=True)
class Case:
    device_name: str
    capability: tuple[int, int]
    mccl: bool  # S80 / S3000 builds ship without MCCL


# The cards each release's images are built for: S80 for the 1.3 example, S4000 for the others;
# eight of them, as on the vendor's servers.
CASES = {
    "v1.3.0": Case("MTT S80", (2, 1), mccl=False),
    "v1.3.2": Case("MTT S4000", (2, 2), mccl=True),
    "v2.0.0": Case("MTT S4000", (2, 2), mccl=True),
    "v2.5.0": Case("MTT S4000", (2, 2), mccl=True),
    "v2.7.0": Case("MTT S4000", (2, 2), mccl=True),
    "v2.7.1": Case("MTT S4000", (2, 2), mccl=True),
    "v2.7.1-no-mccl": Case("MTT S3000", (2, 1), mccl=False),
    "v2.9.0": Case("MTT S4000", (2, 2), mccl=True),
    "v2.9.1": Case("MTT S4000", (2, 2), mccl=True),
    # 2.11.0.post1 decides as 2.11.0.post2 does (a process each is 30 s of CI): the newest.
    "2.11.0.post2": Case("MTT S4000", (2, 2), mccl=True),
}
# GEMMs read backends.musa.matmul
NEW_GEMM_SWITCH = ("v2.9.0", "v2.9.1", "2.11.0.post2")


@functools.cache
def decisions(case: str) -> dict[str, Any]:
    import tempfile

    found = CASES[case]
    tag = case.split("-")[0]
    root = Path(tempfile.mkdtemp(prefix=f"torch_musa_{case}_"))
    write_release(
        root,
        tag,
        device_name=found.device_name,
        capability=found.capability,
        devices=8,
        mccl=found.mccl,
    )
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


SLOW = pytest.mark.slow  # a fresh process per simulated release


@SLOW
@pytest.mark.parametrize("case", sorted(CASES))
def test_detected_as_musa(case: str) -> None:
    found = decisions(case)
    assert found["backend"] == "musa"
    assert found["names"] == [CASES[case].device_name] * 8
    assert found["doctor"]["torch_musa"]["imported"] is True


@SLOW
@pytest.mark.parametrize("case", sorted(CASES))
def test_precision_follows_capability_of_the_ranks_own_card(case: str) -> None:
    found = decisions(case)
    assert found["mixed_precision"] == ("bf16" if CASES[case].capability >= (2, 2) else "fp16")
    # Rank 3 reads card 3 only, not card 0 (which would open a context there in every rank).
    assert found["queried_by_rank_3"] == [3]


@SLOW
@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_is_the_default_from_v1_2_1(case: str) -> None:
    assert decisions(case)["attn"] == "sdpa"
    assert decisions(case)["doctor"]["default_attn_implementation"] == "sdpa"


@SLOW
@pytest.mark.parametrize(
    ("case", "default"),
    [
        ("v1.3.0", False),
        ("v2.0.0", False),
        ("v2.5.0", False),
        ("v2.7.0", True),
        ("v2.7.1", True),
        # v2.9.0's notes: GEMMs in FP32 by default, TF32 from backends.musa.matmul.allow_tf32.
        ("v2.9.0", False),
        ("v2.9.1", False),
        ("2.11.0.post2", False),
    ],
)
def test_tf32_is_set_both_ways(case: str, default: bool) -> None:
    found = decisions(case)
    assert found["tf32_default"] is default
    assert (found["tf32_off"], found["tf32_on"]) == (False, True)
    # trainer.tf32 reaches the switch this release's GEMMs read, both ways (read from the
    # stand-in, not from the project's own read-back).
    assert found["gemm"] == [default, False, True]
    new_switch = case in NEW_GEMM_SWITCH
    assert found["switches"][0] == (
        "torch.backends.musa.matmul.allow_tf32" if new_switch else "torch.backends.mudnn.allow_tf32"
    )
    # muDNN's switch alone, which set_tf32 set before v2.9 existed, no longer reaches GEMMs.
    assert found["mudnn_alone"] is not new_switch
    assert found["decisions"]["tf32_switches"] == found["switches"]


@SLOW
@pytest.mark.parametrize("case", ["v2.7.1", "v2.9.0"])
def test_mublas_override_keeps_tf32_on_and_tf32_false_is_refused(case: str) -> None:
    tf32_now, gemm, reason = decisions(case)["override"]
    if case in NEW_GEMM_SWITCH:  # the variable forces TF32 on, whatever the switch says
        assert (tf32_now, gemm) == (True, True)
        assert "TORCH_ALLOW_TF32_MUBLAS_OVERRIDE=1" in reason and "2.9.0+1dc7872" in reason
    else:  # v2.7 does not read it
        assert (tf32_now, gemm, reason) == (False, False, None)


@SLOW
@pytest.mark.parametrize(
    ("case", "compile_why"),
    [("v2.7.1", "not measured"), ("v2.9.0", "slower than v2.7.0"), ("2.11.0.post2", "slower")],
)
def test_compile_stays_off_by_default(case: str, compile_why: str) -> None:
    found = decisions(case)["decisions"]
    assert found["compile"] is False
    assert compile_why in found["compile_why"]


@SLOW
@pytest.mark.parametrize(
    ("case", "refused"),
    [("v2.5.0", True), ("v2.7.0", True), ("v2.7.1", False), ("v2.9.1", False)],
)
def test_fsdp2_overlap_level_where_the_release_reads_it(case: str, refused: bool) -> None:
    overlap = decisions(case)["overlap"]
    if refused:  # set, but this release would ignore it
        assert "v2.7.1" in overlap["3"]
    else:
        assert overlap["3"] is None
        assert "0" in overlap["9"] and "4" in overlap["9"]  # out of torch_musa's range


@SLOW
@pytest.mark.parametrize("case", ["v2.0.0", "v2.7.1"])
def test_mfu_uses_the_tf32_setting_in_effect(case: str) -> None:
    found = decisions(case)  # MTT S4000: 25 TFLOP/s fp32, 50 TF32
    assert (found["peak_off"], found["peak_on"]) == (25e12, 50e12)


@SLOW
@pytest.mark.parametrize(("case", "peak"), [("v1.3.0", 14.4e12), ("v2.7.1-no-mccl", 15.2e12)])
def test_mfu_of_fp16_runs_on_s80_and_s3000(case: str, peak: float) -> None:
    # Their default precision is fp16, for which the vendor publishes no figure: the fp32 one.
    assert decisions(case)["peak_fp16"] == peak


@SLOW
@pytest.mark.parametrize(
    ("case", "optimizer", "fused", "kernel"),
    [
        ("v1.3.0", "torch.optim.adamw.AdamW", None, False),
        ("v1.3.2", "torch.optim.adamw.AdamW", None, False),
        ("v2.0.0", "torch.optim.adamw.AdamW", None, False),
        # FusedAdamW refuses the CPU parameters a sharding launcher leaves it: the foreach
        # AdamW, never AdamW(fused=True) unasked, though these releases register its kernel
        # (the vendor finds it unsupported: ms-swift PR #10224).
        ("v2.5.0", "torch.optim.adamw.AdamW", None, True),
        ("v2.7.0", "torch.optim.adamw.AdamW", None, True),
        ("v2.7.1", "torch_musa.optim.FusedAdamW", True, True),
        ("v2.9.0", "torch_musa.optim.FusedAdamW", True, True),
        ("v2.9.1", "torch_musa.optim.FusedAdamW", True, True),
        ("2.11.0.post2", "torch_musa.optim.FusedAdamW", True, True),
    ],
)
def test_fused_optimizer_choice(
    case: str, optimizer: str, fused: bool | None, kernel: bool
) -> None:
    found = decisions(case)
    assert (found["optimizer"], found["optimizer_fused"]) == (optimizer, fused)
    # The doctor names what a run builds for parameters on the card.
    expected = {
        "torch_musa.optim.FusedAdamW": "torch_musa.optim.FusedAdamW",
        "torch.optim.adamw.AdamW": "torch.optim.AdamW (foreach)",
    }
    if case in ("v2.5.0", "v2.7.0"):  # FusedAdamW takes card parameters there, not CPU ones
        expected[optimizer] = "torch_musa.optim.FusedAdamW"
    assert found["decisions"]["adamw"] == expected[optimizer]
    assert found["groups_fused"] == [fused, fused]  # what steps, group by group
    # optimizer.fused=true on MUSA: torch_musa's kernel where it takes the parameters, else
    # torch's AdamW(fused=True), as asked.
    assert found["explicit_fused"] == optimizer.rpartition(".")[2]
    assert found["explicit_flag"] == (None if optimizer.startswith("torch_musa") else True)
    assert found["fused_kernel_ok"] is kernel


@SLOW
@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_state_portable_to_adamw(case: str) -> None:
    found = decisions(case)
    assert found["portable"] < 1e-6
    assert found["plain_fused"] == [False, False]  # the loading optimizer keeps its own kernel


@SLOW
@pytest.mark.parametrize(
    ("case", "refused"), [("v1.3.0", True), ("v1.3.2", False), ("v2.0.0", False)]
)
def test_compile_refused_without_a_dynamo_backend(case: str, refused: bool) -> None:
    reason = decisions(case)["compile"]
    if refused:
        assert "1.3.0+73c9f5b" in reason  # names the installed release
        assert "v1.3.2" in reason  # and the first that has one
    else:
        assert reason is None


@SLOW
@pytest.mark.parametrize(("case", "refused"), [("v1.3.0", True), ("v1.3.2", False)])
def test_checkpointing_under_autocast_needs_torch_musa_1_3_2(case: str, refused: bool) -> None:
    found = decisions(case)  # asked as on torch 2.2, which these releases are built for
    if refused:
        reason = found["checkpointing_torch_2_2"]
        assert "1.3.0+73c9f5b" in reason and "v1.3.2" in reason
    else:
        assert found["checkpointing_torch_2_2"] is None
    assert found["checkpointing_fp32_torch_2_2"] is None  # no autocast, nothing to recompute
    assert found["checkpointing_here"] is None  # torch >= 2.4 asks torch.amp, not torch.musa


@SLOW
@pytest.mark.parametrize("case", sorted(CASES))
def test_mccl_is_read_from_the_registered_backends(case: str) -> None:
    found = decisions(case)
    # The patched is_mccl_available says True in every build; only MCCL builds register it.
    assert found["mccl"] is CASES[case].mccl
    if CASES[case].mccl:
        assert found["collective"] == "mccl"
        assert found["launch"] == [8, "MULTI_MUSA"]
    else:
        assert found["collective"] is None
        assert found["launch"] == [1, "NO"]  # no MULTI_MUSA config that fails at start
        assert any("No MCCL" in line for line in found["advice"])


@SLOW
@pytest.mark.parametrize("case", sorted(CASES))
def test_doctor_versions_and_sdpa_check(case: str) -> None:
    found = decisions(case)
    advice = "\n".join(found["advice"])
    expected = backends.torch_for_torch_musa(found["doctor"]["torch_musa"]["version"])
    assert found["doctor"]["torch_musa"]["expected_torch"] == list(expected)
    assert f"torch=={expected[0]}" in advice  # the torch to pin next to this torch_musa
    # The simulated card cannot hold tensors: to the probe that is a build whose kernels fail.
    probe = found["doctor"]["sdpa_probe"]
    assert probe["ok"] is False
    assert "musa:0" in advice and "model.attn_implementation=eager" in advice
    # The fp32 check runs in full fp32 (torch_musa 2.7 has TF32 on), and TF32 is back after.
    assert probe["dtypes"]["float32"]["tf32"] is False
    assert found["tf32_after_doctor"] is True  # set on before the doctor ran


@SLOW
@pytest.mark.parametrize(
    ("case", "serving", "changes"),
    [
        ("2.11.0.post2", "vllm-musa v0.28: it pins torch_musa 2.11.0.post2", "log / log_"),
        ("v2.9.1", "no vllm-musa release is known to pin torch_musa 2.9.1+467bb87", None),
    ],
)
def test_doctor_names_the_vllm_musa_release(case: str, serving: str, changes: str | None) -> None:
    musa = decisions(case)["doctor"]["torch_musa"]
    assert serving in musa["vllm_musa"]
    if changes is None:
        assert musa["release_changes"] is None
    else:
        assert changes in musa["release_changes"]


@pytest.mark.parametrize(
    ("version", "serving", "confirmed"),
    [
        ("2.11.0.post2+musa5.2.0", "vllm-musa v0.28: it pins torch_musa 2.11.0.post2", True),
        ("2.13.0.post1+musa5.2.0", "vllm-musa v0.32 (reported, unconfirmed)", False),
        ("2.9.1.post1", "no vllm-musa release is known to pin torch_musa 2.9.1.post1", True),
        ("2.7.1+0bc05bf", "no vllm-musa release is known", None),
    ],
)
def test_late_releases_and_their_vllm_musa(
    version: str, serving: str, confirmed: bool | None
) -> None:
    assert serving in backends.vllm_musa_for_torch_musa(version)
    row = backends.late_musa_release(version)
    assert (row and row.confirmed) is confirmed or (row is None and confirmed is None)
    # Only 2.11.0.post2 has log / log_ kernels of its own, which torchada stops overriding.
    if row is not None:
        assert ("stops overriding" in row.changes) is (version.startswith("2.11.0.post2"))
    # Every release with a stand-in maps to the torch it is built for.
    assert backends.torch_for_torch_musa(version)


_REFUSAL = """
import os, sys
from types import SimpleNamespace
import torch
from recipes import device
from recipes.config import ConfigError, TrainerConfig
from recipes.session import _check_device_support

device.backend()
os.environ.update(dict(arg.split("=", 1) for arg in sys.argv[2:]))
card = SimpleNamespace(device=torch.device("musa:0"), mixed_precision="no")
try:
    _check_device_support(TrainerConfig(tf32=sys.argv[1] == "true"), card)
except ConfigError as err:
    print(err)
"""


@pytest.mark.slow  # a fresh process per simulated release
@pytest.mark.parametrize(
    ("tag", "tf32", "env", "refused"),
    [
        # The override forces TF32 on the GEMMs of v2.9+, which trainer.tf32=false cannot undo.
        ("v2.9.0", "false", "TORCH_ALLOW_TF32_MUBLAS_OVERRIDE=1", "trainer.tf32=false: "),
        # v2.7.0 has no overlap levels: the variable would be ignored without a word.
        (
            "v2.7.0",
            "true",
            "TORCH_MUSA_FSDP2_OVERLAP_LEVEL=3",
            "TORCH_MUSA_FSDP2_OVERLAP_LEVEL=3: ",
        ),
    ],
)
def test_settings_the_release_ignores_are_refused_in_one_line(
    tmp_path: Path, tag: str, tf32: str, env: str, refused: str
) -> None:
    write_release(tmp_path, tag)
    done = subprocess.run(
        [sys.executable, "-c", _REFUSAL, tf32, env],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(refused), done.stdout


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
        # Not this process's PrivateUse1 backend (no torch_musa here): the MUSA kernel rule is
        # tested on the simulated releases (test_fused_optimizer_choice).
        ((2, 7), "musa", "cpu", False),
    ],
)
def test_fused_adamw_rule(
    release: tuple[int, int], target: str, params_on: str, expected: bool
) -> None:
    assert device.fused_adamw_ok(target, params_on, release) is expected


@pytest.mark.parametrize(
    ("distributed_type", "moved"),
    [
        (DistributedType.NO, True),
        (DistributedType.MULTI_GPU, True),
        (DistributedType.MULTI_MUSA, True),
        (DistributedType.MULTI_CPU, True),
        (DistributedType.FSDP, False),  # sharded from where it is
        (DistributedType.DEEPSPEED, False),  # the engine places it
    ],
)
def test_model_is_on_its_device_before_the_optimizer_is_built(
    distributed_type: DistributedType, moved: bool
) -> None:
    # So that torch_musa's FusedAdamW (musa only up to v2.7.0) gets parameters it accepts. The
    # meta device stands in for an accelerator (what accelerate's Accelerator offers the loop).
    assert places_model_first(distributed_type, device_placement=True) is moved
    assert places_model_first(distributed_type, device_placement=False) is False
    accelerator = SimpleNamespace(
        device=torch.device("meta"), distributed_type=distributed_type, device_placement=True
    )
    model = torch.nn.Linear(4, 4)
    optimizer = optimizer_where_it_steps(
        functools.partial(torch.optim.AdamW, lr=1e-3, fused=None), model, accelerator
    )
    built_on = {p.device.type for group in optimizer.param_groups for p in group["params"]}
    assert built_on == {"meta" if moved else "cpu"}
    assert {p.device.type for p in model.parameters()} == built_on  # the model's own parameters


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
    from recipes.session import _check_grad_scaler

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

"""peft 0.19-0.21 with an older torchao (the vendor's training image ships 0.9.0): one line at
start, exit 2, never peft's ImportError at the first LoRA layer (recipes/packages.py). peft 0.22
and later only warn and turn their torchao support off: LoRA trains, nothing is refused.

A torchao of a given version is made visible as peft's check reads it: a package folder and its
distribution metadata on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
from conftest import run_train
from packaging.version import Version
from peft import import_utils

from recipes import env, packages


def _torchao(root: Path, version: str) -> Path:
    (root / "torchao").mkdir(parents=True)
    (root / "torchao" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = root / f"torchao-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchao\nVersion: {version}\n")
    return root


@pytest.mark.parametrize(
    ("peft_version", "torchao", "refused"),
    [
        ("0.18.1", "0.9.0", False),  # ms-swift's pin: torchao >= 0.4.0 is enough
        ("0.18.1", "0.3.0", True),
        ("0.19.0", "0.9.0", True),
        ("0.21.2", "0.15.1", True),
        ("0.21.2", "0.16.0", False),
        ("0.21.2", None, False),  # no torchao: peft never asks
        ("0.22.0", "0.9.0", False),  # warns and turns its torchao support off
        (None, "0.9.0", False),
    ],
)
def test_peft_torchao_rule(peft_version: str | None, torchao: str | None, refused: bool) -> None:
    line = packages.peft_torchao_conflict(peft_version, torchao)
    assert (line is not None) is refused
    if refused:
        assert f"peft {peft_version}" in line and f"torchao {torchao}" in line
        assert 'pip install "peft<0.19"' in line and "newer torchao" in line


# The installed peft raises on an old torchao (0.19-0.21), or only warns (0.22 and later).
PEFT_RAISES = Version(peft.__version__) < packages.PEFT_WARNS_FROM


@pytest.mark.parametrize(("torchao", "old"), [("0.9.0", True), ("0.16.0", False)])
def test_the_check_agrees_with_peft_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torchao: str, old: bool
) -> None:
    monkeypatch.syspath_prepend(str(_torchao(tmp_path, torchao)))
    line = packages.installed_peft_torchao_conflict()
    refused = old and PEFT_RAISES
    assert (line is not None) is refused
    # peft's own check (uncached), reading the same torchao: the ImportError LoRA would raise,
    # or (peft >= 0.22) a warning and its torchao support off.
    if refused:
        with pytest.raises(ImportError, match=f"Found version {torchao}"):
            import_utils.is_torchao_available.__wrapped__()
        assert f"peft {peft.__version__}" in line
    elif old:
        with pytest.warns(UserWarning, match=f"Found version {torchao}"):
            assert import_utils.is_torchao_available.__wrapped__() is False
    else:
        assert import_utils.is_torchao_available.__wrapped__() is True
    # The doctor reports the same, and advises the fix.
    found = env.peft_torchao()
    assert (found["peft"], found["torchao"], found["agree"]) == (
        peft.__version__,
        torchao,
        not refused,
    )
    assert bool(env._advice_packages({"peft_torchao": found})) is refused


@pytest.mark.skipif(not PEFT_RAISES, reason="peft >= 0.22 trains beside an old torchao (below)")
def test_lora_run_stops_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(_torchao(tmp_path / "site", "0.9.0")))
    run = tmp_path / "run"
    done = run_train("recipe=llama_dpo", "debug=smoke", f"output_dir={run}", check=False)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: peft=lora: peft ") and "torchao 0.9.0" in line
    assert not (run / "checkpoints").exists()


@pytest.mark.slow  # a training run
@pytest.mark.skipif(PEFT_RAISES, reason="this peft refuses an old torchao (above)")
def test_lora_trains_beside_an_old_torchao_with_a_peft_that_only_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peft >= 0.22 beside the training image's torchao 0.9.0: not refused, LoRA trains."""
    monkeypatch.syspath_prepend(str(_torchao(tmp_path / "site", "0.9.0")))
    run = tmp_path / "run"
    done = run_train(
        "recipe=llama_dpo",
        "debug=smoke",
        "trainer.max_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        f"output_dir={run}",
    )
    assert "error:" not in done.stderr and (run / "metrics.jsonl").is_file()

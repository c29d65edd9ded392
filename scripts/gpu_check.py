"""The checks that need a GPU (MUSA or CUDA), in one short run; prints a Markdown table.

    python scripts/gpu_check.py                  # everything, about 5-8 minutes on one device
    python scripts/gpu_check.py --dry-run        # the planned runs, without running them
    python scripts/gpu_check.py --out gpu.md     # also write the table to a file

Rows: every recipe's smoke run in bf16 (fp16 where the device has no bf16) on one device; SDPA
against eager attention (the doctor's one-step probe, and the training loss of the same run);
the fused AdamW the project picks against the foreach one (same parameters after 20 steps);
torch.compile; FSDP on the device (one process); and the cost of the per-step host sync of the
non-finite check. Each training row reports the last logged loss, tokens/s and MFU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = (
    "bert_glue",
    "bert_mlm",
    "bert_squad",
    "bert_squad_v2",
    "gpt2_clm",
    "llama_clm",
    "llama_sft",
)
# Short, comparable runs: 30 logged steps, no evaluation at the start, nothing saved.
SHORT = (
    "debug=smoke",
    "trainer.max_steps=30",
    "trainer.log_every_n_steps=10",
    "trainer.eval_at_start=false",
    "trainer.save_final_model=false",
    "trainer.save_every_n_steps=0",
    "trainer.progress_bar=false",
    "logger=none",
)


def _runs(precision: str, fsdp_config: str) -> list[tuple[str, list[str]]]:
    """(row name, command) for every training run of the check."""
    train = [sys.executable, str(ROOT / "train.py")]
    mp = f"trainer.mixed_precision={precision}"
    runs = [(f"{r} ({precision})", [*train, f"recipe={r}", *SHORT, mp]) for r in RECIPES]
    for attn in ("sdpa", "eager"):  # fp32: the comparison is about the kernels, not rounding
        runs.append(
            (
                f"bert_squad attn={attn} (fp32)",
                [
                    *train,
                    "recipe=bert_squad",
                    *SHORT,
                    "trainer.mixed_precision=no",
                    f"model.attn_implementation={attn}",
                ],
            )
        )
    runs.append(
        (
            f"bert_squad compile ({precision})",
            [*train, "recipe=bert_squad", *SHORT, mp, "trainer.compile=true"],
        )
    )
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        fsdp_config,
        "--num_processes",
        "1",
        str(ROOT / "train.py"),
    ]
    runs.append(
        (
            f"llama_clm FSDP {Path(fsdp_config).stem} ({precision})",
            [*launch, "recipe=llama_clm", *SHORT, mp],
        )
    )
    return runs


def _train(name: str, command: list[str], out: Path) -> dict:
    started = time.perf_counter()
    done = subprocess.run(
        [*command, f"output_dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    row = {"check": name, "seconds": time.perf_counter() - started, "ok": done.returncode == 0}
    if not row["ok"]:
        row["note"] = (done.stderr.strip().splitlines() or ["failed"])[-1][:160]
        return row
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    last = train[-1] if train else {}
    row.update(
        loss=last.get("train/loss"),
        tokens_per_s=last.get("train/tokens_per_second"),
        tflops=last.get("train/tflops"),
        mfu=last.get("train/mfu"),
        finite=all(r["train/loss"] is not None for r in train),
    )
    return row


def _optimizer_row(where: str) -> dict:
    """The optimizer the project builds for this device against foreach AdamW, on the device."""
    import torch

    from recipes.optim import build_optimizer

    target = torch.device(where)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    twin = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    twin.load_state_dict(model.state_dict())
    make = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    picked = build_optimizer(functools.partial(make, fused=None), model, target)
    plain = build_optimizer(functools.partial(make, fused=False), twin, target)
    model.to(target), twin.to(target)
    started = time.perf_counter()
    for i in range(20):
        for net, opt in ((model, picked), (twin, plain)):
            net.zero_grad()
            net(torch.full((8, 256), 0.01 * (i + 1), device=target)).pow(2).sum().backward()
            opt.step()
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )
    kind = type(picked).__module__ + "." + type(picked).__name__
    fused = picked.defaults.get("fused")
    return {
        "check": "fused AdamW vs foreach (20 steps)",
        "ok": diff < 1e-4,
        "seconds": time.perf_counter() - started,
        "note": f"{kind} fused={fused}; max parameter difference {diff:.1e}",
    }


def _sync_row(where: str) -> dict:
    """What one ``.tolist()`` per step (the loop's non-finite/stop agreement) costs."""
    import torch

    from recipes import device

    target = torch.device(where)
    layer = torch.nn.Linear(1024, 1024).to(target)
    x = torch.randn(64, 1024, device=target)

    def steps(sync: bool) -> float:
        device.synchronize(target)
        started = time.perf_counter()
        for _ in range(200):
            loss = layer(x).square().mean()
            loss.backward()
            if sync:
                torch.stack([~torch.isfinite(loss), loss.new_zeros(())]).float().tolist()
        device.synchronize(target)
        return (time.perf_counter() - started) / 200

    steps(False)  # warm-up
    plain, synced = steps(False), steps(True)
    return {
        "check": "host sync per step (non-finite / stop check)",
        "ok": True,
        "seconds": 400 * plain,
        "note": f"{(synced - plain) * 1e6:+.0f} us per step on a {plain * 1e3:.2f} ms step",
    }


def _probe_row(backend: str) -> dict:
    from recipes import env

    probe = env.sdpa_probe(env._probe_device(backend), env._probe_dtypes(backend))
    return {
        "check": "SDPA vs eager, one step (doctor)",
        "ok": probe["ok"],
        "note": env._probe_text(probe),
    }


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| check | ok | loss | tokens/s | TFLOP/s | MFU | s | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['check']} | {'yes' if r['ok'] else 'NO'} | {_fmt(r.get('loss'), '.4f')} | "
            f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('tflops'), '.2f')} | "
            f"{_fmt(r.get('mfu'), '.1%')} | {_fmt(r.get('seconds'), '.0f')} | "
            f"{r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the planned runs only")
    parser.add_argument("--out", type=Path, help="also write the Markdown table here")
    args = parser.parse_args()

    import torch

    from recipes import device, env

    backend = device.backend()
    precision = "bf16" if device.supports_bf16() else "fp16"
    versions = {"torch": torch.__version__, "accelerate": env._dist_version("accelerate")}
    fsdp = "fsdp2" if "(FSDP2)" in env._fsdp_config({"versions": versions}) else "fsdp"
    runs = _runs(precision, str(ROOT / "conf" / "accelerate" / f"{fsdp}.yaml"))
    if args.dry_run:
        for name, command in runs:
            sys.stdout.write(f"{name}: {' '.join(command)}\n")
        return 0
    if backend == device.CPU:
        sys.stderr.write("gpu_check needs a MUSA or CUDA device; this machine has none.\n")
        return 2

    where = f"{backend}:0"
    names = ", ".join(device.device_names())
    header = (
        f"GPU check, {datetime.now(timezone.utc):%Y-%m-%d}: {names} ({backend}), torch "
        f"{torch.__version__}, accelerate {env._dist_version('accelerate')}, transformers "
        f"{env._dist_version('transformers')}"
    )
    rows = [_probe_row(backend), _optimizer_row(where), _sync_row(where)]
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        for index, (name, command) in enumerate(runs):
            rows.append(_train(name, command, Path(folder) / f"run-{index}"))
            sys.stderr.write(f"{name}: {'ok' if rows[-1]['ok'] else 'FAILED'}\n")
    losses = {r["check"]: r.get("loss") for r in rows}
    sdpa, eager = (
        losses.get("bert_squad attn=sdpa (fp32)"),
        losses.get("bert_squad attn=eager (fp32)"),
    )
    if sdpa is not None and eager is not None:  # dropout differs between kernels: a loose check
        close = abs(sdpa - eager) <= 0.05 * abs(eager)
        rows.append(
            {
                "check": "SDPA vs eager, training loss",
                "ok": close,
                "note": f"{sdpa:.4f} vs {eager:.4f}",
            }
        )
    text = table(rows, header)
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

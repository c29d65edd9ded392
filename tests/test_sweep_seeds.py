"""The sweep summary's seed table: each setting's mean, spread and range over its seeds."""

from __future__ import annotations

import json

from recipes.sweep import over_seeds, write_summary


def _job(folder, overrides, f1=None, error=None):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("{}\n")
    if error:
        (folder / "failed.json").write_text(json.dumps({"overrides": overrides, "error": error}))
        return
    results = {
        "overrides": overrides,
        "main_metric": "f1",
        "main_value": f1,
        "metrics": {"eval/f1": f1, "eval/runtime_s": 1.0},
        "steps": 10,
        "train_seconds": 2.0,
    }
    (folder / "results.json").write_text(json.dumps(results))
    records = [{"step": 0, "eval/f1": 0.0}, {"step": 10, "train/loss": 1.0, "eval/f1": f1}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_seed_table_groups_the_other_overrides_and_skips_failed_jobs(tmp_path):
    runs = [("8", "1", 40.0), ("8", "2", 44.0), ("8", "3", 42.0), ("50", "1", 30.0)]
    for n, (size, seed, f1) in enumerate(runs):
        _job(tmp_path / str(n), [f"trainer.length_group_size={size}", f"trainer.seed={seed}"], f1)
    _job(tmp_path / "4", ["trainer.length_group_size=50", "trainer.seed=2"], error="boom")
    written = write_summary(tmp_path)
    assert tmp_path / "seeds.md" in written
    text = (tmp_path / "seeds.md").read_text()
    assert "| 8 | 3 of 3 | 42 ± 2 (40-44) |" in text  # mean 42, sample sd 2
    assert "| 50 | 1 of 2 | 30 ± 0 (30-30) |" in text


def test_no_seed_table_without_a_seed_sweep(tmp_path):
    for n, lr in enumerate(("1e-4", "3e-4")):
        _job(tmp_path / str(n), [f"optimizer.lr={lr}"], 10.0 + n)
    assert tmp_path / "seeds.md" not in write_summary(tmp_path)
    columns, rows = over_seeds([], ["optimizer.lr"])
    assert rows == [] and columns[-1] == "seeds"

"""HSDP across nodes (``conf/accelerate/hsdp_musa.yaml``): FSDP2 sharded inside a node and
replicated across nodes, as accelerate's launcher and ``ParallelismConfig`` set it up.

The launcher's environment is computed by accelerate's own code from the shipped config, for
the real shape (N nodes of 8 cards) and for 2 "nodes" of 2 processes; the 2 x 2 one then runs in
four CPU processes (gloo, ``tests/hsdp_worker.py``): the mesh accelerate builds from it shards
within a node and replicates across, and three steps of training give the losses of one process
on the whole batch. What only a card can show: the same through ``accelerate launch`` (which
runs FSDP on accelerators only) with MCCL and its speed across real nodes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, free_port

CONFIG = ROOT / "conf" / "accelerate" / "hsdp_musa.yaml"
WORKER = ROOT / "tests" / "hsdp_worker.py"

accelerate_nd = pytest.mark.skipif(
    importlib.util.find_spec("accelerate.parallelism_config") is None
    or tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 6),
    reason="HSDP through accelerate needs its ParallelismConfig and torch >= 2.6 (FSDP2)",
)


def launcher_env(*options: str) -> dict[str, str]:
    """The variables ``accelerate launch --config_file hsdp_musa.yaml <options>`` gives each
    process (accelerate's own argument handling and environment builder)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(CONFIG), *options, "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.use_parallelism_config
    return prepare_multi_gpu_env(args)


@accelerate_nd
def test_config_shards_within_a_node_and_replicates_across() -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIG))
    sizes = config.parallelism_config
    per_node = config.num_processes // config.num_machines
    assert config.distributed_type.value == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    assert sizes["parallelism_config_dp_shard_size"] == per_node == 8
    assert sizes["parallelism_config_dp_replicate_size"] == config.num_machines
    # Four nodes, as scripts/slurm/train_multinode.sbatch asks for them.
    env = launcher_env(
        "--num_machines", "4", "--num_processes", "32", "--parallelism_config_dp_replicate_size", "4"
    )  # fmt: skip
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    replicate, shard = (env[f"PARALLELISM_CONFIG_DP_{d}_SIZE"] for d in ("REPLICATE", "SHARD"))
    assert (replicate, shard) == ("4", "8")
    sbatch = (ROOT / "scripts/slurm/train_multinode.sbatch").read_text(encoding="utf-8")
    assert "--parallelism_config_dp_replicate_size" in sbatch and "hsdp_musa.yaml" in sbatch


def _run(*command: str, env: dict[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@accelerate_nd
@pytest.mark.slow
def test_hsdp_on_2x2_cpu_processes_trains_like_one_process(tmp_path) -> None:
    base = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launched = launcher_env(
        "--num_machines", "2", "--num_processes", "4",
        "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", "2",
    )  # fmt: skip
    _run(sys.executable, str(WORKER), str(tmp_path / "one.json"), env=base)
    _run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        f"--master_port={free_port()}",
        str(WORKER),
        str(tmp_path / "hsdp.json"),
        env={
            **base,
            **{k: v for k, v in launched.items() if k.startswith(("PARALLELISM_", "FSDP_"))},
        },
    )
    one = json.loads((tmp_path / "one.json").read_text())
    hsdp = json.loads((tmp_path / "hsdp.json").read_text())
    # Ranks 0-1 are node 0 and 2-3 node 1: each node shards the model, the nodes replicate it.
    assert hsdp["shard_groups"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert hsdp["replicate_groups"] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert hsdp["placements"] == ["Replicate", "Shard"]
    assert len(hsdp["losses"]) == 3 and hsdp["losses"][-1] < hsdp["losses"][0]
    assert hsdp["losses"] == pytest.approx(one["losses"], abs=1e-5)


@accelerate_nd
def test_a_mesh_bigger_than_the_launch_is_refused_in_one_line() -> None:
    """hsdp_musa.yaml launched as one process (torchrun's WORLD_SIZE=1): its 2 x 8 mesh is
    refused naming both fixes, before accelerate's traceback from torch's init_device_mesh."""
    from recipes import mesh
    from recipes.config import ConfigError

    one = {**launcher_env("--num_machines", "1", "--num_processes", "1"), "WORLD_SIZE": "1"}
    with pytest.raises(ConfigError) as err:
        mesh.check(one)
    message = str(err.value)
    assert "mesh is 2 x 8 (dp_replicate x dp_shard) = 16 processes" in message
    assert "this launch has 1 (WORLD_SIZE)" in message
    assert "--num_processes 16" in message and "--parallelism_config_dp_shard_size" in message
    # The launch that fits, and one without a parallelism_config, pass.
    mesh.check({**launcher_env(), "WORLD_SIZE": "16"})
    mesh.check({"WORLD_SIZE": "3"})


@accelerate_nd
def test_a_1x1_mesh_says_hsdp_is_off() -> None:
    """Said with the run's device lines (modes.with_device_defaults), so train.log has it."""
    from recipes import mesh

    sizes = ("--parallelism_config_dp_replicate_size", "1", "--parallelism_config_dp_shard_size")
    one = {**launcher_env("--num_machines", "1", "--num_processes", "1", *sizes, "1")}
    mesh.check({**one, "WORLD_SIZE": "1"})  # accepted
    note = mesh.single_process_note({**one, "WORLD_SIZE": "1"})
    assert note is not None and "mesh is 1 x 1 (dp_replicate x dp_shard): HSDP is off" in note
    assert mesh.single_process_note({"WORLD_SIZE": "1"}) is None  # no parallelism_config
    two = launcher_env("--num_machines", "1", "--num_processes", "2", *sizes, "2")
    assert mesh.single_process_note({**two, "WORLD_SIZE": "2"}) is None

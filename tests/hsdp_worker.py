"""``python tests/hsdp_worker.py OUT`` (alone, or under ``torchrun`` with the environment
``accelerate launch --config_file conf/accelerate/hsdp_musa.yaml`` gives its processes): the
bundled tiny Llama, fully fine-tuned for three AdamW steps on one fixed global batch; the loss of
each step (the mean over all processes) is written to ``OUT``.

Under ``torchrun`` the device mesh is accelerate's own: ``ParallelismConfig()`` reads the
launcher's ``PARALLELISM_CONFIG_*`` sizes and builds the (dp_replicate, dp_shard) mesh, and every
decoder layer and the root are sharded with torch's ``fully_shard`` over its FSDP dimensions, as
accelerate's FSDP2 with TRANSFORMER_BASED_WRAP does (``fsdp2_prepare_model``). accelerate runs
FSDP only on accelerators, so on a CPU (gloo) the wrapping is done here. Each process trains on
its share of the batch; ``OUT`` also gets the ranks of each shard and replicate group and the
placements of one parameter."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS, ROWS, LENGTH = 3, 8, 24


def main(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = "WORLD_SIZE" in os.environ
    rank, world, found = 0, 1, {}
    if sharded:
        import torch.distributed as dist
        from accelerate.parallelism_config import ParallelismConfig
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        config = ParallelismConfig()  # sizes from the launcher's PARALLELISM_CONFIG_* variables
        assert config.total_size == world, (config, world)
        mesh = config.build_device_mesh("cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "recipes/assets/tiny-llama")
    model.config.use_cache = False
    if sharded:
        fsdp_mesh = mesh[tuple(config.fsdp_dim_names)]
        reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true") == "true"
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard)
        groups = {
            "shard": mesh["dp_shard"].mesh.tolist(),
            "replicate": mesh["dp_replicate"].mesh.tolist(),
        }
        everyone: list = [None] * world
        dist.all_gather_object(everyone, groups)
        weight = model.model.layers[0].mlp.up_proj.weight
        found = {
            "shard_groups": [g["shard"] for g in everyone],
            "replicate_groups": [g["replicate"] for g in everyone],
            "placements": [type(p).__name__ for p in weight.placements],
        }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(3, 2000, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    mine = batch[rank::world]  # equal rows per process: the mean of means is the batch mean
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if sharded:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    if rank == 0:
        out.write_text(json.dumps({"losses": losses, **found}), encoding="utf-8")
    if sharded:
        dist.barrier()
        dist.destroy_process_group()
        # Without the interpreter's teardown: gloo's threads, torn down by C++ static
        # destructors at exit, now and then abort a rank after all the work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

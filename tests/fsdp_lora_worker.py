"""``python tests/fsdp_lora_worker.py OUT`` (alone, or under ``torchrun``): LoRA on the bundled
tiny Llama, two AdamW steps on one fixed global batch, then the project's save path for the
merged ``final/`` and its adapter, written to ``OUT/final``.

Under ``torchrun`` every decoder layer and the root are sharded with torch's ``fully_shard``
(what accelerate's FSDP2 with TRANSFORMER_BASED_WRAP does), each process trains on its half of
the batch, and the state is gathered as ``accelerator.get_state_dict`` gathers it
(``get_model_state_dict``, full and offloaded to the CPU). accelerate runs FSDP only on
accelerators, so on a CPU the wrapping is done here; the rest is the project's own code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from recipes import adapters  # noqa: E402
from recipes.config import peft_settings  # noqa: E402

NEW_TOKENS = [1990, 1991]  # rows trained in full, as for a chat template's added tokens


def main(out: Path) -> None:
    sharded = "WORLD_SIZE" in os.environ
    rank, world = 0, 1
    if sharded:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "recipes/assets/tiny-llama")
    base = AutoModelForCausalLM.from_pretrained(ROOT / "recipes/assets/tiny-llama")
    lora = peft_settings({"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0})
    base.generation_config.eos_token_id = [NEW_TOKENS[1], base.config.eos_token_id]  # a stop
    model = adapters.apply_lora(base, lora, [], NEW_TOKENS)
    for p in model.parameters():  # B = 0 at init: move the adapters so the merge adds something
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.randint(3, 2000, (4, 24), generator=torch.Generator().manual_seed(1))
    batch[:, 5] = NEW_TOKENS[0]
    mine = batch[rank::world]  # equal rows per process: the mean of means is the batch mean
    for _ in range(2):
        model(input_ids=mine, labels=mine).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        if rank == 0:
            adapters.save_final(
                adapters.gathered_copy(model, state), out / "final", tokenizer, None
            )
        dist.barrier()
        dist.destroy_process_group()
        # Leave without the interpreter's teardown: gloo's threads, torn down by C++
        # static destructors at exit, now and then abort a rank with "terminate called
        # without an active exception" after all the work is done and saved.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        adapters.save_final(model, out / "final", tokenizer, None)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""The device mesh a launch asks for (accelerate's ``ParallelismConfig``, set by ``accelerate
launch`` from the config's ``parallelism_config``: ``conf/accelerate/hsdp_musa.yaml``'s 2 x 8),
checked against the processes launched before accelerate builds it: a mesh that does not fit is
refused in one line naming both fixes (torch's own ``Mesh should not be bigger than default
world size`` is a traceback), and a 1 x 1 mesh in one process is said to be a plain run."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from recipes.errors import ConfigError
from recipes.log import get_logger

log = get_logger(__name__)

# accelerate's mesh dimensions as its launcher passes them (accelerate/parallelism_config.py:
# ParallelismConfig.__post_init__ reads PARALLELISM_CONFIG_<NAME>_SIZE), outermost first.
DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def sizes(environ: Mapping[str, str]) -> dict[str, int] | None:
    """The mesh's size per dimension, as accelerate will build it; None without a
    ``parallelism_config`` in the launch."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    return {d: int(environ.get(f"PARALLELISM_CONFIG_{d.upper()}_SIZE", "1")) for d in DIMENSIONS}


def single_process_note(environ: Mapping[str, str] = os.environ) -> str | None:
    """The line that says an HSDP mesh of 1 x 1 in one process makes a plain run (logged with
    the run's device lines, so train.log has it), or None."""
    mesh = sizes(environ)
    if mesh is None or math.prod(mesh.values()) != 1 or int(environ.get("WORLD_SIZE", "1")) != 1:
        return None
    return (
        f"the accelerate config's parallelism_config mesh is {_shown(mesh)}: HSDP is off, this "
        "is a plain single-process run"
    )


def _shown(mesh: Mapping[str, int]) -> str:
    """``2 x 8 (dp_replicate x dp_shard)``: HSDP's two dimensions always, the others if used."""
    used = [d for d in DIMENSIONS if d in DIMENSIONS[:2] or mesh[d] > 1]
    return f"{' x '.join(str(mesh[d]) for d in used)} ({' x '.join(used)})"


def check(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a mesh whose size is not the number of processes launched (``WORLD_SIZE``, 1 for a
    plain ``python train.py``); say so when an HSDP mesh of 1 x 1 makes a single-process run."""
    mesh = sizes(environ)
    if mesh is None:
        return
    world = int(environ.get("WORLD_SIZE", "1"))
    total = math.prod(mesh.values())
    shown = _shown(mesh)
    if total == 1 and world == 1:
        return
    if total > 1 and total != world:
        # deepspeed's sequence parallelism (sp) keeps its own groups; accelerate skips the check
        if (
            mesh["sp"] > 1
            and environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") == "deepspeed"
        ):
            return
        raise ConfigError(
            f"parallelism_config: the accelerate config's mesh is {shown} = {total} processes, "
            f"but this launch has {world} (WORLD_SIZE); launch {total} (accelerate launch --num_processes {total}, with --num_machines for the "
            "nodes), or set the mesh to the processes you have "
            "(--parallelism_config_dp_replicate_size / --parallelism_config_dp_shard_size, "
            f"whose product must be {world})."
        )

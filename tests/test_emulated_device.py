"""The emulated MUSA device itself (``tests/musa_emulator``): what it must do as hardware does,
checked in fresh processes under ``scripts/emulated_musa.py`` (the device is installed once per
process and cannot be undone).

- It refuses what a card refuses: a musa tensor mixed with a CPU tensor (a CPU scalar where
  TensorIterator takes one and CPU indices are accepted, as on CUDA; a 0-dim CPU tensor in an
  operator whose wrapper checks devices is not) or with another card's tensor; a CPU generator
  in a random operator, and the card's generator in a CPU one; a CPU tensor in an MCCL
  collective; card use in a forked child.
- A non-blocking copy to page-locked host memory lands at the next synchronisation (poison
  before it), so a read that would race on a card fails.
- Views, in-place and ``out=`` results are the musa tensors themselves, on the same memory.
- Memory is counted per card; RNG is per card and never draws from the CPU's generator.
- Autocast casts on musa with the dtypes the release and card have; the grad scaler steps.
- ``torch.musa`` has what the torch_musa tag has, and lacks what it lacks.
- ``mccl`` all-reduces, gathers and scatters musa tensors, and DDP's gradients equal one
  process's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT, free_port, on_musa
from musa_emulator import checked_ops, visible_cards

_SEMANTICS = r"""
import io, json
import torch
import torch_musa  # releases before v2.5.0 are not loaded by torch itself

out = {}

def refused(fn):
    try:
        fn()
    except (RuntimeError, NotImplementedError) as err:
        return str(err)
    return None

x = torch.arange(12.0).view(3, 4).to("musa")
out["device"] = str(x.device)
out["cpu_tensor"] = refused(lambda: x + torch.ones(3, 4))
out["cpu_weight"] = refused(lambda: torch.nn.functional.linear(x, torch.ones(2, 4)))
out["cpu_target"] = refused(
    lambda: torch.nn.functional.cross_entropy(x, torch.tensor([0, 1, 2]))
)
out["cpu_ids"] = refused(lambda: torch.nn.functional.embedding(torch.tensor([0]), x))
out["other_card"] = refused(lambda: x + torch.ones(3, 4, device="musa:1"))
out["cpu_scalar"] = (x * torch.tensor(2.0)).sum().item()
out["cpu_indices"] = x[torch.tensor([0, 2])].sum().item()
view = x.view(12)
view[0] = 100.0
out["view_shares_memory"] = [x[0, 0].item(), str(view.device)]
torch.add(torch.ones(4, device="musa"), 1, out=x[1])  # out= into a view of x
out["out_into_view"] = x[1].tolist()
result = torch.empty(0, device="musa")
torch.add(torch.ones(5, device="musa"), 1, out=result)
out["out_resized"] = [list(result.shape), result.sum().item(), str(result.device)]

# Memory: counted per card, exactly, with the peak.
torch.musa.reset_peak_memory_stats(1)
before = torch.musa.memory_allocated(1)
block = torch.empty(1024, dtype=torch.float32, device="musa:1")
grown = torch.musa.memory_allocated(1) - before
del block
out["memory"] = [grown, torch.musa.memory_allocated(1) - before,
                 torch.musa.max_memory_allocated(1) - before]

# RNG: per card, reproducible, and the CPU generator untouched by device draws.
cpu_state = torch.get_rng_state()
torch.musa.manual_seed_all(7)
a = torch.rand(4, device="musa:0")
b = torch.rand(4, device="musa:1")
state = torch.musa.get_rng_state(0)
c = torch.nn.functional.dropout(torch.ones(64, device="musa:0"), 0.5)
torch.musa.set_rng_state(state, 0)
d = torch.nn.functional.dropout(torch.ones(64, device="musa:0"), 0.5)
rates = torch.full((64,), 3.0, device="musa")
out["rng"] = {
    "draws_advance": not torch.equal(torch.poisson(rates).cpu(), torch.poisson(rates).cpu()),
    "cards_alike_from_one_seed": torch.equal(a.cpu(), b.cpu()),
    "restored_state_repeats": torch.equal(c.cpu(), d.cpu()),
    "cpu_untouched": torch.equal(cpu_state, torch.get_rng_state()),
    "all": len(torch.musa.get_rng_state_all()),
}

# Autocast and the grad scaler.
torch.manual_seed(0)
weight = torch.randn(4, 4, device="musa", requires_grad=True)
with torch.autocast("musa", dtype=torch.bfloat16):
    product = x @ weight
out["autocast_bf16"] = str(product.dtype)
scaler = torch.musa.amp.GradScaler()
optimizer = torch.optim.SGD([weight], lr=0.1)
with torch.autocast("musa", dtype=torch.float16):
    loss = (x @ weight).float().pow(2).mean()
scaler.scale(loss).backward()
before = weight.detach().clone()
scaler.step(optimizer)
scaler.update()
out["scaler"] = [
    str(weight.grad.device),
    scaler.get_scale(),
    str(scaler._scale.device),
    torch.equal(before.cpu(), weight.detach().cpu()),
]

# Checkpoints: saved from one card, loaded onto another, or onto the CPU.
buffer = io.BytesIO()
torch.save({"x": x}, buffer)
buffer.seek(0)
out["load_musa1"] = str(torch.load(buffer, map_location="musa:1")["x"].device)
buffer.seek(0)
out["load_cpu"] = str(torch.load(buffer, map_location="cpu")["x"].device)
out["pinned"] = torch.ones(3).pin_memory().is_pinned()
out["names"] = sorted(n for n in dir(torch.musa) if not n.startswith("_"))
out["amp_dtypes"] = [str(t) for t in torch.musa.get_amp_supported_dtype()]
out["device_name"] = torch.musa.get_device_name(0)
out["capability"] = list(torch.musa.get_device_capability(0))
param = torch.nn.Parameter(torch.ones(2, device="musa"))
param.grad = torch.ones(2, device="musa")
out["fused_adamw"] = refused(lambda: torch.optim.AdamW([param], fused=True).step())
model = torch.nn.Linear(3, 3)
model.extra = torch.nn.Linear(3, 3)
model.extra.weight = model.weight  # tied, as a language model's head and embeddings
model.to("musa")
out["tied_after_to"] = model.extra.weight is model.weight

# Random operators on the card refuse a CPU generator and take a card's.
probabilities = torch.full((2, 4), 0.25, device="musa")
draws = {
    "multinomial": lambda g: torch.multinomial(probabilities, 2, generator=g),
    "randn": lambda g: torch.randn(4, device="musa", generator=g),
    "rand": lambda g: torch.rand(4, device="musa", generator=g),
    "randint": lambda g: torch.randint(0, 9, (4,), device="musa", generator=g),
    "randperm": lambda g: torch.randperm(4, device="musa", generator=g),
    "normal_": lambda g: torch.empty(4, device="musa").normal_(generator=g),
    "uniform_": lambda g: torch.empty(4, device="musa").uniform_(generator=g),
    "bernoulli_": lambda g: torch.empty(4, device="musa").bernoulli_(0.5, generator=g),
}
cpu_generator = torch.Generator().manual_seed(0)
card_generator = torch.Generator(device="musa")
out["cpu_generator"] = {name: refused(lambda: draw(cpu_generator)) for name, draw in draws.items()}
out["card_generator"] = {}
for name, draw in draws.items():
    card_generator.manual_seed(5)
    first = draw(card_generator)
    card_generator.manual_seed(5)
    out["card_generator"][name] = [str(first.device), torch.equal(first.cpu(), draw(card_generator).cpu())]
out["card_generator_device"] = str(card_generator.device)
# A CPU operator refuses the card's generator, as torch's CPU kernels do (the generator carries
# the musa dispatch key, so the operator reaches the device, which must not run it).
cpu_probabilities = torch.full((4,), 0.25)
out["card_generator_on_cpu"] = {
    "randperm": refused(lambda: torch.randperm(4, generator=card_generator)),
    "multinomial": refused(
        lambda: torch.multinomial(cpu_probabilities, 2, generator=card_generator)
    ),
    "randn": refused(lambda: torch.randn(4, generator=card_generator)),
}

# A non-blocking copy to the host lands at the next synchronisation: poison before it (NaN for
# floats, 0xA5 bytes for integers), the values after a device, stream or event synchronize, or a
# blocking read. Into pageable memory (copy_ into a plain CPU tensor) it is synchronous.
def queued(values):
    return values.to("cpu", non_blocking=True)

source = torch.tensor([1.5, -2.0, 3.25], device="musa")
integers = torch.tensor([7, 8], device="musa")
early, early_integers = queued(source), queued(integers)
copies = {"before": [early.tolist(), early_integers.tolist(), early.is_pinned()]}
torch.musa.synchronize()
copies["synchronize"] = [early.tolist(), early_integers.tolist()]
stream_copy = queued(source)
torch.musa.current_stream().synchronize()
copies["stream"] = stream_copy.tolist()
event = torch.musa.Event()
event_copy = queued(source)
event.record()
event.synchronize()
copies["event"] = event_copy.tolist()
earlier = torch.musa.Event()
earlier.record()
late_copy = queued(source)
earlier.synchronize()  # recorded before the copy: it need not have landed
copies["event_before_copy"] = late_copy.tolist()
torch.ones(1, device="musa").item()  # a blocking read waits for the card
copies["blocking_read"] = late_copy.tolist()
snapshot = queued(source)
source.add_(1)  # queued after the copy: the copy reads the value before it
torch.musa.synchronize()
copies["stream_order"] = snapshot.tolist()
pageable = torch.empty(3)
pageable.copy_(source, non_blocking=True)
copies["pageable"] = pageable.tolist()
out["non_blocking_copies"] = copies

# A 0-dim CPU tensor: refused by an operator whose wrapper checks devices, a number to
# TensorIterator's (device_check: NoCheck).
log_probabilities = torch.log_softmax(x[0], 0)
out["cpu_0dim_target"] = refused(
    lambda: torch.nn.functional.nll_loss(log_probabilities, torch.tensor(1))
)
out["cpu_0dim_where"] = torch.where(x > 5, x, torch.tensor(-1.0)).sum().item()

# A process forked after the card was used cannot use it; one that does not touch it runs.
from torch.utils.data import DataLoader, Dataset

class Rows(Dataset):
    def __init__(self, device):
        self.device = device
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return torch.full((2,), float(i), device=self.device)

out["fork_card_worker"] = refused(
    lambda: list(DataLoader(Rows("musa"), num_workers=1, multiprocessing_context="fork"))
)
out["fork_host_worker"] = [
    str(batch.device)
    for batch in DataLoader(Rows("cpu"), num_workers=1, multiprocessing_context="fork")
]
out["parent_bad_fork"] = torch.musa._is_in_bad_fork()
print(json.dumps(out))
"""


def _semantics(release: str = "v2.7.1", card: str = "S4000") -> dict:
    done = subprocess.run(
        [
            sys.executable,
            *on_musa(sys.executable, "-c", _SEMANTICS, cards=2, release=release, card=card),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_visible_cards_follow_musa_visible_devices() -> None:
    assert visible_cards(2, None) == 2
    assert visible_cards(8, "0,1") == 2
    assert visible_cards(2, "0,1,2,3,4,5,6,7") == 2  # the listed cards that exist
    assert visible_cards(4, "1,x,2") == 1  # up to the first that does not parse
    assert visible_cards(4, "") == 0


@pytest.fixture(scope="module")
def s4000() -> dict:
    return _semantics()


@pytest.mark.slow
def test_mixed_devices_are_refused_as_on_hardware(s4000) -> None:
    assert s4000["device"] == "musa:0"
    # TensorIterator's words for add; the generated device wrapper's for mm, nll_loss, index_select.
    assert "same device" in s4000["cpu_tensor"] and "musa:0 and cpu" in s4000["cpu_tensor"]
    for case, argument in (("cpu_weight", "mat2"), ("cpu_target", "target"), ("cpu_ids", "index")):
        wrapper = f"but got {argument} is on cpu, different from other tensors on musa:0"
        assert "same device" in s4000[case] and wrapper in s4000[case], case
    assert "musa:0 and musa:1" in s4000["other_card"]
    assert s4000["cpu_scalar"] == 132.0  # a CPU scalar is a number
    assert s4000["cpu_indices"] == 6 + 38  # CPU indices are moved by indexing, as on CUDA


def test_device_checked_operators_follow_native_functions_yaml() -> None:
    checked = set(checked_ops())
    # nll_loss_forward, mm and index_select check every argument's device in their wrapper;
    # TensorIterator's binary ops, where and indexing are NoCheck and take a 0-dim CPU tensor.
    assert {"aten::nll_loss_forward", "aten::mm", "aten::index_select", "aten::addmm"} <= checked
    unchecked = {"aten::add.Tensor", "aten::mul.Tensor", "aten::where.self", "aten::index.Tensor"}
    assert not unchecked & checked


@pytest.mark.slow
def test_card_refuses_cpu_generators_cpu_scalars_it_checks_and_bad_forks(s4000) -> None:
    # As CUDA's "Expected a 'cuda' device type for generator but found 'cpu'".
    for name, error in s4000["cpu_generator"].items():
        assert error == "Expected a 'musa' device type for generator but found 'cpu'", name
    for name, (device, repeats) in s4000["card_generator"].items():
        assert device == "musa:0" and repeats, name  # a seeded card generator is taken
    assert s4000["card_generator_device"] == "musa:0"
    # As torch's CPU kernels refuse a CUDA generator ("... found 'cuda'"): no CPU draw from the
    # card's generator, and no card tensor from a CPU operator.
    for name, error in s4000["card_generator_on_cpu"].items():
        assert error == "Expected a 'cpu' device type for generator but found 'musa'", name
    target = "but got target is on cpu, different from other tensors on musa:0"
    assert target in s4000["cpu_0dim_target"]
    assert s4000["cpu_0dim_where"] == 100 + 8 + 9 + 10 + 11 - 7  # where takes a CPU scalar
    assert (
        "Cannot re-initialize MUSA in forked subprocess. To use MUSA with multiprocessing, you "
        "must use the 'spawn' start method"
    ) in s4000["fork_card_worker"]
    assert s4000["fork_host_worker"] == ["cpu", "cpu"]
    assert s4000["parent_bad_fork"] is False


@pytest.mark.slow
def test_non_blocking_copies_to_the_host_land_at_the_next_synchronisation(s4000) -> None:
    copies = s4000["non_blocking_copies"]
    marker = int.from_bytes(b"\xa5" * 8, "little", signed=True)  # 0xA5 in every byte
    before, integers, pinned = copies["before"]
    assert all(math.isnan(value) for value in before) and pinned  # a pinned buffer, unfilled
    assert integers == [marker, marker]
    assert copies["synchronize"] == [[1.5, -2.0, 3.25], [7, 8]]
    for point in ("stream", "event", "blocking_read"):
        assert copies[point] == [1.5, -2.0, 3.25], point
    assert all(math.isnan(value) for value in copies["event_before_copy"])
    assert copies["stream_order"] == [1.5, -2.0, 3.25]  # the value when the copy was queued
    assert copies["pageable"] == [2.5, -1.0, 4.25]


@pytest.mark.slow
def test_views_in_place_and_out_results_are_the_device_tensors(s4000) -> None:
    assert s4000["view_shares_memory"] == [100.0, "musa:0"]
    assert s4000["out_into_view"] == [2.0, 2.0, 2.0, 2.0]
    assert s4000["out_resized"] == [[5], 10.0, "musa:0"]
    assert s4000["tied_after_to"] is True


@pytest.mark.slow
def test_memory_rng_autocast_scaler_and_checkpoints(s4000) -> None:
    assert s4000["memory"] == [4096, 0, 4096]
    assert s4000["rng"] == {
        "draws_advance": True,  # a random op with a generator argument draws anew each call
        "cards_alike_from_one_seed": True,
        "restored_state_repeats": True,
        "cpu_untouched": True,
        "all": 2,
    }
    assert s4000["autocast_bf16"] == "torch.bfloat16"
    # x holds 100s: the scaled fp16 gradients overflow, the scaler finds the inf on the card,
    # skips the step (the weight is unchanged) and halves its scale.
    assert s4000["scaler"] == ["musa:0", 32768.0, "musa:0", True]
    assert s4000["load_musa1"] == "musa:1" and s4000["load_cpu"] == "cpu"
    assert s4000["pinned"] is True
    assert s4000["device_name"] == "MTT S4000" and s4000["capability"] == [2, 2]


@pytest.mark.slow
def test_torch_musa_has_what_the_release_has(s4000) -> None:
    v271 = set(s4000["names"])
    assert {"is_bf16_supported", "is_tf32_supported", "StreamContext", "amp"} <= v271
    assert {"MUSAGraph", "graph"} <= v271  # torch_musa/musa_graph, from v2.0.0
    assert not {"is_autocast_enabled", "get_autocast_dtype", "reset_peak_stats"} & v271
    assert s4000["amp_dtypes"] == ["torch.float16", "torch.bfloat16"]  # v2.7 asks the card
    assert s4000["fused_adamw"] is None  # torch's _fused_adamw_ is registered for MUSA

    oldest = _semantics("v1.3.0", "S80")
    names = set(oldest["names"])
    assert {"is_autocast_musa_enabled", "get_autocast_musa_dtype", "reset_peak_stats"} <= names
    assert not {"is_bf16_supported", "is_initialized", "is_autocast_enabled", "MUSAGraph"} & names
    assert oldest["amp_dtypes"] == ["torch.float16", "torch.bfloat16", "torch.float32"]
    assert oldest["device_name"] == "MTT S80" and oldest["capability"] == [2, 1]
    assert "_fused_adamw_" in oldest["fused_adamw"] and "'musa' backend" in oldest["fused_adamw"]


_COLLECTIVES = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torch_musa

rank = int(os.environ["RANK"])
torch.musa.set_device(rank)
dist.init_process_group("mccl")
device = torch.device("musa", rank)
out = {"backend": dist.get_backend()}
t = torch.full((3,), float(rank + 1), device=device)
dist.all_reduce(t)
out["all_reduce"] = [t.tolist(), str(t.device)]
flat = torch.empty(2 * 3, device=device)
dist.all_gather_into_tensor(flat, torch.full((3,), float(rank), device=device))
out["all_gather_flat"] = flat.tolist()
part = torch.empty(2, device=device)
dist.reduce_scatter_tensor(part, torch.arange(4.0, device=device) * (rank + 1))
out["reduce_scatter"] = part.tolist()
b = torch.full((2,), float(rank), device=device)
dist.broadcast(b, src=1)
out["broadcast"] = b.tolist()
objects = [None, None]
dist.all_gather_object(objects, {"rank": rank})
out["objects"] = objects

# A CPU tensor in a collective with a card tensor: MCCL refuses it, as NCCL does ("Tensors must
# be CUDA and dense"); all on the CPU, the group has no backend for it.
def refused(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as err:
        return str(err).splitlines()[0]
    return None

card, host = torch.ones(4, device=device), torch.ones(4)
out["cpu_in_collective"] = {
    "all_gather_into_tensor": refused(
        lambda: dist.all_gather_into_tensor(torch.empty(8, device=device), host)
    ),
    "reduce_scatter_tensor": refused(
        lambda: dist.reduce_scatter_tensor(torch.empty(2), card)
    ),
    "all_to_all_single": refused(lambda: dist.all_to_all_single(torch.empty(4), card)),
    "all_gather": refused(lambda: dist.all_gather([card, host], card)),
    "all_reduce": refused(lambda: dist.all_reduce(host)),
}
from accelerate import Accelerator

accelerator = Accelerator()
out["gather_for_metrics_cpu"] = refused(lambda: accelerator.gather_for_metrics(torch.ones(2)))
out["gather_for_metrics_card"] = accelerator.gather_for_metrics(
    torch.full((2,), float(rank), device=device)
).tolist()
dist.barrier()

# DDP: the gradient of two processes with half a batch each is the gradient of the whole batch.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
whole = torch.randn(8, 4)
reference = [p.detach().clone() for p in model.parameters()]
model.zero_grad()
model(whole).pow(2).mean().backward()
expected = [p.grad.clone() for p in model.parameters()]
ddp = torch.nn.parallel.DistributedDataParallel(model.to(device), device_ids=[rank])
ddp.zero_grad()
ddp(whole[rank * 4:(rank + 1) * 4].to(device)).pow(2).mean().backward()
out["ddp_grad_error"] = max(
    (p.grad.cpu() - e).abs().max().item() for p, e in zip(ddp.module.parameters(), expected)
)
out["ddp_grad_device"] = str(next(ddp.module.parameters()).grad.device)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
os._exit(0)  # as tests/fsdp_lora_worker.py: gloo's threads now and then abort a rank at exit
"""


@pytest.mark.slow
def test_mccl_collectives_and_ddp_on_two_cards(tmp_path) -> None:
    script = tmp_path / "collectives.py"
    script.write_text(_COLLECTIVES)
    done = subprocess.run(
        [
            sys.executable,
            *on_musa(
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                f"--master_port={free_port()}",
                str(script),
                str(tmp_path),
                cards=2,
            ),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["backend"] == "mccl"
        assert out["all_reduce"] == [[3.0, 3.0, 3.0], f"musa:{rank}"]
        assert out["all_gather_flat"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
        assert out["reduce_scatter"] == [[0.0, 3.0], [6.0, 9.0]][rank]
        assert out["broadcast"] == [1.0, 1.0]
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        refusals = out["cpu_in_collective"]
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            assert refusals[name] == "Tensors must be MUSA and dense", name
        assert refusals["all_gather"] == "Tensors must be MUSA and dense"
        assert "No backend type associated with device type cpu" in refusals["all_reduce"]
        assert out["gather_for_metrics_cpu"] == "Tensors must be MUSA and dense"
        assert out["gather_for_metrics_card"] == [0.0, 0.0, 1.0, 1.0]
        assert out["ddp_grad_error"] < 1e-6
        assert out["ddp_grad_device"] == f"musa:{rank}"

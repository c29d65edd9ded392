"""The chunked SFT loss (recipes/tasks/chat/token_loss.py) against the full fp32 upcast it replaces:
the same per-row sums and counts, and the same gradients, in fp32 and bf16."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers
from conftest import ROOT
from packaging.version import Version
from token_loss_reference import reference_losses
from transformers import AutoModelForCausalLM

from recipes.tasks import chat
from recipes.tasks.chat import labelled_positions, token_losses


def random_batch(
    rows: int, length: int, vocab: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at a realistic scale and labels with -100 runs (a prompt, padding), a row with no
    labelled token, and a row whose only labelled token is the last."""
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, length, vocab, generator=generator)).to(dtype)
    labels = torch.randint(vocab, (rows, length), generator=generator)
    for row in range(rows):
        prompt, padding = torch.randint(length // 2 + 1, (2,), generator=generator).tolist()
        labels[row, :prompt] = -100
        labels[row, length - padding :] = -100
    labels[min(1, rows - 1)] = -100
    if rows > 2:
        labels[2, :-1] = -100
        labels[2, -1] = vocab - 1
    return logits, labels


def losses_and_gradient(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Sums, counts and the gradient of a loss that weighs every row differently (so a
    per-position gradient scale that were wrong would show)."""
    logits = logits.detach().requires_grad_()
    sums, counts = fn(logits, labels)
    weights = torch.linspace(0.5, 2.0, len(sums))
    (sums * weights).sum().backward()
    return sums, counts, logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, length, vocab, chunk_elements",
    [
        (4, 33, 50, chat.CHUNK_ELEMENTS),  # one chunk
        (4, 33, 50, 7 * 50),  # chunks of 7 positions, the last one shorter
        (3, 9, 20, 1),  # a chunk per position
        (1, 1, 10, chat.CHUNK_ELEMENTS),  # no position predicts anything
    ],
)
def test_same_losses_and_gradients_as_the_full_upcast(
    rows, length, vocab, chunk_elements, dtype, monkeypatch
):
    monkeypatch.setattr(chat.token_loss, "CHUNK_ELEMENTS", chunk_elements)
    logits, labels = random_batch(rows, length, vocab, dtype)
    sums, counts, grad = losses_and_gradient(token_losses, logits, labels)
    ref_sums, ref_counts, ref_grad = losses_and_gradient(reference_losses, logits, labels)
    assert sums.dtype == counts.dtype == torch.float32
    assert grad.dtype == dtype
    torch.testing.assert_close(sums, ref_sums)  # fp32 tolerance: both sum fp32 values
    torch.testing.assert_close(counts, ref_counts, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad)  # at the tolerance of the logits' dtype


def test_a_batch_without_labels_is_a_zero_loss_with_a_graph():
    logits, _ = random_batch(2, 8, 30, torch.bfloat16)
    sums, counts, grad = losses_and_gradient(token_losses, logits, torch.full((2, 8), -100))
    assert sums.tolist() == [0.0, 0.0] and counts.tolist() == [0.0, 0.0]
    assert grad.shape == logits.shape and not grad.any()


def test_evaluation_under_no_grad_gives_the_same_sums():
    logits, labels = random_batch(2, 8, 30, torch.float32)
    with torch.no_grad():
        sums, _ = token_losses(logits.requires_grad_(), labels)
    assert sums.grad_fn is None
    torch.testing.assert_close(sums, reference_losses(logits, labels)[0])


def test_positions_read_logits_computed_only_where_labelled():
    logits, labels = random_batch(4, 33, 50, torch.float32)
    positions = labelled_positions(labels)
    kept = logits[:, positions]
    assert len(positions) < labels.shape[1] - 1  # the prompt and padding of every row
    sums, counts, grad = losses_and_gradient(
        lambda x, y: token_losses(x, y, positions=positions), kept, labels
    )
    ref_sums, ref_counts, ref_grad = losses_and_gradient(reference_losses, logits, labels)
    torch.testing.assert_close(sums, ref_sums)
    torch.testing.assert_close(counts, ref_counts)
    torch.testing.assert_close(grad, ref_grad[:, positions])


# ------------------------------------------------------------------------------ tiny Llama


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    """The bundled tiny Llama in fp32."""
    return AutoModelForCausalLM.from_pretrained(ROOT / "recipes/assets/tiny-llama").float()


def parameter_gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def mean_loss(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return sums.sum() / counts.sum().clamp(min=1)  # as SupervisedFineTuning.loss


def llama_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(vocab, (3, 48), generator=generator)
    labels = input_ids.clone()
    labels[0, :20] = -100  # prompt
    labels[1, :10] = labels[1, 30:] = -100  # prompt and padding
    labels[2, :35] = -100
    return input_ids, labels


def test_tiny_llama_gets_the_same_gradients(llama):
    input_ids, labels = llama_batch(llama.config.vocab_size)
    expected = parameter_gradients(
        llama, mean_loss(*reference_losses(llama(input_ids).logits, labels))
    )
    got = parameter_gradients(llama, mean_loss(*token_losses(llama(input_ids).logits, labels)))
    torch.testing.assert_close(got, expected)


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("4.49"),
    reason="logits_to_keep takes a tensor of positions from transformers 4.49",
)
def test_tiny_llama_computes_only_the_labelled_logits(llama):
    input_ids, labels = llama_batch(llama.config.vocab_size)
    positions = labelled_positions(labels)
    logits = llama(input_ids, logits_to_keep=positions).logits
    assert logits.shape[1] == len(positions) < input_ids.shape[1] - 1
    got = parameter_gradients(llama, mean_loss(*token_losses(logits, labels, positions=positions)))
    expected = parameter_gradients(
        llama, mean_loss(*reference_losses(llama(input_ids).logits, labels))
    )
    torch.testing.assert_close(got, expected)

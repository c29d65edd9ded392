"""Model FLOPs of training, for throughput in TFLOP/s and model-FLOPs utilisation (MFU).

Counts the matrix multiplications of a forward and backward pass per token, as in Kaplan et al.
(2020) and PaLM's appendix B: ``6 N`` for the ``N`` non-embedding weights plus ``12 L d T`` for
attention over ``T`` positions (``L`` layers of width ``d``). Padding is not counted (the loop
counts real tokens), nor is recomputation: this is the *model* FLOPs utilisation, comparable
across implementations, not the hardware's.
"""

from __future__ import annotations

import torch

from recipes import device
from recipes.log import get_logger

log = get_logger(__name__)


class FlopCounter:
    """FLOPs per trained token of one model, and the peak of the device it trains on."""

    def __init__(self, model: torch.nn.Module, where: torch.device, precision: str) -> None:
        config = getattr(model, "config", None)
        if hasattr(model, "num_parameters"):
            weights = model.num_parameters(exclude_embeddings=True)
        else:
            weights = sum(p.numel() for p in model.parameters())
        layers = getattr(config, "num_hidden_layers", 0) or 0
        width = getattr(config, "hidden_size", 0) or 0
        self.dense = 6.0 * weights
        self.attention = 12.0 * layers * width
        name = device.device_name(where)  # None on CPU
        # None on CPU and for devices not in the table.
        self.peak = None if name is None else device.peak_flops_by_name(name, precision)
        basis = None if name is None else device.peak_flops_basis(name, precision)
        note = None if name is None else device.peak_flops_note(name)
        if self.peak is None and note is not None:
            log.info("MFU in %s on %s is not reported: %s", precision, name, note)
        if self.peak and precision in ("fp16", "bf16") and basis != precision:
            log.info(
                "MFU in %s on %s is against its %s peak, %.4g TFLOP/s (no %s figure is "
                "published for it): an upper bound",
                precision,
                name,
                basis,
                self.peak / 1e12,
                precision,
            )

    def per_token(self, mean_length: float) -> float:
        return self.dense + self.attention * mean_length

    def metrics(self, tokens: float, samples: float, seconds: float, processes: int) -> dict:
        """``train/tflops`` (per device) and, where the device's peak is known, ``train/mfu``."""
        if tokens <= 0 or samples <= 0 or seconds <= 0:
            return {}
        per_device = self.per_token(tokens / samples) * tokens / seconds / processes
        found = {"train/tflops": per_device / 1e12}
        if self.peak:
            found["train/mfu"] = per_device / self.peak
        return found


def precision_for_peak(mixed_precision: str, tf32: bool) -> str:
    """Which column of the peak table a run's matmuls use."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    return "tf32" if tf32 else "fp32"

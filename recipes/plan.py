"""How much memory a run needs, before it runs: ``python -m recipes.plan <train.py overrides>``.

    python -m recipes.plan recipe=llama_sft model=qwen3_8b peft=lora \\
        trainer.gradient_checkpointing=true task.max_seq_length=4096 --card S4000
    python -m recipes.plan recipe=llama_sft model.name_or_path=Qwen/Qwen3-8B --num-processes 8

The config is composed and checked as ``train.py`` does it; the model's shape comes from
:mod:`recipes.model_shapes` (hub ids, offline), a local folder's ``config.json``, or transformers'
``AutoConfig`` of a cached model (offline: no download). Nothing here imports torch.

The plan is a table of parts (weights, gradients, optimizer state, activations, logits and loss,
the frozen reference or teacher, FSDP's gathered layers, ...), one function per part, summed per
phase (a training step, the optimizer step, evaluation, generation); the largest phase is the
run's peak. It is what the device's allocator will hand out (``max_memory_allocated``); the
card must also hold the runtime's context and the allocator's slack (:data:`HEADROOM_BYTES`,
:data:`FRAGMENTATION`). On a CPU the process itself (Python, torch, the tokenizer and data) is
a part too, since a CPU run's measure is its peak resident memory.

When the run does not fit, :func:`cheapest_fix` searches the settings that shrink it, cheapest
first (docs/large-models.md). The figures are estimates: scripts/plan_check.py measures them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

GIB = 1024**3

# -------------------------------------------------------------------------------- the cards

# Memory per card in GiB (the vendors' "GB" on these cards are binary). Sources: MTT S4000 and
# S5000, /work/shared/MUSA.md (the vendor's spec sheets, 48 GB GDDR6 / 80 GB); NVIDIA's data
# sheets for the others (H100 SXM 80 GB, H200 141 GB, A100 40 / 80 GB, L40S 48 GB, RTX 4090 and
# 3090 24 GB).
CARDS: dict[str, float] = {
    "S4000": 48,
    "S5000": 80,
    "H100": 80,
    "H200": 141,
    "A100-80": 80,
    "A100-40": 40,
    "L40S": 48,
    "4090": 24,
    "3090": 24,
}
# Not in max_memory_allocated but on the card: the runtime's context (CUDA / MUSA, 0.5-1 GiB),
# the communicator's buffers, and blocks the caching allocator keeps but cannot reuse.
HEADROOM_BYTES = 2 * GIB
FRAGMENTATION = 0.05  # share of the allocated peak lost to the allocator's block rounding

# What a CPU process holds besides its tensors: the interpreter, torch, transformers, datasets,
# the tokenizer and the data's tables (measured: scripts/plan_check.py, a 2-layer run's peak RSS
# less its tensors' bytes).
CPU_PROCESS_BYTES = int(0.6 * GIB)

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "no": 4, "fp8": 1}
# fp32 logits per chunk of the project's token loss (recipes/tasks/chat/token_loss.py
# CHUNK_ELEMENTS, kept here so that the plan imports no torch), and how many such chunks its
# forward holds at once (the upcast, log-softmax, the picked targets' temporaries: measured
# on the emulated card, scripts/plan_check.py).
LOSS_CHUNK_ELEMENTS = 2**24
LOSS_CHUNKS = 5
# Copies of the (positions x vocabulary) logits held at the loss: the model's and the loss'
# own (then the loss' and their gradient), and half a copy more that the measured peaks show
# (not under FSDP, where autocast makes no copies); under LoRA one more (measured: the same on
# 1 and 2 layers, so the output layer's, not the adapters').
LOGITS_COPIES = 2.5
LORA_LOGITS_COPIES = 1.0
# What a LoRA layer saves per element of its input, in bytes: the dropout's output (fp32) and
# mask, and autocast's copy for lora_A.
LORA_SAVED_BYTES = 7
# Bytes per attention score that the math path keeps for backward: the fp32 softmax output.
SCORE_BYTES = 4


# -------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its memory depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0  # MoE: experts per layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each head's q and k
    qkv_bias: bool = False  # Qwen2, GLM-4: biases on q, k and v
    norms: int = 2  # RMSNorms per layer (Gemma 3 and GLM-4 also norm each block's output)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a ``config.json`` dict (or a :mod:`recipes.model_shapes` entry)."""
        text = config.get("text_config") or config  # image-text models: their text tower
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        return cls(
            hidden=hidden,
            intermediate=int(text.get("intermediate_size") or 4 * hidden),
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab=int(text["vocab_size"]),
            tied=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            experts=int(text.get("num_experts") or text.get("num_local_experts") or 0),
            experts_per_token=int(text.get("num_experts_per_tok") or 0),
            expert_intermediate=int(text.get("moe_intermediate_size") or 0),
            qk_norm=str(text.get("model_type", "")).startswith(("qwen3", "gemma3")),
            qkv_bias=bool(text.get("attention_bias", text.get("model_type") == "qwen2")),
            norms=4 if str(text.get("model_type", "")).startswith(("gemma3", "glm4")) else 2,
        )

    def linears(self) -> dict[str, tuple[int, int, int]]:
        """One layer's linear layers: name -> (inputs, outputs, copies)."""
        h, d = self.hidden, self.head_dim
        attention = {
            "q_proj": (h, self.heads * d, 1),
            "k_proj": (h, self.kv_heads * d, 1),
            "v_proj": (h, self.kv_heads * d, 1),
            "o_proj": (self.heads * d, h, 1),
        }
        if self.experts:
            i, e = self.expert_intermediate, self.experts
            mlp = {"gate": (h, e, 1), "experts.gate_up": (h, 2 * i, e), "experts.down": (i, h, e)}
        else:
            i = self.intermediate
            mlp = {"gate_proj": (h, i, 1), "up_proj": (h, i, 1), "down_proj": (i, h, 1)}
        return {**attention, **mlp}

    @property
    def layer_params(self) -> int:
        norms = self.norms * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return norms + bias + sum(i * o * n for i, o, n in self.linears().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The output layer's own parameters (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return (
            self.embedding_params + self.head_params + self.layers * self.layer_params + self.hidden
        )

    def lora_params(self, rank: int, targets: Any = None) -> int:
        """LoRA's parameters: ``rank x (inputs + outputs)`` per targeted linear layer. null
        targets every linear layer but the output layer; a MoE layer's experts and router are
        not counted (peft's fused-expert targets are the presets' choice)."""
        total = 0
        for name, (inputs, outputs, copies) in self.linears().items():
            if "experts" in name or name == "gate":
                continue
            if targets is None or _targets(targets, name):
                total += rank * (inputs + outputs) * copies
        return self.layers * total


def _targets(targets: Any, name: str) -> bool:
    if isinstance(targets, str):
        return targets == "all-linear" or __import__("re").search(targets, name) is not None
    return name in targets


def model_shape(name_or_path: str) -> ModelShape:
    """The shape of ``model.name_or_path``: a kept hub shape, a folder's config.json, or
    transformers' cached config of a hub model (never a download)."""
    from recipes.model_shapes import shape_of

    try:
        kept = shape_of(name_or_path)
        if kept is not None:
            return ModelShape.from_config(kept)
        config = Path(name_or_path) / "config.json"
        if config.is_file():
            return ModelShape.from_config(json.loads(config.read_text()))
        from transformers import AutoConfig

        found = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        return ModelShape.from_config(found.to_dict())
    except Exception as err:  # no config here, or not a decoder's (T5 names its sizes d_model)
        raise PlanError(
            f"model.name_or_path={name_or_path}: its shape is unknown here (not in "
            "recipes/model_shapes.py, no decoder config.json in that folder, none cached); "
            "give a folder with its config.json."
        ) from err


class PlanError(ValueError):
    """A run the plan cannot size (a model whose shape is not known offline)."""


# -------------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class RunShape:
    """What a run's memory depends on besides the model: read from its settings by
    :func:`run_shape`, changed by the fixes :func:`cheapest_fix` tries."""

    task: str
    rows: int  # sequences in a micro-batch on one process (DPO: chosen and rejected)
    seq: int  # tokens per sequence
    eval_rows: int
    weight_bytes: int  # the weights' dtype
    compute_bytes: int  # activations' dtype (autocast's, or the weights')
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: Any = None
    checkpointing: bool = False
    activation_offload: bool = False
    processes: int = 1  # data-parallel processes in all
    shard: int = 1  # processes one copy of the model is sharded over (FSDP / HSDP); 1: not
    fsdp: bool = False  # FSDP wraps the model (on one process too); always with shard > 1
    fsdp_offload: bool = False
    labelled: float = 1.0  # share of positions whose logits the loss needs
    fused_loss: bool = False  # trainer.fused_linear_loss: logits a chunk at a time
    optimizer_states: int = 2  # AdamW: two moments per trainable parameter
    # The frozen second model: a reference (DPO, KTO, GRPO with beta > 0; the policy itself
    # with LoRA, its adapter disabled) or a teacher (GKD), unless precomputed.
    second: ModelShape | None = None
    second_bytes: int = 0
    # Attention that materialises each head's (length x length) scores: eager, or SDPA where
    # the device has no fused kernel taking the packed rows' mask (then its math path runs).
    math_attention: bool = False
    masked: bool = False  # packed rows under eager / SDPA: a (length x length) mask per row
    generation_rows: int = 0  # prompts generated together (0: no generation)
    prompt_tokens: int = 0
    new_tokens: int = 0
    on_cpu: bool = False

    @property
    def tokens(self) -> int:
        return self.rows * self.seq

    @property
    def sharded(self) -> bool:
        """FSDP / HSDP wraps the model: its units are gathered for their forward and backward
        in the mixed-precision policy's dtype (accelerate's: the compute dtype), so autocast
        makes no weight copies, and the optimizer runs foreach over sharded tensors."""
        return self.fsdp or self.shard > 1


@dataclass
class Part:
    name: str
    bytes: int
    note: str = ""


@dataclass
class Phase:
    name: str
    parts: list[Part]

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)


# ------------------------------------------------------------------ one function per part


def trainable_params(m: ModelShape, r: RunShape) -> int:
    return m.lora_params(r.lora_rank, r.lora_targets) if r.lora_rank else m.params


def _resident(r: RunShape, full: float) -> int:
    """What a process holds of state sharded over ``r.shard`` processes (none on the device
    when FSDP offloads it to the host)."""
    if r.fsdp_offload and not r.on_cpu:
        return 0
    return int(full / r.shard)


def weights(m: ModelShape, r: RunShape) -> Part:
    note = f"{m.params / 1e9:.2f}B parameters x {r.weight_bytes} B"
    if r.shard > 1:
        note += f", sharded over {r.shard}"
    if r.fsdp_offload:
        note += ", on the host (FSDP offload)"
    return Part("weights", _resident(r, m.params * r.weight_bytes), note)


def lora(m: ModelShape, r: RunShape) -> Part:
    n = m.lora_params(r.lora_rank, r.lora_targets) if r.lora_rank else 0
    return Part("LoRA adapters", _resident(r, n * 4), f"{n / 1e6:.1f}M fp32, rank {r.lora_rank}")


def gradients(m: ModelShape, r: RunShape) -> Part:
    # LoRA adapters stay fp32; full fine-tuning's gradients are in the weights' dtype.
    n = trainable_params(m, r)
    size = n * (4 if r.lora_rank else r.weight_bytes)
    return Part("gradients", _resident(r, size), f"{n / 1e9:.3f}B trainable")


def optimizer_state(m: ModelShape, r: RunShape) -> Part:
    n = trainable_params(m, r)
    size = n * (4 if r.lora_rank else r.weight_bytes) * r.optimizer_states
    return Part("optimizer state", _resident(r, size), f"{r.optimizer_states} per parameter")


def optimizer_temporaries(m: ModelShape, r: RunShape) -> Part:
    # AdamW builds the update of every parameter at once: about one fp32 copy; under FSDP,
    # foreach over sharded tensors (the fused kernels take none): two (measured on the emulated
    # card, scripts/plan_check.py's FSDP2 points on one and two cards).
    n = trainable_params(m, r)
    copies = 2 if r.sharded else 1
    return Part("optimizer step's temporaries", _resident(r, copies * n * 4))


def weight_copies(m: ModelShape, r: RunShape) -> Part:
    """Autocast's low-precision copies of fp32 weights, cached for the step (and saved for the
    backward of each matmul); none when the weights are already in the compute dtype."""
    if r.compute_bytes >= r.weight_bytes or r.sharded:  # FSDP: the gathered units are those
        return Part("autocast weight copies", 0)
    n = m.params - m.embedding_params + (m.embedding_params if m.tied else 0)
    return Part("autocast weight copies", n * r.compute_bytes, "fp32 weights cast for matmuls")


def fsdp_gathered(m: ModelShape, r: RunShape) -> Part:
    """FSDP: the whole weights of the layers being computed (this one and the prefetched
    next), and the root's embedding and output layer, which stay gathered through the step;
    in the mixed-precision policy's dtype (accelerate sets the compute dtype)."""
    if not r.sharded:
        return Part("FSDP gathered layers", 0)
    size = (2 * m.layer_params + m.embedding_params + m.head_params) * r.compute_bytes
    return Part("FSDP gathered layers", size, "2 layers + embedding and output layer")


def layer_activations(m: ModelShape, r: RunShape) -> int:
    """Bytes one decoder layer saves for backward over a micro-batch: per token, the inputs of
    its norms (fp32 in HF's RMSNorm), of its matmuls (compute dtype), the attention's q, k, v and
    output, and the MLP's gate, up and product; a MoE layer routes each token through
    ``experts_per_token`` experts."""
    h, c, d = m.hidden, r.compute_bytes, m.head_dim
    qkv = (m.heads + 2 * m.kv_heads) * d
    norms = 2 * (4 + 4 + max(c, r.weight_bytes)) * h  # input, normalised fp32, cast back
    attention = c * (3 * h + 2 * qkv + 2 * m.heads * d) + (10 * qkv if m.qk_norm else 0)
    if m.experts:
        mlp = c * (2 * h + m.experts_per_token * 4 * m.expert_intermediate) + 4 * m.experts
    else:
        mlp = c * (2 * h + 4 * m.intermediate)
    lora = 0
    if r.lora_rank:  # the adapters' inputs: the dropout's output and mask, lora_A's copy
        inputs = sum(i * n for name, (i, _, n) in m.linears().items() if "experts" not in name)
        lora = LORA_SAVED_BYTES * inputs
    return r.tokens * (norms + attention + mlp + lora)


def activations(m: ModelShape, r: RunShape) -> Part:
    """Saved for backward on the device: every layer's activations; with checkpointing only
    each layer's input; with activation offload none (they are on the host)."""
    residual = r.tokens * m.hidden * max(r.compute_bytes, r.weight_bytes)
    if r.activation_offload:
        return Part("activations", 0, "offloaded to the host")
    if r.checkpointing:
        return Part("activations", m.layers * residual, "layer inputs (checkpointing)")
    return Part("activations", m.layers * layer_activations(m, r), f"{m.layers} layers")


def recomputed_layer(m: ModelShape, r: RunShape) -> Part:
    """With checkpointing (or offload), the one layer whose activations backward is reading:
    recomputed (or copied back from the host)."""
    return Part("layer in backward", layer_activations(m, r), "recomputed / copied back")


def attention_scores(
    m: ModelShape, r: RunShape, one_layer: bool = False, masked_only: bool = False
) -> Part:
    """The math path's attention probabilities, kept for backward in fp32 (autocast runs
    softmax in fp32): every layer's, or with checkpointing the recomputed layer's only, then
    beside their gradient (the softmax's backward reads the probabilities and writes the
    scores' gradient); and the packed rows' mask."""
    mask = r.rows * r.seq * r.seq if r.masked else 0
    if not r.math_attention or masked_only:
        return Part("attention mask", mask, "bool, packed rows")
    layers = 1 if one_layer else m.layers
    size = layers * r.rows * m.heads * r.seq * r.seq * SCORE_BYTES
    if one_layer:
        return Part("attention scores", 2 * size + mask, "1 layer's and their gradient")
    return Part("attention scores", size + mask, f"{layers} layers, no fused kernel")


def recast_layer(m: ModelShape, r: RunShape) -> Part:
    """Backward of a recomputed layer: autocast's copies of that layer's weights only (its
    cache of the whole model's is emptied when the forward's autocast ends; measured on the
    emulated card, scripts/plan_check.py); under FSDP the gathered layer is already cast."""
    if r.compute_bytes >= r.weight_bytes or r.sharded:
        return Part("autocast weight copies", 0)
    return Part("autocast weight copies", m.layer_params * r.compute_bytes, "the layer's")


def activations_without_checkpointing(m: ModelShape, r: RunShape) -> int:
    return activations(m, replace(r, checkpointing=False, activation_offload=False)).bytes


def logits_and_loss(m: ModelShape, r: RunShape, eval_rows: int | None = None) -> Part:
    """The output layer's logits at the labelled positions (compute dtype), the loss' copy of
    them and, in backward, their gradient; plus the loss' fp32 chunks. ``eval_rows``: an
    evaluation batch's (no gradient: the logits and the loss' copy)."""
    tokens = (r.rows if eval_rows is None else eval_rows) * r.seq * r.labelled
    one = int(tokens * m.vocab * r.compute_bytes)
    chunk = min(LOSS_CHUNKS * LOSS_CHUNK_ELEMENTS, int(tokens * m.vocab)) * 4
    if r.fused_loss:
        # Hidden states through the output layer a chunk of rows at a time: one chunk's
        # logits (compute dtype, fp32 upcast, log-softmax) and the hidden states' gradient.
        hidden = int(tokens * m.hidden * 4)
        return Part("logits and loss", chunk + hidden, "fused: one chunk of logits at a time")
    copies = LOGITS_COPIES + (LORA_LOGITS_COPIES if r.lora_rank else 0)
    if eval_rows is not None:
        copies = 2
    elif r.sharded:  # measured: the logits and their gradient in backward, no more
        return Part(
            "logits and loss",
            max(int((copies - 0.5) * one), one + chunk),
            f"{int(tokens)} positions x {m.vocab}",
        )
    size = int(copies * one) + chunk
    return Part("logits and loss", size, f"{int(tokens)} positions x {m.vocab}")


def second_model(r: RunShape) -> Part:
    """The frozen reference or teacher: its weights, sharded like the policy's under FSDP /
    HSDP; none with LoRA's reference (the policy, adapter disabled) or when precomputed."""
    if r.second is None:
        return Part("reference / teacher", 0)
    size = r.second.params * r.second_bytes
    return Part(
        "reference / teacher",
        _resident(r, size),
        f"{r.second.params / 1e9:.2f}B frozen"
        + (f", sharded over {r.shard}" if r.shard > 1 else ""),
    )


def second_logits(r: RunShape) -> Part:
    """The frozen model's forward: its logits (no gradient), beside the policy's."""
    if r.second is None or r.task != "gkd":
        return Part("teacher logits", 0)
    tokens = r.tokens * r.labelled
    return Part("teacher logits", int(tokens * r.second.vocab * 4), "fp32, for the divergence")


def kv_cache(m: ModelShape, r: RunShape) -> Part:
    tokens = r.generation_rows * (r.prompt_tokens + r.new_tokens)
    size = tokens * m.layers * 2 * m.kv_heads * m.head_dim * r.compute_bytes
    return Part("KV cache", size, f"{r.generation_rows} prompts x {r.prompt_tokens + r.new_tokens}")


def forward_working(m: ModelShape, r: RunShape, rows: int) -> Part:
    """A forward without gradient: one layer's temporaries at a time."""
    one = layer_activations(m, replace(r, rows=rows))
    return Part("one layer's temporaries", one // 2)


def process(r: RunShape) -> Part:
    return Part("process (CPU only)", CPU_PROCESS_BYTES if r.on_cpu else 0, "Python, torch, data")


# -------------------------------------------------------------------------------- phases


def phases(m: ModelShape, r: RunShape) -> list[Phase]:
    """The run's phases, each a list of parts held at once."""
    state = [
        process(r),
        weights(m, r),
        lora(m, r),
        optimizer_state(m, r),
        second_model(r),
        fsdp_gathered(m, r),
    ]
    # Full fine-tuning: the output layer's gradient is made first in backward, in the compute
    # dtype (autocast's weight copy), then cast to the weights' dtype and accumulated. Under
    # FSDP it is the gathered root's, whole and in the reduce dtype (the compute dtype), until
    # the root's reduce-scatter after the last layer's backward.
    head_grad = 0 if r.lora_rank else m.hidden * m.vocab * r.weight_bytes
    if head_grad and r.compute_bytes < r.weight_bytes:
        head_grad += m.hidden * m.vocab * r.compute_bytes
    head = Part("output layer's gradient", _resident(r, head_grad))
    if head_grad and r.sharded:
        head = Part("output layer's gradient", m.hidden * m.vocab * r.compute_bytes, "whole")
    layers_saved = not (r.checkpointing or r.activation_offload)
    backward = Phase(
        "training step (loss and output layer)",
        [
            *state,
            weight_copies(m, r),
            activations(m, r),
            attention_scores(m, r) if layers_saved else attention_scores(m, r, masked_only=True),
            logits_and_loss(m, r),
            second_logits(r),
            head,
        ],
    )
    step = Phase("optimizer step", [*state, gradients(m, r), optimizer_temporaries(m, r)])
    found = [backward, step]
    if not layers_saved:
        found.append(
            Phase(
                "training step (a layer's backward)",
                [
                    *state,
                    recast_layer(m, r),
                    activations(m, r),
                    recomputed_layer(m, r),
                    attention_scores(m, r, one_layer=True),
                    gradients(m, r),
                ],
            )
        )
    if r.eval_rows:
        found.append(
            Phase(
                "evaluation",
                [
                    *state,
                    weight_copies(m, r),
                    forward_working(m, r, r.eval_rows),
                    logits_and_loss(m, r, eval_rows=r.eval_rows),
                ],
            )
        )
    if r.generation_rows:
        found.append(
            Phase(
                "generation",
                [
                    *state,
                    weight_copies(m, r),
                    kv_cache(m, r),
                    forward_working(m, replace(r, seq=r.prompt_tokens), r.generation_rows),
                    Part("prompt logits", r.generation_rows * m.vocab * 4 * 2),
                ],
            )
        )
    return found


@dataclass
class Plan:
    model: ModelShape
    run: RunShape
    phases: list[Phase]
    card: str | None = None
    card_bytes: int | None = None
    host_bytes: int = 0  # what offload puts in the host's memory

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def needed_bytes(self) -> int:
        """The card memory the run needs: its peak, the allocator's slack and the context."""
        if self.run.on_cpu:
            return self.peak_bytes
        return int(self.peak_bytes * (1 + FRAGMENTATION)) + HEADROOM_BYTES

    @property
    def fits(self) -> bool | None:
        return None if self.card_bytes is None else self.needed_bytes <= self.card_bytes


def plan(
    m: ModelShape, r: RunShape, card: str | None = None, card_bytes: int | None = None
) -> Plan:
    """The plan of a run on a card (``card_bytes``: its memory; None: no verdict)."""
    found = Plan(m, r, phases(m, r), card, card_bytes)
    offloaded = replace(r, fsdp_offload=False, activation_offload=False, on_cpu=False)
    if r.fsdp_offload:
        found.host_bytes += sum(
            f(m, offloaded).bytes for f in (weights, lora, gradients, optimizer_state)
        )
    if r.activation_offload:
        saved = replace(offloaded, checkpointing=r.checkpointing)
        found.host_bytes += sum(f(m, saved).bytes for f in (activations, attention_scores))
    return found


# -------------------------------------------------------------------------------- the fixes

# The settings that shrink a run, each with its cost (the lower, the less it changes the run):
# checkpointing costs about a third more compute; a smaller micro-batch keeps the global batch
# (more accumulation steps) but runs slower; LoRA changes the method; activation offload copies
# activations to the host and back; more cards need hardware; FSDP offload is slow; a shorter
# max_seq_length changes the data.
FIX_COSTS = {
    "checkpointing": 1,
    "bf16_weights": 1,
    "pure_bf16": 4,
    "micro_batch": 1,
    "eval_batch": 1,  # evaluation only: slower, same scores
    "lora": 3,
    "activation_offload": 2,
    "cards": 3,
    "fsdp_offload": 4,
    "seq": 5,
}


@dataclass
class Fix:
    overrides: list[str]
    cost: int
    plan: Plan

    def __str__(self) -> str:
        return " ".join(self.overrides) if self.overrides else "(nothing)"


def _halvings(value: int, low: int) -> list[int]:
    found = [value]
    while found[-1] // 2 >= low:
        found.append(found[-1] // 2)
    return found


def cheapest_fix(m: ModelShape, r: RunShape, card_bytes: int, max_cards: int = 64) -> Fix | None:
    """The cheapest set of settings under which the run fits ``card_bytes`` (None: none of
    them does); ties go to the smaller change."""
    best: Fix | None = None
    options = itertools.product(
        [r.checkpointing, True] if not r.checkpointing else [True],
        _halvings(r.rows, 1),
        [r.lora_rank, 16] if not r.lora_rank else [r.lora_rank],
        [r.activation_offload, True] if not r.activation_offload else [True],
        [r.weight_bytes, 2] if r.weight_bytes > 2 else [r.weight_bytes],
        [r.shard]
        if r.on_cpu
        else [r.shard * 2**k for k in range(8) if r.shard * 2**k <= max_cards],
        _halvings(r.eval_rows, 1)[:5] if r.eval_rows else [0],
        [r.fsdp_offload, True] if not r.fsdp_offload else [True],
        _halvings(r.seq, min(r.seq, 512)),
    )
    for ckpt, rows, rank, act, weight_bytes, shard, eval_rows, fsdp_off, seq in options:
        if (fsdp_off and shard == 1) or (act and r.on_cpu):
            continue
        changed = replace(
            r,
            checkpointing=ckpt,
            rows=rows,
            eval_rows=eval_rows,
            lora_rank=rank,
            activation_offload=act,
            weight_bytes=weight_bytes,
            compute_bytes=min(r.compute_bytes, weight_bytes),
            shard=shard,
            processes=max(r.processes, shard),
            fsdp_offload=fsdp_off,
            seq=seq,
            second=None if rank and r.task != "gkd" else r.second,
        )
        overrides, cost = _describe(r, changed)
        if best is not None and (cost, len(overrides)) >= (best.cost, len(best.overrides)):
            continue
        found = plan(m, changed, card_bytes=card_bytes)
        if found.fits:
            best = Fix(overrides, cost, found)
    return best


def _describe(old: RunShape, new: RunShape) -> tuple[list[str], int]:
    """The overrides that turn ``old`` into ``new``, and their cost."""
    found, cost = [], 0
    if new.checkpointing != old.checkpointing:
        found.append("trainer.gradient_checkpointing=true")
        cost += FIX_COSTS["checkpointing"]
    if new.rows != old.rows:
        steps = old.rows // new.rows
        found.append(f"trainer.per_device_train_batch_size={new.rows} (x{steps} accumulation)")
        cost += FIX_COSTS["micro_batch"] * steps.bit_length()
    if new.eval_rows != old.eval_rows:
        found.append(f"trainer.per_device_eval_batch_size={new.eval_rows}")
        cost += FIX_COSTS["eval_batch"]
    if new.lora_rank != old.lora_rank:
        found.append("peft=lora")
        cost += FIX_COSTS["lora"]
    if new.weight_bytes != old.weight_bytes:
        # Frozen LoRA weights lose nothing in bf16; full fine-tuning in pure bf16 rounds small
        # updates away (recipes/config.py WeightDtype).
        found.append("model.dtype=bfloat16")
        cost += FIX_COSTS["bf16_weights" if new.lora_rank else "pure_bf16"]
    if new.activation_offload != old.activation_offload:
        found.append("trainer.activation_offload=true")
        cost += FIX_COSTS["activation_offload"]
    if new.shard != old.shard:
        found.append(f"{new.shard} cards (FSDP2: conf/accelerate/fsdp2.yaml)")
        cost += FIX_COSTS["cards"] * (new.shard // old.shard).bit_length()
    if new.fsdp_offload != old.fsdp_offload:
        found.append("trainer.fsdp_offload=true")
        cost += FIX_COSTS["fsdp_offload"]
    if new.seq != old.seq:
        found.append(f"task.max_seq_length={new.seq}")
        cost += FIX_COSTS["seq"] * (old.seq // new.seq).bit_length()
    return found, cost


# -------------------------------------------------------------------- from a run's settings

# The tasks the plan sizes: causal LMs (a decoder, its output layer over the vocabulary).
PLANNED_TASKS = ("sft", "dpo", "kto", "grpo", "gkd", "clm")


def card_memory(name: str) -> int:
    """A named card's memory in bytes (:data:`CARDS`)."""
    for key, gib in CARDS.items():
        if key.lower() == name.lower():
            return int(gib * GIB)
    raise PlanError(f"--card {name}: not a known card; choose one of {', '.join(CARDS)}.")


def moore_threads_card(card: str | None) -> bool:
    """Whether ``card`` is one of Moore Threads' (so is no card named: the project's target)."""
    return card is None or card.upper().startswith(("S4000", "S5000", "MTT"))


def card_of_device_name(device_name: str | None) -> str | None:
    """The :data:`CARDS` key of a device's reported name (``MTT S4000``, ``NVIDIA H100 80GB
    HBM3``), or None."""
    if not device_name:
        return None
    upper = device_name.upper()
    if "A100" in upper:
        return "A100-80" if "80" in upper else "A100-40"
    for key in CARDS:
        if key.upper() in upper:
            return key
    return None


def _dtype_bytes(name: str, default: int = 2) -> int:
    return BYTES.get(str(name), default)


def _task_lengths(task: Any) -> tuple[int, int]:
    """(sequences per row of the batch, tokens per sequence) of a task's training rows."""
    name = type(task).NAME if hasattr(type(task), "NAME") else ""
    if name == "grpo":
        return 1, task.max_prompt_length + task.max_completion_length
    seq = getattr(task, "max_seq_length", None) or getattr(task, "block_size", 1024)
    pairs = 2 if name in ("dpo", "reward_model") else 1
    return pairs, seq


def _second(settings: Any, task: Any, lora_rank: int) -> tuple[ModelShape | None, int]:
    """The frozen reference or teacher the task keeps on the device, and its bytes per weight."""
    name = getattr(type(task), "NAME", "")
    if name == "gkd":
        if task.precompute_teacher or not task.teacher_model:
            return None, 0
        dtype = task.teacher_dtype if task.teacher_dtype != "auto" else "bfloat16"
        return model_shape(task.teacher_model), _dtype_bytes(dtype)
    has_reference = name in ("dpo", "kto") and getattr(task, "loss_type", "") not in (
        "orpo",
        "simpo",
    )
    if name == "grpo":
        has_reference = task.beta > 0
    if not has_reference or getattr(task, "precompute_reference", False) or lora_rank:
        return None, 0  # LoRA: the reference is the policy with its adapter disabled
    shape = model_shape(settings.model.name_or_path)
    return shape, _dtype_bytes(str(settings.model.dtype), 4)


def processes_from_accelerate(path: str | None) -> tuple[int, int, bool]:
    """(processes, shard size, FSDP offload) of an accelerate config file: FSDP shards over
    all processes, HSDP over ``parallelism_config_dp_shard_size``; other launches replicate
    (shard 1)."""
    if not path:
        return 1, 1, False
    import yaml

    found = yaml.safe_load(Path(path).read_text()) or {}
    processes = int(found.get("num_processes") or 1)
    if found.get("distributed_type") != "FSDP":
        return processes, 1, False
    shard = (found.get("parallelism_config") or {}).get("parallelism_config_dp_shard_size")
    offload = bool((found.get("fsdp_config") or {}).get("fsdp_offload_params", False))
    return processes, int(shard or processes), offload


def _attention_shape(settings: Any, moore_threads: bool) -> tuple[bool, bool]:
    """(math attention, packed rows' mask) of a run: eager, or SDPA with packed rows' mask on a
    Moore Threads card, whose flash kernels take no arbitrary mask (MUSA.md), so its SDPA runs
    the math path; CUDA's memory-efficient kernel and the CPU's flash kernel take the mask."""
    attention = str(settings.model.attn_implementation)
    if attention == "auto":
        attention = "sdpa"
    masked = bool(getattr(settings.task, "packing", False)) and attention in ("eager", "sdpa")
    return attention == "eager" or (masked and moore_threads), masked


def run_shape(
    settings: Any,
    *,
    processes: int = 1,
    shard: int = 1,
    fsdp: bool | None = None,
    fused_loss: bool | None = None,
    on_cpu: bool = False,
    mixed_precision: str | None = None,
    labelled: float | None = None,
    fsdp_offload: bool | None = None,
    moore_threads: bool = True,
) -> RunShape:
    """A run's :class:`RunShape` from its validated settings (:func:`recipes.config.validate`).

    ``mixed_precision``: what ``trainer.mixed_precision=auto`` resolves to (bf16 on the cards
    in :data:`CARDS`). ``labelled``: the share of positions whose logits the loss needs; null:
    all of them (the bound for long replies; with ``task.train_on_prompt=false`` the prompt's
    positions need none). ``moore_threads``: a Moore Threads card (its attention kernels).
    ``fsdp``: FSDP wraps the model, on one process too (null: where ``shard`` > 1).
    ``fused_loss``: what the run decided for ``trainer.fused_linear_loss`` (null: what the
    settings say; a LoRA run that adds a template's tokens to a tied model trains its output
    layer, so its loss runs unfused, which only the loaded model shows)."""
    trainer, task = settings.trainer, settings.task
    precision = mixed_precision or str(trainer.mixed_precision)
    if precision == "auto":
        precision = _cpu_precision() if on_cpu else "bf16"
    weight_dtype = str(settings.model.dtype)
    weight_bytes = _dtype_bytes("bfloat16" if weight_dtype == "auto" else weight_dtype)
    compute = weight_bytes if precision == "no" else _dtype_bytes(precision)
    peft = settings.peft
    rank = int(peft.r or 16) if peft.method == "lora" else 0
    pairs, seq = _task_lengths(task)
    name = getattr(type(task), "NAME", "")
    optimizer = str(settings.optimizer.get("_target_", "AdamW"))
    states = 2 if "Adam" in optimizer else 1
    second, second_bytes = _second(settings, task, rank)
    num_generations = getattr(task, "num_generations", 0) if name in ("sft", "gkd") else 0
    rows = trainer.per_device_train_batch_size * pairs
    if fused_loss is None:  # trainer.fused_linear_loss (null: on with LoRA), where it exists
        setting = getattr(trainer, "fused_linear_loss", False)
        fused_loss = bool(rank) if setting is None else bool(setting)
    math_attention, masked = _attention_shape(settings, moore_threads)
    if name == "grpo":
        num_generations = rows * task.num_generations
    return RunShape(
        task=name,
        rows=rows,
        seq=seq,
        eval_rows=trainer.per_device_eval_batch_size * pairs if trainer.eval_at_end else 0,
        weight_bytes=weight_bytes,
        compute_bytes=min(compute, weight_bytes),
        lora_rank=rank,
        lora_targets=peft.target_modules,
        checkpointing=trainer.gradient_checkpointing,
        activation_offload=trainer.activation_offload,
        processes=processes,
        shard=shard,
        fsdp=shard > 1 if fsdp is None else fsdp,
        fsdp_offload=bool(trainer.fsdp_offload if fsdp_offload is None else fsdp_offload)
        and shard > 1,
        labelled=1.0 if labelled is None else labelled,
        math_attention=math_attention,
        masked=masked,
        fused_loss=fused_loss and name in ("sft", "dpo", "kto", "grpo", "gkd"),
        optimizer_states=states,
        second=second,
        second_bytes=second_bytes,
        generation_rows=min(num_generations, settings.generation.batch_size)
        if name != "grpo"
        else num_generations,
        prompt_tokens=seq if name != "grpo" else task.max_prompt_length,
        new_tokens=settings.generation.max_new_tokens
        or getattr(task, "generation_max_new_tokens", 0)
        or getattr(task, "max_completion_length", 0),
        on_cpu=on_cpu,
    )


def _cpu_precision() -> str:
    """``auto`` on a CPU: bf16 where it has bf16 instructions (recipes.device decides the same
    with torch's autocast check, which the plan does not import)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no"
    return "bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "no"


def plan_settings(
    settings: Any,
    *,
    card: str | None = None,
    card_bytes: int | None = None,
    moore_threads: bool | None = None,
    **options: Any,
) -> Plan:
    """The plan of a validated run's settings on ``card`` (or ``card_bytes``); ``options`` as
    :func:`run_shape` takes them. Whether the device is a Moore Threads card follows the card
    unless given."""
    on_cpu = options.get("on_cpu", False)
    if moore_threads is None:
        moore_threads = not on_cpu and moore_threads_card(card)
    run = run_shape(settings, moore_threads=moore_threads, **options)
    if card is not None and card_bytes is None:
        card_bytes = card_memory(card)
    return plan(model_shape(settings.model.name_or_path), run, card, card_bytes)


# -------------------------------------------------------------------------------- reports


def gib(size: float) -> str:
    return f"{size / GIB:.2f} GiB"


def report(found: Plan, fix: Fix | None = None) -> str:
    """The plan as text: each phase's parts, the peak, and the verdict on the card."""
    m, r = found.model, found.run
    lines = [
        f"model: {m.params / 1e9:.2f}B parameters ({m.layers} layers, hidden {m.hidden}, "
        f"vocabulary {m.vocab}{f', {m.experts} experts' if m.experts else ''}); "
        f"{'LoRA r=' + str(r.lora_rank) if r.lora_rank else 'full fine-tuning'}; "
        f"{r.rows} x {r.seq} tokens per micro-batch; {r.processes} process(es)"
        + (f", sharded over {r.shard}" if r.shard > 1 else ""),
    ]
    for phase in found.phases:
        lines.append(f"{phase.name}: {gib(phase.total)}")
        for part in phase.parts:
            if part.bytes:
                note = f"  ({part.note})" if part.note else ""
                lines.append(f"    {part.name:<32} {gib(part.bytes):>12}{note}")
    ckpt = replace(r, checkpointing=True, activation_offload=False)
    act_on = activations(m, ckpt).bytes + recomputed_layer(m, ckpt).bytes
    lines.append(
        f"activations: {gib(activations_without_checkpointing(m, r))} without checkpointing, "
        f"{gib(act_on)} with"
    )
    if found.host_bytes:
        lines.append(f"host memory for offload: {gib(found.host_bytes)} per process")
    lines.append(f"peak: {gib(found.peak_bytes)} ({found.peak.name})")
    lines.append(verdict(found, fix))
    return "\n".join(lines)


def verdict(found: Plan, fix: Fix | None) -> str:
    """One line: fits or not on the card, and the cheapest fix."""
    if found.card_bytes is None:
        return "fit: no card named (--card S4000|S5000|H100|...)"
    on = f"{found.card or 'this device'} ({gib(found.card_bytes)})"
    need = (
        f"needs {gib(found.needed_bytes)} with the context and allocator's headroom"
        if not found.run.on_cpu
        else f"needs {gib(found.needed_bytes)}"
    )
    if found.fits:
        return f"fits on {on}: {need}"
    if fix is None:
        return f"does not fit on {on}: {need}; no combination of the fixes tried fits"
    return f"does not fit on {on}: {need}; cheapest fix: {fix} (then {gib(fix.plan.needed_bytes)})"


def refusal(found: Plan, fix: Fix | None) -> str:
    """The one line a run that does not fit is refused with (recipes.modes, the loop's OOM)."""
    advice = f"cheapest fix: {fix}" if fix else "no combination of the fixes tried fits"
    each = "in this process" if found.run.on_cpu else "per card"
    return (
        f"the plan estimates {gib(found.needed_bytes)} {each} ({found.peak.name}) and "
        f"{found.card or 'this device'} has {gib(found.card_bytes or 0)}; {advice} "
        "(python -m recipes.plan <the same overrides> shows the parts; "
        "trainer.check_memory=false skips this check)"
    )


# -------------------------------------------------------------------------------- the command


def compose(overrides: list[str]) -> Any:
    """The run's settings composed and validated as train.py does it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from recipes.config import register_resolvers, validate

    register_resolvers()
    conf = Path(__file__).resolve().parents[1] / "conf"
    if not any(o.startswith("output_dir=") for o in overrides):
        overrides = [*overrides, "output_dir=outputs/plan"]  # composed, never made
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides)
    return validate(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipes.plan",
        description="The memory a train.py run needs, per card, before it runs.",
    )
    parser.add_argument("--card", action="append", help=f"one of {', '.join(CARDS)} (repeatable)")
    parser.add_argument("--num-processes", type=int, default=None, help="data-parallel processes")
    parser.add_argument(
        "--config-file", default=None, help="the accelerate config the run launches with"
    )
    parser.add_argument(
        "--labelled-fraction",
        type=float,
        default=None,
        help="share of positions that carry loss (default 1: the bound)",
    )
    parser.add_argument("--cpu", action="store_true", help="plan a run on this CPU")
    args, overrides = parser.parse_known_args(argv)
    from recipes.config import ConfigError

    try:
        for card in args.card or ():
            card_memory(card)  # a misspelt card before the config's longer checks
        settings = compose(overrides)
        processes, shard, offload = processes_from_accelerate(args.config_file)
        if args.num_processes:  # alone: FSDP2 over them (DDP would not shrink a card's share)
            shard = args.num_processes if shard > 1 or not args.config_file else shard
            processes = args.num_processes
        for card in args.card or list(CARDS)[:3]:
            found = plan_settings(
                settings,
                card=card,
                processes=processes,
                shard=shard,
                on_cpu=args.cpu,
                labelled=args.labelled_fraction,
                fsdp_offload=offload if settings.trainer.fsdp_offload is None else None,
            )
            fix = None if found.fits else cheapest_fix(found.model, found.run, found.card_bytes)
            sys.stdout.write(f"== {card}\n{report(found, fix)}\n")
    except (ConfigError, PlanError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

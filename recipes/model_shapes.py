"""The real shapes of the models users fine-tune, kept offline.

Each entry is the architecture part of the model's ``config.json`` on the hub (the fields that
size it: widths, depths, heads, vocabulary, experts). ``recipes.plan`` sizes a run from them
without a download, and the tests build each family at full width and reduced depth from them
(random weights). Keyed by the hub id that ``conf/model/<preset>.yaml`` names.

No torch or transformers here: the plan is computed before anything heavy loads.
"""

from __future__ import annotations

from typing import Any

_QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 128,
    "num_key_value_heads": 8,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
    "attention_bias": False,
}
_QWEN2_7B = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": {
        **_QWEN3,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-4B": {
        **_QWEN3,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-8B": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-14B": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-32B": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-30B-A3B": {
        **_QWEN3,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    # The instruct model's config.json says 32,768 positions (the base model's 131,072).
    "Qwen/Qwen2.5-7B-Instruct": {
        **_QWEN2_7B,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
    },
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": {**_QWEN2_7B, "rope_theta": 10000.0},
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # Gemma 3 4B is an image-text model; its text tower (Gemma3ForCausalLM) is what text
    # fine-tuning trains. The vision tower (about 0.4B) is left out of the shape.
    "google/gemma-3-4b-it": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "vocab_size": 262208,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    # The transformers-native GLM-4 (model_type glm); THUDM/glm-4-9b-chat itself needs remote code.
    "THUDM/glm-4-9b-chat-hf": {
        "model_type": "glm",
        "architectures": ["GlmForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 13696,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "vocab_size": 151552,
        "rms_norm_eps": 1.5625e-07,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
}


def shape_of(name_or_path: str) -> dict[str, Any] | None:
    """The kept shape of a hub model, or None for a model not listed here."""
    return SHAPES.get(name_or_path)


def reduced(name_or_path: str, layers: int = 2, **changes: Any) -> dict[str, Any]:
    """The model's shape cut to ``layers`` decoder layers (full width), for tests and plans."""
    shape = dict(SHAPES[name_or_path])
    shape["num_hidden_layers"] = layers
    shape.update(changes)
    return shape

"""flash_attn.bert_padding's pad_input / unpad_input: transformers' own equivalents."""

from transformers.modeling_flash_attention_utils import _pad_input as pad_input
from transformers.modeling_flash_attention_utils import _unpad_input as unpad_input

__all__ = ["pad_input", "unpad_input"]

"""Chat templates that reproduce what each preset family's own template does, tools left out
(tests/test_chat_templates_families.py checks them against the real ones where TRL ships them),
and tiny tokenizers that carry them (tests/test_families.py saves one with each model).

- Qwen3 (Qwen/Qwen3-8B's tokenizer_config.json, as TRL's ``trl/chat_templates/qwen3.jinja``
  copies it): a reply after the last user turn gets a ``<think>`` block (empty when it has no
  reasoning), earlier replies lose theirs, ``enable_thinking=false`` closes an empty block in the
  generation prompt.
- Llama 3.1 (meta-llama/Llama-3.1-8B-Instruct's, as ``trl/chat_templates/llama3_1.jinja``): every
  conversation opens with a system header carrying "Cutting Knowledge Date: December 2023" and
  "Today Date: <date_string>" (26 Jul 2024 unless given), the system turn's text after it.
- Gemma 3 (google/gemma-3-4b-it's, as ``trl/chat_templates/gemma3.jinja``, text only): no
  system role; a system turn is folded into the first user turn; the assistant is ``model``.
- GLM-4 (THUDM/glm-4-9b-chat-hf's, tools left out): ``[gMASK]<sop>`` then ``<|role|>\\n`` turns
  with no end-of-turn token (the model stops by writing ``<|user|>``).
- Qwen2.5 / its R1 distills: the project's ``qwen2_5`` template (Qwen 2.5's own, byte for byte).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from recipes.config import ModelConfig
from recipes.model import load_tokenizer
from recipes.tasks.chat.template import CHAT_TEMPLATES

TINY_LLAMA = Path(__file__).resolve().parents[1] / "recipes/assets/tiny-llama"

QWEN3 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
LLAMA3_1 = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
GLM4 = (
    "[gMASK]<sop>{% for item in messages %}"
    "<|{{ item['role'] }}|>\n{{ item['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
QWEN2_5 = CHAT_TEMPLATES["qwen2_5"]

# Each template's special tokens (single tokens in the family's own vocabulary) and its
# tokenizer's BOS and EOS (the instruct models end a reply with their end-of-turn token).
CHATML = ["<|im_start|>", "<|im_end|>"]
TOKENS: dict[str, dict] = {
    "qwen3": {
        "template": QWEN3,
        "special": CHATML,
        "plain": ["<think>", "</think>"],
        "eos": "<|im_end|>",
    },
    "qwen2_5": {"template": QWEN2_5, "special": CHATML, "eos": "<|im_end|>"},
    "llama3_1": {
        "template": LLAMA3_1,
        "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
    },
    "gemma3": {
        "template": GEMMA3,
        "special": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
        "bos": "<bos>",
        "eos": "<end_of_turn>",
    },
    "glm4": {
        "template": GLM4,
        "special": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"],
    },
}


def family_tokenizer(family: str) -> PreTrainedTokenizerBase:
    """The bundled tiny Llama's tokenizer (2,000 tokens) with ``family``'s chat tokens, BOS, EOS
    and chat template."""
    spec = TOKENS[family]
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    tokenizer.add_tokens(spec["special"], special_tokens=True)
    tokenizer.add_tokens(spec.get("plain", []))
    if "bos" in spec:
        tokenizer.bos_token = spec["bos"]
    if "eos" in spec:
        tokenizer.eos_token = spec["eos"]
    tokenizer.chat_template = spec["template"]
    return tokenizer

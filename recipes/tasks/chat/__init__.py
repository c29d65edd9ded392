"""The chat family's shared parts: what SFT, DPO, KTO, GRPO, GKD and the reward model are
assembled from, behind one front door. A chat task imports this package (``from recipes.tasks
import chat``) and uses the names below, never a module inside it:

* rows (:mod:`.rows`): the conversation layouts read and normalised to messages; preference pairs
  (:mod:`.preference`) and unpaired rows (:mod:`.unpaired`) built on them;
* the template (:mod:`.template`): chat templates, rendering, which tokens are labelled, the
  tokens that end a turn;
* batches (:mod:`.batches`): the length policy, packing, collators, padding-free rows, the masks of
  packed rows and the model's forward on them; the token loss (:mod:`.token_loss`);
* features (:mod:`.features`): :class:`ChatFeatures`, a task's rows rendered, tokenized and cached,
  its held-out answers and mode=predict;
* the reference model (:mod:`.reference`): :class:`Reference`, and the policy-against-reference
  part that DPO and KTO share.

Modules in this package import each other directly; nothing outside it does.
"""

from recipes.tasks.chat import preference, reference, unpaired
from recipes.tasks.chat.batches import (
    VARLEN_ATTENTION,
    ChatCollator,
    attention_mask,
    choose_fused_loss,
    fit_length,
    flat_batches,
    flat_rows,
    forward,
    lazy_forward,
    pack,
    packed_rows,
    packing_unsupported_reason,
    pad_rows,
    padded_length,
    padding_free,
    padding_free_setting,
    sequence_losses,
)
from recipes.tasks.chat.features import (
    ChatData,
    ChatFeatures,
    PromptAnswers,
    answer_held_out,
    generation_scores,
    held_out_prompts,
    tokenize_rows,
)
from recipes.tasks.chat.reference import AgainstReference, PreferenceData, Reference
from recipes.tasks.chat.rows import (
    COLUMNS,
    LayoutError,
    Message,
    normalise,
    parse_message,
    read_conversations,
    to_messages,
)
from recipes.tasks.chat.template import (
    CHAT_TEMPLATES,
    IGNORE_INDEX,
    ChatTemplate,
    RowError,
    TemplateMismatch,
    check_template,
    refusal,
    render,
    render_text,
    require_template,
    resolve_chat_template,
    templated_reply,
    tokenize_conversation,
    tokenize_text,
    use_template,
)
from recipes.tasks.chat.token_loss import (
    CHUNK_ELEMENTS,
    labelled_positions,
    token_losses,
)

__all__ = [
    "CHAT_TEMPLATES",
    "CHUNK_ELEMENTS",
    "COLUMNS",
    "IGNORE_INDEX",
    "VARLEN_ATTENTION",
    "AgainstReference",
    "ChatCollator",
    "ChatData",
    "ChatFeatures",
    "ChatTemplate",
    "LayoutError",
    "Message",
    "PreferenceData",
    "PromptAnswers",
    "Reference",
    "RowError",
    "TemplateMismatch",
    "answer_held_out",
    "attention_mask",
    "check_template",
    "choose_fused_loss",
    "fit_length",
    "flat_batches",
    "flat_rows",
    "forward",
    "generation_scores",
    "held_out_prompts",
    "labelled_positions",
    "lazy_forward",
    "normalise",
    "pack",
    "packed_rows",
    "packing_unsupported_reason",
    "pad_rows",
    "padded_length",
    "padding_free",
    "padding_free_setting",
    "parse_message",
    "preference",
    "read_conversations",
    "reference",
    "refusal",
    "render",
    "render_text",
    "require_template",
    "resolve_chat_template",
    "sequence_losses",
    "templated_reply",
    "to_messages",
    "token_losses",
    "tokenize_conversation",
    "tokenize_rows",
    "tokenize_text",
    "unpaired",
    "use_template",
]

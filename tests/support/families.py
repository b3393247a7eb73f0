"""Tiny random masked LMs of each supported family, with tokenizers trained here on real text.

Each tokenizer mirrors its published family's conventions (the `tokenizers` library, trained on the text the
caller gives): WordPiece with BERT's normaliser for BERT and DistilBERT; byte-level BPE without a prefix space for
RoBERTa and ModernBERT, whose mask token takes the space before it (``lstrip``); SentencePiece-style Unigram with
the Metaspace pre-tokenizer for XLM-R (``<mask>`` with ``lstrip``) and DeBERTa-v2/v3 (``[MASK]`` without it, and
the model's vocabulary padded past the tokenizer's, as deberta-v3-base's 128,100 rows for 128,001 tokens). Every
model is saved with ``save_pretrained`` and loaded back through the production loader.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("bert", "distilbert", "roberta", "modernbert", "xlm-roberta", "deberta-v2")


@dataclass(frozen=True)
class Family:
    name: str
    cased: bool
    mask: str


def _wordpiece(texts: list[str], vocab_size: int):  # noqa: ANN202 - tokenizers objects are untyped
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=None, clean_text=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )  # fmt: skip
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok, dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def _byte_bpe(texts: list[str], vocab_size: int, *, roberta: bool):  # noqa: ANN202
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if roberta:
        names = dict(cls_token="<s>", pad_token="<pad>", sep_token="</s>", unk_token="<unk>", mask_token="<mask>")
        specials = ["<s>", "<pad>", "</s>", "<unk>"]
    else:  # ModernBERT's published tokenizer: BERT-style special tokens around a byte-level BPE
        names = dict(cls_token="[CLS]", pad_token="[PAD]", sep_token="[SEP]", unk_token="[UNK]", mask_token="[MASK]")
        specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(names["mask_token"], lstrip=True, rstrip=False, normalized=False)])
    cls, sep = names["cls_token"], names["sep_token"]
    if roberta:
        sep_id, cls_id = tok.token_to_id(sep), tok.token_to_id(cls)
        assert sep_id is not None and cls_id is not None
        tok.post_processor = processors.RobertaProcessing(
            (sep, sep_id), (cls, cls_id), trim_offsets=True, add_prefix_space=False
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))]
        )
    return tok, names


def _unigram(texts: list[str], vocab_size: int, *, xlmr: bool):  # noqa: ANN202
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    if xlmr:
        names = dict(cls_token="<s>", pad_token="<pad>", sep_token="</s>", unk_token="<unk>", mask_token="<mask>")
        specials = ["<s>", "<pad>", "</s>", "<unk>"]
    else:
        names = dict(cls_token="[CLS]", pad_token="[PAD]", sep_token="[SEP]", unk_token="[UNK]", mask_token="[MASK]")
        specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, unk_token=names["unk_token"])
    tok.train_from_iterator(texts, trainer)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(names["mask_token"], lstrip=xlmr, rstrip=False, normalized=False)])
    cls, sep = names["cls_token"], names["sep_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))]
    )
    return tok, names


def _config(family: str, vocab_size: int, names: dict[str, int], *, hidden: int, layers: int, heads: int,
            intermediate: int, positions: int):  # noqa: ANN202
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=vocab_size, pad_token_id=names["pad"])
    bert_like: dict[str, Any] = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=intermediate, max_position_embeddings=positions, **common)
    kinds: dict[str, tuple[Any, dict[str, Any]]] = {
        "bert": (tf.BertConfig, bert_like),
        "distilbert": (tf.DistilBertConfig, dict(dim=hidden, n_layers=layers, n_heads=heads, hidden_dim=intermediate,
                                                 max_position_embeddings=positions, **common)),
        "roberta": (tf.RobertaConfig, {**bert_like, "max_position_embeddings": positions + 2,
                                       "bos_token_id": names["cls"], "eos_token_id": names["sep"]}),
        "xlm-roberta": (tf.XLMRobertaConfig, {**bert_like, "max_position_embeddings": positions + 2,
                                              "bos_token_id": names["cls"], "eos_token_id": names["sep"]}),
        "modernbert": (tf.ModernBertConfig, {**bert_like, "global_attn_every_n_layers": 2, "local_attention": 16,
                                             "cls_token_id": names["cls"], "sep_token_id": names["sep"],
                                             "bos_token_id": names["cls"], "eos_token_id": names["sep"]}),
        "deberta-v2": (tf.DebertaV2Config, {**bert_like, "relative_attention": True, "position_buckets": 16,
                                            "pos_att_type": ["p2c", "c2p"], "position_biased_input": False,
                                            "norm_rel_ebd": "layer_norm", "share_att_key": True}),
    }  # fmt: skip
    if family not in kinds:
        raise ValueError(f"unknown family {family!r}")
    cls, kwargs = kinds[family]
    return cls(**kwargs)


def train_tokenizer(family: str, texts: Iterable[str], *, vocab_size: int = 800):  # noqa: ANN201
    """The family's fast tokenizer (a `PreTrainedTokenizerFast`), trained on ``texts``."""
    from transformers import PreTrainedTokenizerFast

    texts = list(texts)
    if family in ("bert", "distilbert"):
        tok, names = _wordpiece(texts, vocab_size)
    elif family in ("roberta", "modernbert"):
        tok, names = _byte_bpe(texts, vocab_size, roberta=family == "roberta")
    elif family in ("xlm-roberta", "deberta-v2"):
        tok, names = _unigram(texts, vocab_size, xlmr=family == "xlm-roberta")
    else:
        raise ValueError(f"unknown family {family!r}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names)


def make_family_model(
    directory: Path, family: str, texts: Iterable[str], *, vocab_size: int = 800, hidden: int = 32, layers: int = 2,
    heads: int = 2, intermediate: int = 37, positions: int = 128, seed: int = 0, model_vocab_size: int | None = None,
    tokenizer=None,  # noqa: ANN001 - a ready tokenizer (train_tokenizer's) instead of training one
) -> Path:
    """A random masked LM of ``family`` with a tokenizer trained on ``texts``, saved in ``directory``.

    ``model_vocab_size``: the model's vocabulary rows (at least the tokenizer's); DeBERTa-v2 pads by 7 by default.
    """
    import torch
    from transformers import AutoModelForMaskedLM

    directory.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else train_tokenizer(family, texts, vocab_size=vocab_size)
    rows = model_vocab_size or (len(tok) + 7 if family == "deberta-v2" else len(tok))
    ids = {"pad": tok.pad_token_id, "cls": tok.cls_token_id, "sep": tok.sep_token_id}
    cfg = _config(family, rows, ids, hidden=hidden, layers=layers, heads=heads, intermediate=intermediate,
                  positions=positions)  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForMaskedLM.from_config(cfg).eval().save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory

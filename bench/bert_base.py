"""A masked LM with bert-base-uncased's exact shape and random weights: for timings only. One command::

    python -m bench.bert_base [--out runs/bert-base-shaped]

bert-base-uncased's weights cannot be downloaded here, but how long its forward takes does not depend on the
weights' values: the same configuration (12 layers, hidden 768, 12 heads, intermediate 3,072, vocabulary 30,522,
BertConfig's defaults, checked below) with seeded random weights runs the same kernels on the same shapes. The
real bert-base-uncased tokenizer (``../shared/data/tokenizer``) goes with it. Its answers are meaningless: use it
to measure the service's cost around the default model's forward (``python -m bench.serving --model
runs/bert-base-shaped``), never for quality.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from bench.common import RUNS, SHARED

TOKENIZER = SHARED / "data" / "tokenizer" / "bert-base-uncased"
# bert-base-uncased's config.json, the fields that set the compute
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
             "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu"}  # fmt: skip


def make(out: Path, *, seed: int = 0, shape: dict[str, Any] | None = None) -> Path:
    """Write the model (safetensors, float32) and the tokenizer to ``out``; reused when it is already there.

    ``shape``: other configuration fields than bert-base-uncased's (the tests write a small one)."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(**(shape or BERT_BASE))
    torch.manual_seed(seed)
    model = BertForMaskedLM(config).eval()
    n = sum(p.numel() for p in model.parameters())
    if shape is None and not 109_000_000 < n < 111_000_000:  # bert-base-uncased's BertForMaskedLM: 109.5M (tied decoder)
        raise RuntimeError(f"unexpected parameter count {n:,}: not bert-base-uncased's shape")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, tmp / f.name)
    (tmp / "README.md").write_text(
        "Random weights in bert-base-uncased's shape, written by `python -m bench.bert_base`: timings only.\n"
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RUNS / "bert-base-shaped")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(make(args.out, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

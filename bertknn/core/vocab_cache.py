"""The vocabulary's word table (`VocabWords`: each token's shown text and the word it stands for) kept on disk
under a key of the tokenizer and the code that reads it, so that a process that starts again (a replaced
worker, the next of N workers, a restart, a builder's worker) loads it instead of tokenising the whole
vocabulary back (`read_vocab_words`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import transformers

from bertknn.core import languages, text, wordmodel
from bertknn.core.disk_cache import locked, module_bytes, prune, usable_dir
from bertknn.core.wordmodel import VocabWords, WordModel, read_vocab_words

logger = logging.getLogger(__name__)

FORMAT = 1  # bumped when what a kept table holds changes
SUFFIX = ".json"
KEEP = 16  # tables kept per directory, the most recently used (a few hundred kilobytes each)
SETTING_HELP = (
    "where the vocabulary's word table (each token's text and the word it stands for) is kept, under a key of the "
    "tokenizer, the code and the library versions it came from, so that the next start loads it instead of "
    "tokenising the vocabulary again: auto ($XDG_CACHE_HOME/bert-knn/vocab, else ~/.cache/bert-knn/vocab), a "
    "directory, or off"
)


@dataclass(frozen=True)
class VocabCache:
    """One directory of word tables, ``<key>.json`` each; any of them may be deleted at any time."""

    directory: Path

    @classmethod
    def from_setting(cls, setting: str) -> VocabCache | None:
        """``auto``: ``$XDG_CACHE_HOME/bert-knn/vocab``; ``off``: no cache; anything else: that directory. None,
        logged, where the directory cannot be made or written: the table is then made at each start."""
        directory = usable_dir(setting, "vocab", label="vocabulary cache", without="the table is made at each start")
        return None if directory is None else cls(directory)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def words(self, model: WordModel) -> VocabWords:
        """``model``'s table: the kept one, or made (`read_vocab_words`) and kept. A kept file that cannot be
        read or does not fit the vocabulary is logged and made again; a directory gone meanwhile, logged."""
        key = vocab_key(model)
        try:
            with locked(self.directory, key):  # processes that start together make it once
                table = self._kept_or_made(model, self.path(key))
        except OSError as exc:
            logger.warning("vocabulary cache %s not used (%s): the table is made here", self.directory, exc)
            return read_vocab_words(model)
        prune(self.directory, SUFFIX, KEEP)
        return table

    def _kept_or_made(self, model: WordModel, path: Path) -> VocabWords:
        kept = _read(path, model.vocab_size)
        if kept is not None:
            with contextlib.suppress(OSError):  # pruned meanwhile by another process: it was read whole
                os.utime(path)  # used: the last to be pruned
            logger.info("vocabulary table loaded from %s", path)
            return kept
        made = read_vocab_words(model)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"format": FORMAT, "texts": made.texts, "word_of": made.word_of.tolist()}))
            os.replace(tmp, path)
            logger.info("vocabulary table made and kept in %s", path)
        except OSError as exc:
            logger.warning("vocabulary table not kept (%s)", exc)
        finally:
            tmp.unlink(missing_ok=True)
        return made


def _read(path: Path, vocab_size: int) -> VocabWords | None:
    """The table kept at ``path``, or None where there is none, or it is unreadable or does not fit."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("vocabulary table %s unreadable (%s): made again", path, exc)
        return None
    table = _table(kept, vocab_size)
    if table is None:
        logger.warning("vocabulary table %s does not fit a vocabulary of %d rows: made again", path, vocab_size)
    return table


def _table(kept: object, vocab_size: int) -> VocabWords | None:
    """A parsed file's table, where it is this format's, one text and one id (-1 or a row) per row."""
    if not isinstance(kept, dict) or kept.get("format") != FORMAT:
        return None
    texts, word_of = kept.get("texts"), kept.get("word_of")
    if not isinstance(texts, list) or not isinstance(word_of, list) or not len(texts) == len(word_of) == vocab_size:
        return None
    if not all(isinstance(t, str) for t in texts) or not all(type(i) is int and -1 <= i < vocab_size for i in word_of):
        return None
    return VocabWords(texts, np.asarray(word_of, dtype=np.int64).reshape(-1))


def vocab_key(model: WordModel) -> str:
    """What the table depends on: the tokenizer (its whole serialised pipeline and special tokens), the model's
    vocabulary size, the code that reads it, and the versions of the libraries whose decoding, Unicode tables
    and word breaking it goes through."""
    tok = model.tokenizer
    code = hashlib.sha256()
    for module in (wordmodel, text, languages):
        code.update(module_bytes(module.__name__))
    code.update((Path(languages.__file__).parent / "languages.json").read_bytes())
    breaker = languages.word_breaker()
    described = {
        "format": FORMAT,
        "tokenizer": hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest(),
        "class": type(tok).__name__, "special": sorted(map(str, tok.special_tokens_map.items())),
        "tokens": len(tok), "vocab_size": model.vocab_size, "lowercase": model.lowercase,
        "code": code.hexdigest(), "python": sys.version, "unicode": unicodedata.unidata_version,
        "tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
        "breaker": breaker, "icu": getattr(sys.modules.get("icu"), "ICU_VERSION", None),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=repr).encode()).hexdigest()[:32]

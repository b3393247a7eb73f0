"""The LAMA probe in its released format, and its cloze queries built as LAMA builds them in template mode.

Layout read under a probe directory (any part may be absent)::

    relations.jsonl             {"relation": "P19", "template": "[X] was born in [Y] .", "label": ...} per line
    TREx/P19.jsonl              T-REx facts with evidences (sub_label, obj_label, uuid, evidences[].masked_sentence)
    TREx_facts_all41/P19.jsonl  fact-only T-REx files (sub_label, obj_label, uuid)
    Google_RE/place_of_birth_test.jsonl   Google-RE facts with rater judgments
    Squad/test.jsonl            SQuAD cloze sentences (masked_sentences, obj_label, id)

Query rules (LAMA's): one query per unique (subject, object) pair; ``[X]`` becomes the subject and ``[Y]`` the
mask; SQuAD keeps its own masked sentence; Google-RE keeps a fact only when its "yes" judgments outnumber its
"no" ones; text is lowercased for uncased models, the mask token excepted; a fact is kept only when its object
is a single wordpiece of the model's vocabulary (and, optionally, in a restricted vocabulary such as LAMA's
common vocabulary).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from bertknn.core.errors import LamaError, json_line_problem
from bertknn.core.text import MASK_RE
from bertknn.core.wordmodel import WordModel, lowercases

logger = logging.getLogger(__name__)

MASK = "[MASK]"
_PID = re.compile(r"^P(\d+)$")

GOOGLE_RE = "Google-RE"
TREX = "T-REx"
SQUAD = "SQuAD"
DATASETS: tuple[str, ...] = (GOOGLE_RE, TREX, SQUAD)

RELATIONS_FILE = "relations.jsonl"
MLAMA_TEMPLATES = "templates.jsonl"  # mLAMA (norakassner/mlama): <language>/templates.jsonl and <language>/P*.jsonl
TREX_DIR = "TREx"
TREX_FACTS_DIR = "TREx_facts_all41"
GOOGLE_RE_DIR = "Google_RE"
SQUAD_FILE = "Squad/test.jsonl"
SQUAD_RELATION = "squad"

# LAMA's own templates for Google-RE (its run configuration; the files carry no template).
GOOGLE_RE_TEMPLATES: dict[str, str] = {
    "place_of_birth": "[X] was born in [Y] .",
    "date_of_birth": "[X] (born [Y]).",
    "place_of_death": "[X] died in [Y] .",
}

TrexSource = Literal["all", "evidence", "facts"]
Split = Literal["all", "dev", "test"]

# The dev split used by --grid: a fact is dev when sha256(its id) mod 100 < DEV_PERCENT. Deterministic and
# independent of file order, so the same fact is always on the same side.
DEV_PERCENT = 20


@dataclass(frozen=True)
class Relation:
    id: str  # "P19", "place_of_birth", "squad"
    dataset: str  # one of DATASETS
    path: Path
    template: str | None  # None for SQuAD (it has its own masked sentences)
    label: str = ""


@dataclass(frozen=True)
class Fact:
    uid: str
    subject: str | None
    obj: str
    sentences: tuple[str, ...] = ()  # SQuAD's masked sentences
    accepted: bool = True  # False: Google-RE raters did not accept it (yes <= no)


@dataclass(frozen=True)
class LamaQuery:
    relation: str
    dataset: str
    uid: str
    text: str  # the cloze question, with exactly one [MASK]
    subject: str | None  # the subject label as the probe spells it (the service's subject-article rule)
    obj: str  # the gold object as the model's wordpiece (--multi-piece queries: the whole word)
    obj_id: int  # -1 for a multi-piece word
    obj_pieces: tuple[int, ...] = ()  # --multi-piece queries: the word's wordpiece ids


@dataclass
class FilterStats:
    """What happened to a relation's facts on the way to queries."""

    read: int = 0
    rejected_by_raters: int = 0
    no_subject: int = 0
    bad_mask: int = 0
    not_single_wordpiece: int = 0
    not_in_vocab: int = 0
    duplicate: int = 0
    over_limit: int = 0
    other_split: int = 0
    kept: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def drop(self, reason: str) -> None:
        """One more fact dropped for ``reason`` (a field's name)."""
        setattr(self, reason, getattr(self, reason) + 1)


# ---- reading ----------------------------------------------------------------------------------------------


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise LamaError(f"{path}:{lineno}: not valid JSON ({json_line_problem(exc)})") from exc
                if not isinstance(obj, dict):
                    raise LamaError(f"{path}:{lineno}: expected a JSON object")
                yield lineno, obj
    except OSError as exc:
        raise LamaError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


def load_templates(path: Path) -> dict[str, tuple[str, str]]:
    """``relations.jsonl`` -> {relation id: (template, label)}."""
    out: dict[str, tuple[str, str]] = {}
    for lineno, obj in _iter_jsonl(path):
        rel, template = obj.get("relation"), obj.get("template")
        if not isinstance(rel, str) or not isinstance(template, str):
            raise LamaError(f'{path}:{lineno}: expected string "relation" and "template"')
        check_template(template, where=f"{path}:{lineno}")
        out[rel] = (template, str(obj.get("label", "")))
    return out


def check_template(template: str, *, where: str) -> None:
    if template.count("[X]") != 1 or template.count("[Y]") != 1:
        raise LamaError(f"{where}: template {template!r} must contain [X] and [Y] exactly once each")


def _pid_key(path: Path) -> tuple[int, str]:
    m = _PID.match(path.stem)
    return (int(m.group(1)) if m else 1 << 30, path.stem)


def mlama_folder(root: Path, language: str | None) -> Path | None:
    """The folder of mLAMA's layout (one folder per language: ``templates.jsonl`` beside one ``RELATION.jsonl``
    of facts per relation, as ``norakassner/mlama``'s ``dataset/reader.py`` reads it) that ``root`` is or holds
    for ``language`` (``root/ja``, ``root/mlama1.1/ja``), or None."""
    candidates = [root]
    if language:
        candidates += [root / language, root / "mlama1.1" / language]
    for folder in candidates:
        if (folder / MLAMA_TEMPLATES).is_file() and len(list(folder.glob("*.jsonl"))) > 1:
            return folder
    return None


def _mlama_relations(folder: Path) -> list[Relation]:
    """An mLAMA language folder: its templates (in its language) and the facts of each relation (T-REx's ``P*``
    and Google-RE's translated ones alike: ``sub_label``/``obj_label`` facts, scored as T-REx's)."""
    templates = load_templates(folder / MLAMA_TEMPLATES)
    out = []
    for path in sorted((p for p in folder.glob("*.jsonl") if p.name != MLAMA_TEMPLATES), key=_pid_key):
        if path.stem not in templates:
            raise LamaError(f"{path}: relation {path.stem} has no template in {folder / MLAMA_TEMPLATES}")
        template, label = templates[path.stem]
        out.append(Relation(path.stem, TREX, path, template, label))
    return out


def discover_relations(
    data_dir: Path | str, *, trex: TrexSource = "all", language: str | None = None
) -> list[Relation]:
    """Every relation file under a LAMA directory, Google-RE first, then T-REx (by P number), then SQuAD; or, for
    a directory in mLAMA's layout, the T-REx relations of ``language`` (the datastore's) with its templates.

    ``trex``: "evidence" reads ``TREx/`` only, "facts" reads ``TREx_facts_all41/`` only, "all" reads a relation
    from ``TREx/`` when it has a file there and from the fact-only directory otherwise.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise LamaError(
            f"{root}: no such directory; pass --data pointing at a LAMA probe (e.g. ../shared/data/lama)"
        )
    mlama = mlama_folder(root, language)
    if mlama is not None:
        return _mlama_relations(mlama)
    if language not in (None, "en") and not (root / RELATIONS_FILE).is_file():
        raise LamaError(f"{root}: no mLAMA folder for {language!r} ({language}/templates.jsonl beside P*.jsonl)")
    relations: list[Relation] = []

    gre = root / GOOGLE_RE_DIR
    for path in sorted(gre.glob("*_test.jsonl")) if gre.is_dir() else []:
        name = path.name.removesuffix("_test.jsonl")
        template = GOOGLE_RE_TEMPLATES.get(name)
        if template is None:
            logger.warning("%s: no LAMA template known for Google-RE relation %r; skipped", path, name)
            continue
        relations.append(Relation(name, GOOGLE_RE, path, template, name.replace("_", " ")))

    trex_files: dict[str, Path] = {}
    dirs = {"evidence": [TREX_DIR], "facts": [TREX_FACTS_DIR], "all": [TREX_DIR, TREX_FACTS_DIR]}[trex]
    for d in dirs:
        for path in sorted((root / d).glob("P*.jsonl")) if (root / d).is_dir() else []:
            trex_files.setdefault(path.stem, path)
    if trex_files:
        templates_path = root / RELATIONS_FILE
        if not templates_path.is_file():
            raise LamaError(f"{templates_path}: missing; the T-REx files need LAMA's relation templates")
        templates = load_templates(templates_path)
        for rel, path in sorted(trex_files.items(), key=lambda kv: _pid_key(kv[1])):
            if rel not in templates:
                raise LamaError(f"{path}: relation {rel} has no template in {templates_path}; add it there")
            template, label = templates[rel]
            relations.append(Relation(rel, TREX, path, template, label))

    squad = root / SQUAD_FILE
    if squad.is_file():
        relations.append(Relation(SQUAD_RELATION, SQUAD, squad, None, "SQuAD"))
    if not relations:
        raise LamaError(
            f"{root}: no LAMA files found; expected {TREX_DIR}/P*.jsonl (+ {RELATIONS_FILE}), "
            f"{TREX_FACTS_DIR}/P*.jsonl, {GOOGLE_RE_DIR}/*_test.jsonl or {SQUAD_FILE}"
        )
    return relations


def select_relations(
    relations: Sequence[Relation], ids: Iterable[str] | None = None, datasets: Iterable[str] | None = None
) -> list[Relation]:
    """Keep the named relations (``P19``, ``place_of_birth``, ``squad``) and/or datasets; unknown names fail."""
    out = list(relations)
    if datasets is not None:
        wanted_ds = {d.casefold() for d in datasets}
        known_ds = {d.casefold() for d in DATASETS}
        unknown = sorted(wanted_ds - known_ds)
        if unknown:
            raise LamaError(f"unknown dataset(s) {', '.join(unknown)}; choose among {', '.join(DATASETS)}")
        out = [r for r in out if r.dataset.casefold() in wanted_ds]
    if ids is not None:
        wanted = [i.strip() for i in ids if i.strip()]
        by_id = {r.id.casefold(): r for r in out}
        missing = [i for i in wanted if i.casefold() not in by_id]
        if missing:
            raise LamaError(
                f"relation(s) {', '.join(missing)} not found; available: {', '.join(r.id for r in out) or 'none'}"
            )
        keep = {i.casefold() for i in wanted}
        out = [r for r in out if r.id.casefold() in keep]
    return out


def google_re_accepted(judgments: Iterable[dict]) -> bool:
    """LAMA's rule for Google-RE: keep a fact when its "yes" judgments outnumber its "no" ones."""
    yes = no = 0
    for j in judgments:
        verdict = str(j.get("judgment", "")).strip().lower()
        yes += verdict == "yes"
        no += verdict == "no"
    return yes > no


def read_facts(relation: Relation) -> list[Fact]:
    """The facts of one relation file, in file order."""
    path = relation.path
    facts: list[Fact] = []
    for lineno, obj in _iter_jsonl(path):
        uid = str(obj.get("uuid") or obj.get("id") or obj.get("lineid") or f"{relation.id}:{lineno}")
        obj_label = obj.get("obj_label")
        if not isinstance(obj_label, str):
            raise LamaError(f'{path}:{lineno}: expected a string "obj_label"')
        if relation.dataset == SQUAD:
            sentences = obj.get("masked_sentences")
            if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
                raise LamaError(f'{path}:{lineno}: expected "masked_sentences", a list of strings')
            facts.append(Fact(uid, None, obj_label, tuple(sentences)))
            continue
        sub = obj.get("sub_label")
        subject = sub if isinstance(sub, str) else None
        accepted = True
        if relation.dataset == GOOGLE_RE:
            judgments = obj.get("judgments")
            if not isinstance(judgments, list):
                raise LamaError(f'{path}:{lineno}: a Google-RE fact needs its "judgments" list')
            accepted = google_re_accepted(j for j in judgments if isinstance(j, dict))
        facts.append(Fact(uid, subject, obj_label, (), accepted))
    return facts


# ---- vocabulary -------------------------------------------------------------------------------------------


def load_vocab_file(path: Path | str) -> frozenset[str]:
    """A restricted vocabulary (LAMA's common vocabulary): one token per line."""
    p = Path(path)
    try:
        words = frozenset(w.strip() for w in p.read_text(encoding="utf-8").splitlines() if w.strip())
    except OSError as exc:
        raise LamaError(f"{p}: cannot read the vocabulary file ({exc.strerror or exc})") from exc
    if not words:
        raise LamaError(f"{p}: the vocabulary file is empty")
    return words


def is_uncased(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer lowercases its input (bert-base-uncased and the like): `lowercases`."""
    return lowercases(tokenizer)


class ObjectVocabulary:
    """Which gold objects a model can be scored on: one-token words (`WordModel`), optionally within a restricted
    list. The gold id is the word's label, the same id the datastore's labels and the answers use."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, restrict: frozenset[str] | None = None, words: WordModel | None = None
    ):
        self.tokenizer = tokenizer
        self.words = words if words is not None else WordModel(tokenizer)
        self.lowercase = self.words.lowercase
        self.restrict = restrict

    def normalize(self, text: str) -> str:
        return text.lower() if self.lowercase else text

    def wordpiece(self, obj: str) -> tuple[str, int] | None:
        """The object's one-token word as it is written in running text, and its label; None when the object is
        not exactly one token there (or that token is no word: a special token, an unknown token)."""
        text = self.normalize(obj.strip())
        if not text:
            return None
        pieces = self.words.pieces_of(text)
        if len(pieces) != 1 or pieces[0] == self.tokenizer.unk_token_id:
            return None
        label = self.words.token_word(pieces[0])
        return None if label < 0 else (self.words.token_text(label), label)

    def allowed(self, token: str) -> bool:
        return self.restrict is None or token in self.restrict

    def allowed_ids(self) -> np.ndarray | None:
        """Sorted ids of the restricted vocabulary's entries that the model has as one token, words by their
        label (None: unrestricted)."""
        if self.restrict is None:
            return None
        words = sorted({self.normalize(w) for w in self.restrict})
        singles = [p[0] for p in self.words.running_text_ids(words) if len(p) == 1]
        # a word's label; a one-token entry that is no word (LAMA's list has punctuation) stays itself
        ids = sorted({w if w >= 0 else t for t, w in ((t, self.words.token_word(t)) for t in singles)}
                     - self.words.special_ids - {self.tokenizer.unk_token_id})
        if not ids:
            raise LamaError(
                "no token of the restricted vocabulary is in the model's vocabulary; wrong --vocab file?"
            )
        return np.asarray(ids, dtype=np.int64)


# ---- queries ----------------------------------------------------------------------------------------------


def fill_template(template: str, subject: str, *, lowercase: bool) -> str:
    """``[X]`` -> subject, ``[Y]`` -> ``[MASK]``; lowercasing never touches the mask token."""
    check_template(template, where="template")
    head, tail = template.split("[Y]")
    head, tail = head.replace("[X]", subject), tail.replace("[X]", subject)
    if lowercase:
        head, tail = head.lower(), tail.lower()
    return f"{head}{MASK}{tail}"


def cloze_sentence(sentence: str, *, lowercase: bool) -> str | None:
    """A sentence with exactly one mask (any spelling) -> normalised cloze text; None when it has 0 or 2+."""
    parts = MASK_RE.split(sentence)
    if len(parts) != 2:
        return None
    head, tail = parts
    if lowercase:
        head, tail = head.lower(), tail.lower()
    text = f"{head}{MASK}{tail}"
    return text if (head + tail).strip() else None


def split_of(uid: str) -> Literal["dev", "test"]:
    """Deterministic dev/test split of a fact by the sha256 of its id (DEV_PERCENT % dev)."""
    bucket = int(hashlib.sha256(uid.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "dev" if bucket < DEV_PERCENT else "test"


def _question(relation: Relation, fact: Fact, lowercase: bool) -> tuple[str, str] | str:
    """A fact's cloze question and subject (template mode; the fact's own sentence without a template), or why it
    has none (a `FilterStats` field)."""
    if relation.template is None:
        text = cloze_sentence(fact.sentences[0], lowercase=lowercase) if fact.sentences else None
        return (text, "") if text is not None else "bad_mask"
    subject = (fact.subject or "").strip()
    if not subject:
        return "no_subject"
    if MASK_RE.search(subject):
        return "bad_mask"
    return fill_template(relation.template, subject, lowercase=lowercase), subject


def build_queries(
    relation: Relation,
    facts: Iterable[Fact],
    vocab: ObjectVocabulary,
    *,
    limit: int | None = None,
    split: Split = "all",
) -> tuple[list[LamaQuery], FilterStats]:
    """LAMA template-mode queries for one relation, and a count of every fact dropped and why.

    Order of the filters: raters (Google-RE), subject present, single-wordpiece object, restricted vocabulary,
    duplicate (subject, object) pair, ``limit`` (the first N kept facts in file order), then ``split``.
    """
    stats = FilterStats()
    seen: set[tuple[str, int]] = set()
    out: list[LamaQuery] = []
    for fact in facts:
        stats.read += 1
        if not fact.accepted:
            stats.drop("rejected_by_raters")
            continue
        asked = _question(relation, fact, vocab.lowercase)
        if isinstance(asked, str):
            stats.drop(asked)
            continue
        text, subject = asked
        piece = vocab.wordpiece(fact.obj)
        if piece is None:
            stats.drop("not_single_wordpiece")
            continue
        token, token_id = piece
        if not vocab.allowed(token):
            stats.drop("not_in_vocab")
            continue
        if (text, token_id) in seen:
            stats.drop("duplicate")
            continue
        seen.add((text, token_id))
        if limit is not None and len(seen) > limit:
            stats.drop("over_limit")
            continue
        if split != "all" and split_of(fact.uid) != split:
            stats.drop("other_split")
            continue
        out.append(LamaQuery(relation.id, relation.dataset, fact.uid, text, subject or None, token, token_id))
    stats.kept = len(out)
    return out, stats

@dataclass
class Probe:
    """The queries of a whole run, and how each relation's facts were filtered."""

    relations: list[Relation]
    queries: list[LamaQuery] = field(default_factory=list)
    stats: dict[str, FilterStats] = field(default_factory=dict)

    def for_split(self, split: Literal["dev", "test"]) -> list[LamaQuery]:
        return [q for q in self.queries if split_of(q.uid) == split]


def load_probe(
    relations: Sequence[Relation],
    vocab: ObjectVocabulary,
    *,
    limit: int | None = None,
    split: Split = "all",
) -> Probe:
    probe = Probe(list(relations))
    for rel in relations:
        queries, stats = build_queries(rel, read_facts(rel), vocab, limit=limit, split=split)
        probe.queries.extend(queries)
        probe.stats[rel.id] = stats
        logger.info("%s %s: %d queries (%s)", rel.dataset, rel.id, len(queries), json.dumps(stats.as_dict()))
    return probe

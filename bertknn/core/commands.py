"""What each ``bert-knn`` command does, in one line: the list that ``bert-knn --help`` prints, and the line that
each command's own ``--help`` opens with (`bertknn.core.settings_cli.add_command`). Nothing heavy is imported
here, so that ``bert-knn --help`` answers at once."""

from __future__ import annotations

SUMMARIES: dict[str, str] = {
    "build": "build (or resume) a datastore from corpus files (JSONL, MediaWiki XML dumps)",
    "add": "embed new or changed articles into a datastore (live update)",
    "validate": "check a datastore and name the first problem",
    "merge": "join the slices of a sliced build into one datastore",
    "upgrade": "convert a datastore of an older format version to the current one",
    "ivfpq": "add the whole-datastore IVF-PQ index (the no-retrieval ablation)",
    "train-codec": "train a compact codec (--codec int8|pq) once, for the slices of a sliced build",
    "recode": "a compact copy of an fp16 datastore: codes instead of vectors, no model run",
    "calibrate": "measure a datastore's distance scale (temperature auto) and record it",
    "serve": "serve POST /predict over HTTP",
    "eval": "run the LAMA probe (in process, or against a running service)",
    "predict": "ask a running service one question",
}


def command_list() -> str:
    """The commands and their lines, aligned as ``bert-knn --help`` prints them."""
    width = max(map(len, SUMMARIES))
    return "\n".join(f"  {name:<{width}}  {text}" for name, text in SUMMARIES.items())

"""The on-disk datastore format: the contract (`contract`), file I/O (`files`), the reader and `validate`."""

from bertknn.core.errors import DatastoreError
from bertknn.core.format.contract import *  # noqa: F403
from bertknn.core.format.contract import __all__ as _contract_all
from bertknn.core.format.files import (
    atomic_write_bytes,
    atomic_write_json,
    naming_write_errors,
    read_ivfpq_meta,
    read_manifest,
    save_npy,
    write_manifest,
)
from bertknn.core.format.links import EntityLinks
from bertknn.core.format.reader import ContextRef, Datastore, RowSlice, Shard
from bertknn.core.format.table import ArticleEntry
from bertknn.core.format.validate import check_shard_files, validate_datastore, validate_parts
from bertknn.core.hashing import sha256_file

__all__ = [
    *_contract_all,
    "DatastoreError",
    "ArticleEntry",
    "ContextRef",
    "Datastore",
    "EntityLinks",
    "RowSlice",
    "Shard",
    "atomic_write_bytes",
    "atomic_write_json",
    "check_shard_files",
    "naming_write_errors",
    "read_ivfpq_meta",
    "read_manifest",
    "save_npy",
    "sha256_file",
    "validate_datastore",
    "validate_parts",
    "write_manifest",
]

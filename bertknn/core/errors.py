"""The one error tree: every failure the project reports on purpose is a `BertKnnError`, free of HTTP.

The service maps these classes to status codes in one table (`bertknn.service.api.errors`); the command line
prints their message on one line. A message names what went wrong and what to do about it.
"""

from __future__ import annotations

import json
import time


class BertKnnError(Exception):
    """Base of every error this project raises on purpose."""


def json_line_problem(exc: json.JSONDecodeError) -> str:
    """For an error's message: what is wrong with one line of a JSON Lines file and where in it, ``Expecting value
    at column 41`` (the line's characters counted from 1; the exception's own message stops at "at" for some
    problems, and its line and column count the line's newline as a line)."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.pos + 1}"


# ---- the datastore and the model -------------------------------------------------------------------------


class DatastoreError(BertKnnError):
    """A datastore is missing, incomplete or inconsistent; the message names the file and what to do."""


class SparseIndexError(DatastoreError):
    """A BM25 or TF-IDF index is missing, stale or unreadable."""


class MergeError(DatastoreError):
    """Slices that cannot be merged (other model, overlapping articles, missing slice)."""


class ModelLoadError(BertKnnError):
    """The masked LM cannot be loaded, or is not the one a datastore was built with."""


# ---- offline: building --------------------------------------------------------------------------------------


class CorpusError(BertKnnError):
    """A corpus file cannot be read (unknown format, bad JSON line, missing file)."""


class BuildError(BertKnnError):
    """A build cannot start or resume (other settings than the interrupted run, bad output directory)."""


class BuildInterrupted(BuildError):
    """Ctrl-C or SIGTERM stopped a build; the message says what was kept (finished parts stay on disk).
    ``carried``: the contexts embedded past the last whole article, kept aside for the resume."""

    def __init__(self, message: str, carried: int = 0):
        super().__init__(message)
        self.carried = carried


class UpdateError(BuildError):
    """``add`` cannot update this datastore."""


# ---- online: answering --------------------------------------------------------------------------------------


class QueryError(BertKnnError, ValueError):
    """A cloze query the model cannot take (no [MASK], two of them, too long); the message says what to fix."""


class UnknownSubject(BertKnnError, ValueError):
    """A subject that is neither an article nor a linked entity of the datastore (``/follow``)."""


class InvalidRequest(BertKnnError, ValueError):
    """A well-formed request that this server refuses (over a limit, options that contradict each other)."""


class RetrieverUnavailable(BertKnnError):
    """The requested retriever has no index in this datastore; the message says how to build it."""


class AdaptiveRuleError(BertKnnError, ValueError):
    """An adaptive-interpolation rule file that cannot be used."""


class NotReady(BertKnnError):
    """The service is starting, reloading its model or shutting down."""


class ModelUnavailable(NotReady):
    """The model process of the split layout cannot be reached (it is being replaced); retry shortly."""

    retry_after_s = 1


class Overloaded(BertKnnError):
    """The queue in front of the model is full; retry after a short delay."""

    retry_after_s = 1


class ClientOverloaded(Overloaded):
    """One client already has as much work in flight as it may (``limits.max_client_cost``); retry later."""


class DeadlineExceeded(BertKnnError):
    """A request ran past its deadline (the server's ``limits.deadline_ms`` or the request's own, whichever is
    shorter); its queued work is dropped. Retry later, or ask for less (smaller k, fewer queries, fewer hops)."""

    retry_after_s = 1


def check_deadline(deadline: float | None) -> None:
    """Raise `DeadlineExceeded` when ``deadline`` (a `time.monotonic` time; None: none) has passed: called before
    each further forward pass of a request, so the model thread moves on to others' work."""
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlineExceeded("the request ran past its deadline; its remaining work was dropped")


class TooCostly(InvalidRequest):
    """A request whose estimated cost is over one of the server's caps; the message names the cap."""


class ReloadError(BertKnnError):
    """A new datastore version cannot be served; the running version keeps serving."""


class Unauthorized(BertKnnError):
    """An admin request without a valid bearer token."""


class Forbidden(BertKnnError):
    """An admin request that this server does not allow (no admin token configured)."""


class CorruptCacheValue(BertKnnError, ValueError):
    """A cached encoding that cannot be decoded (another version wrote it, or it was cut short)."""


# ---- evaluation ---------------------------------------------------------------------------------------------


class EvaluationError(BertKnnError):
    """An evaluation that cannot run as asked (missing probe files, a datastore without the needed index)."""


class LamaError(EvaluationError):
    """The LAMA probe directory or one of its files cannot be used; the message names the file and what to do."""


class AdminDisabled(Forbidden):
    """Admin endpoints are off on this server (no admin token configured)."""

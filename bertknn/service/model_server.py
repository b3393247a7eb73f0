"""The model process of the split layout (``layout: split``): one process per device runs the forward passes of
every API process, the questions they send at the same time merged into one batch.

Each API process keeps one connection (`bertknn.service.model_client.RemoteEncoder`) and asks for one thing at a
time: a batch's embeddings and p_MLM heads (``heads``), or a whole word's or entity name's extra pass (``encode``,
``log_probs_at``). Each connection's asks are read on a thread of its own; the model runs on the thread that
loaded it (every torch call from one thread), which takes all the ``heads`` asks waiting, up to ``max_rows`` rows,
into one forward pass, and answers each from its rows. The other asks run one at a time between batches.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.libc import name_os_thread
from bertknn.core.query_model import Heads, heads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What an API process needs to tokenise, key and check questions without the weights."""

    name: str  # the name or directory the model was loaded from (its tokenizer is read from there too)
    layer: int
    num_layers: int
    weights_sha256: str
    numerics: str
    backend: str
    vocab_size: int
    hidden_size: int
    max_seq_len: int
    has_mlm: bool
    device: str

    @classmethod
    def of(cls, enc: MaskedLMEncoder) -> ModelInfo:
        return cls(enc.name, enc.layer, enc.num_layers, enc.weights_sha256, enc.numerics, enc.backend,
                   enc.vocab_size, enc.hidden_size, enc.max_seq_len, enc.has_mlm, enc.device.type)  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Peer:
    """One API process's connection: its asks read on a thread of their own, the replies sent under a lock."""

    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.name = name
        self._lock = threading.Lock()

    def reply(self, req_id: int, result: object = None, error: str | None = None) -> None:
        """Send one reply; a peer gone meanwhile (its API process died) is skipped."""
        with self._lock:
            try:
                self.conn.send((req_id, result, error))
            except OSError:
                logger.debug("%s went away before its reply", self.name)

    def close(self) -> None:
        """Hang up: the API process's ask in flight, and its reader here, see the connection end."""
        with suppress(OSError):
            sock = socket.socket(fileno=self.conn.fileno())
            sock.shutdown(socket.SHUT_RDWR)
            sock.detach()


@dataclass
class Ask:
    """One thing an API process asked for: ``kind`` with ``args``, ``rows`` rows of the forward pass."""

    peer: Peer
    req_id: int
    kind: str  # heads, encode or log_probs_at
    args: tuple[Any, ...]
    rows: int


class AskQueue:
    """The asks of every peer; the model thread takes the ``heads`` asks waiting (up to ``max_rows`` rows, of one
    ``n_top``) as one batch, or another ask alone. Batches and other asks take turns when both wait."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._heads: deque[Ask] = deque()
        self._others: deque[Ask] = deque()
        self._cond = threading.Condition()
        self._last_was_other = False
        self.stopping = False

    def put(self, ask: Ask) -> None:
        with self._cond:
            (self._heads if ask.kind == "heads" else self._others).append(ask)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def take(self) -> list[Ask] | None:
        """The next batch of ``heads`` asks, or one other ask; None once stopping."""
        with self._cond:
            while not self._heads and not self._others and not self.stopping:
                self._cond.wait(0.5)
            if self.stopping:
                return None
            if self._others and not (self._heads and self._last_was_other):
                self._last_was_other = True
                return [self._others.popleft()]
            self._last_was_other = False
            batch = [self._heads.popleft()]
            rows, n_top = batch[0].rows, batch[0].args[1]
            while self._heads and rows + self._heads[0].rows <= self.max_rows and self._heads[0].args[1] == n_top:
                ask = self._heads.popleft()
                batch.append(ask)
                rows += ask.rows
            return batch


class ModelServer:
    """Serves one loaded model to the API processes that connect to ``listener`` (`serve`)."""

    def __init__(self, encoder: MaskedLMEncoder, listener: Listener, *, max_rows: int,
                 on_batch: Callable[[int], None] | None = None):  # fmt: skip
        self.encoder = encoder
        self.info = ModelInfo.of(encoder)
        self.listener = listener
        self.queue = AskQueue(max_rows)
        self._on_batch = on_batch
        self._peers: list[Peer] = []

    def serve(self) -> None:
        """Accept connections on a thread and run the model here until `stop`."""
        threading.Thread(target=self._accept, name="accept", daemon=True).start()
        while (asks := self.queue.take()) is not None:
            self._run(asks)

    def stop(self) -> None:
        """No more asks taken; every API process's connection hung up."""
        self.queue.stop()
        for peer in self._peers:
            peer.close()

    def _accept(self) -> None:
        name_os_thread()
        while not self.queue.stopping:
            try:
                conn = self.listener.accept()
            except OSError:  # closed, or a client that failed the handshake (logged by nobody else)
                if self.queue.stopping:
                    return
                logger.warning("a connection to the model process failed its handshake", exc_info=True)
                continue
            peer = Peer(conn, f"api connection {len(self._peers) + 1}")
            self._peers.append(peer)
            threading.Thread(target=self._read, args=(peer,), name=f"api-peer-{len(self._peers)}", daemon=True).start()

    def _read(self, peer: Peer) -> None:
        """One peer's asks into the queue, until it goes away."""
        name_os_thread()
        while True:
            try:
                req_id, kind, args = peer.conn.recv()
            except (EOFError, OSError):
                peer.conn.close()
                return
            if kind == "info":
                peer.reply(req_id, self.info.as_dict())
            elif kind in ("heads", "encode", "log_probs_at"):
                rows = len(args[0])
                self.queue.put(Ask(peer, req_id, kind, tuple(args), rows))
            else:
                peer.reply(req_id, error=f"unknown ask {kind!r}")

    def _run(self, asks: list[Ask]) -> None:
        """One forward pass for the asks; each gets its rows, or the pass's error."""
        try:
            replies: list[object] = list(self._heads(asks)) if asks[0].kind == "heads" else [self._other(asks[0])]
        except Exception as exc:  # every ask of the pass gets the error; the process serves on
            logger.exception("a forward pass of %d asks failed", len(asks))
            for ask in asks:
                ask.peer.reply(ask.req_id, error=f"{type(exc).__name__}: {exc}")
            return
        for ask, result in zip(asks, replies, strict=True):
            ask.peer.reply(ask.req_id, result)

    def _heads(self, asks: list[Ask]) -> list[Heads]:
        inputs = [x for ask in asks for x in ask.args[0]]
        t = time.perf_counter()
        emb, values, ids = heads(self.encoder, inputs, int(asks[0].args[1]))
        logger.debug("a batch of %d rows from %d asks in %.2f ms", len(inputs), len(asks),
                     (time.perf_counter() - t) * 1000)  # fmt: skip
        if self._on_batch is not None:
            self._on_batch(len(inputs))
        out, at = [], 0
        for ask in asks:
            out.append((emb[at : at + ask.rows], values[at : at + ask.rows], ids[at : at + ask.rows]))
            at += ask.rows
        return out

    def _other(self, ask: Ask) -> object:
        if ask.kind == "encode":
            res = self.encoder.encode(ask.args[0], with_mlm=bool(ask.args[1]))
            return res.embeddings, None if res.mlm_log_probs is None else res.mlm_log_probs.numpy()
        return self.encoder.log_probs_at(ask.args[0], ask.args[1]).numpy()

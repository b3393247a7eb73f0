"""An API process's side of the split layout: the model process's model, used as the pipeline uses a loaded one.

`RemoteEncoder` tokenises and keys questions here (the tokenizer is read from the model's directory) and sends
each forward pass to the model process (`bertknn.service.model_server`), one ask at a time. A model process that
went away (killed, out of memory) fails the asks in flight with `ModelUnavailable`; the next ask waits up to
``connect_timeout_s`` for its replacement and goes on with it, provided it is the same model.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client, Connection
from typing import Any

import numpy as np
import torch

from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.core.encoder import EncoderOutput
from bertknn.core.errors import ModelLoadError, ModelUnavailable
from bertknn.core.inputs import MaskedInput
from bertknn.core.model_files import load_tokenizer

ADDRESS_ENV = "BERTKNN_MODEL_ADDRESS"  # the model process's socket, set by the parent for its API processes
AUTHKEY_ENV = "BERTKNN_MODEL_AUTHKEY"  # hex; the connection's handshake proves both sides know it


class RemoteEncoder:
    """A `bertknn.core.query_model.QueryModel` whose forward passes run in the model process at ``address``."""

    def __init__(self, address: str, authkey: bytes, *, connect_timeout_s: float = 10.0, reply_timeout_s: float = 300.0):
        """``connect_timeout_s``: how long an ask waits for a (new) model process to answer the connection;
        ``reply_timeout_s``: for its reply (far longer than any forward pass)."""
        self.address, self._authkey = address, authkey
        self.connect_timeout_s, self.reply_timeout_s = connect_timeout_s, reply_timeout_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._info: dict[str, Any] | None = None
        info = self._call("info", ())
        self._info = info
        self.name: str = info["name"]
        self.layer, self.num_layers = int(info["layer"]), int(info["num_layers"])
        self.weights_sha256: str = info["weights_sha256"]
        self.vocab_size, self.hidden_size = int(info["vocab_size"]), int(info["hidden_size"])
        self.max_seq_len, self.has_mlm = int(info["max_seq_len"]), bool(info["has_mlm"])
        self.device = torch.device(info["device"])
        self.tokenizer = load_tokenizer(self.name)
        self.inputs = ContextTokenizer(self.tokenizer, self.max_seq_len, self.vocab_size)
        self.words = self.inputs.words

    @classmethod
    def from_env(cls) -> RemoteEncoder | None:
        """The model process the parent started for this API process, or None where there is none."""
        address = os.environ.get(ADDRESS_ENV)
        return None if not address else cls(address, bytes.fromhex(os.environ[AUTHKEY_ENV]))

    @property
    def numerics(self) -> str:
        assert self._info is not None
        return str(self._info["numerics"])

    @property
    def backend(self) -> str:
        assert self._info is not None
        return f"{self._info['backend']} in the model process"

    @property
    def heads_on_device(self) -> bool:
        """Always: the model process picks each row's p_MLM entries, so that only they cross to this process."""
        return True

    def query_input(self, text: str) -> MaskedInput:
        return self.inputs.query_input(text)

    def masked_input(self, ids: Sequence[int], mask_pos: int) -> MaskedInput:
        return self.inputs.masked_input(ids, mask_pos)

    # ---- forward passes, in the model process ----------------------------------------------------------------

    def encode_heads(self, items: Sequence[MaskedInput], n_top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """See `MaskedLMEncoder.encode_heads`: the same entries, picked in the model process."""
        emb, values, ids = self._call("heads", (list(items), n_top))
        return emb, values, ids

    def encode(self, items: Sequence[MaskedInput], *, with_mlm: bool = False) -> EncoderOutput:
        """See `MaskedLMEncoder.encode` (a whole word's fill pass): the full p_MLM rows come back."""
        emb, log_p = self._call("encode", (list(items), with_mlm))
        return EncoderOutput(emb, None if log_p is None else torch.from_numpy(log_p))

    def log_probs_at(self, sequences: Sequence[Sequence[int]], reads: Sequence[tuple[int, int]]) -> torch.Tensor:
        """See `MaskedLMEncoder.log_probs_at`."""
        return torch.from_numpy(self._call("log_probs_at", ([list(s) for s in sequences], list(reads))))

    # ---- the connection ----------------------------------------------------------------------------------------

    def _call(self, kind: str, args: tuple[Any, ...]) -> Any:
        """One ask and its reply (one at a time: an API process asks from its model thread)."""
        with self._lock:
            conn = self._connected()
            req_id = next(self._ids)
            try:
                conn.send((req_id, kind, args))
                got, result, error = self._reply(conn)
                while got != req_id:  # (a reply to an ask whose caller gave up)
                    got, result, error = self._reply(conn)
            except (EOFError, OSError) as exc:
                self._drop()
                raise ModelUnavailable("the model process went away while answering; a new one is starting: "
                                       "retry shortly") from exc  # fmt: skip
        if error is not None:
            raise RuntimeError(f"the model process failed this forward pass: {error}")
        return result

    def _reply(self, conn: Connection) -> tuple[int, Any, str | None]:
        """The next reply; `TimeoutError` (an `OSError`: the connection is dropped) when none comes within
        ``reply_timeout_s``: a model process that hangs is treated as one that went away."""
        if not conn.poll(self.reply_timeout_s):
            raise TimeoutError(f"no reply from the model process in {self.reply_timeout_s:.0f} s")
        got: tuple[int, Any, str | None] = conn.recv()
        return got

    def _connected(self) -> Connection:
        """The open connection, or a new one to the model process (waiting for it to start, up to the timeout).
        Between asks nothing is due to arrive: a connection with something to read was hung up by a model process
        that went away while this one had no ask in flight, and that must not fail the next ask."""
        if self._conn is not None:
            try:
                if not self._conn.poll(0):
                    return self._conn
            except (EOFError, OSError):
                pass
            self._drop()
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                conn = Client(self.address, family="AF_UNIX", authkey=self._authkey)
                break
            except (OSError, EOFError) as exc:
                if time.monotonic() >= deadline:
                    raise ModelUnavailable(f"the model process does not answer at {self.address} ({exc}); it is "
                                           "being started: retry shortly") from exc  # fmt: skip
                time.sleep(0.05)
        if self._info is not None:
            self._check_same_model(conn, self._info)
        self._conn = conn
        return conn

    @staticmethod
    def _check_same_model(conn: Connection, was: dict[str, Any]) -> None:
        """A replacement model process must serve the model this process keyed its cache and datastore by."""
        conn.send((-1, "info", ()))
        _, info, _ = conn.recv()
        for key in ("weights_sha256", "numerics", "layer", "vocab_size", "hidden_size"):
            if info[key] != was[key]:
                conn.close()
                raise ModelLoadError(f"the model process now serves another model ({key} {info[key]!r}, not "
                                     f"{was[key]!r}); restart the service")  # fmt: skip

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()

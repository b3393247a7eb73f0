"""The split layout's model process and its client: one forward pass for the asks of several API processes, the
same numbers as the model run in the asking process, and a client that outlives its model process."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

import numpy as np
import pytest

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import ModelLoadError, ModelUnavailable
from bertknn.core.topk import top_set
from bertknn.service.model_client import RemoteEncoder
from bertknn.service.model_server import Ask, AskQueue, ModelInfo, Peer
from tests.conftest import TINY_ARTICLES, corpus_words, make_tiny_bert
from tests.support.split import KEY, serving

QUESTIONS = ["zorblat was born in [MASK] .", "quimby is a [MASK] .", "[MASK] wrote many songs about rivers ."]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> MaskedLMEncoder:
    return MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)


def hang_up_on_first_ask(address: str, info: dict, hang_s: float = 0.0) -> None:
    """A model process that answers who it is, then dies with the first forward pass asked of it (after
    ``hang_s`` without a word)."""
    with Listener(address, family="AF_UNIX", authkey=KEY) as listener, listener.accept() as conn:
        while True:
            req_id, kind, _ = conn.recv()
            if kind != "info":
                time.sleep(hang_s)
                return
            conn.send((req_id, info, None))


def ask(kind: str, rows: int, n_top: int = 8) -> Ask:
    return Ask(Peer(None, "test"), 0, kind, ([None] * rows, n_top), rows)  # type: ignore[arg-type]


def test_the_queue_merges_waiting_batches_up_to_the_row_cap_and_takes_turns_with_other_asks():
    queue = AskQueue(max_rows=10)
    a, b, c, fill, d = ask("heads", 4), ask("heads", 5), ask("heads", 3), ask("log_probs_at", 1), ask("heads", 2, 16)
    for x in (a, b, c, fill, d):
        queue.put(x)
    assert queue.take() == [fill]  # another ask first, then batches and others take turns
    assert queue.take() == [a, b]  # 9 rows: c's 3 would pass the cap
    assert queue.take() == [c]  # d keeps fewer entries of p_MLM: a pass of its own
    assert queue.take() == [d]
    queue.stop()
    assert queue.take() is None


def test_remote_heads_fill_passes_and_info_are_the_local_model_s(encoder: MaskedLMEncoder, tmp_path: Path):
    inputs = [encoder.query_input(q) for q in QUESTIONS]
    with serving(encoder, str(tmp_path / "m.sock")):
        remote = RemoteEncoder(str(tmp_path / "m.sock"), KEY)
        assert (remote.weights_sha256, remote.numerics, remote.layer) == (
            encoder.weights_sha256, encoder.numerics, encoder.layer)  # fmt: skip
        assert [remote.query_input(q) for q in QUESTIONS] == inputs  # tokenised here, as the model process would
        emb, values, ids = remote.encode_heads(inputs, 16)
        local = encoder.encode(inputs, with_mlm=True)
        assert local.mlm_log_probs is not None
        np.testing.assert_array_equal(emb, local.embeddings)
        for j, row in enumerate(local.mlm_log_probs.numpy()):
            want_values, want_ids = top_set(row, 16)
            np.testing.assert_array_equal(ids[j], want_ids)
            np.testing.assert_array_equal(values[j], want_values)
        fill = remote.encode(inputs[:2], with_mlm=True)
        assert fill.mlm_log_probs is not None
        np.testing.assert_array_equal(fill.mlm_log_probs.numpy(), local.mlm_log_probs.numpy()[:2])
        seqs, reads = [list(x.input_ids) for x in inputs], [(0, inputs[0].mask_pos), (2, 1)]
        np.testing.assert_array_equal(remote.log_probs_at(seqs, reads).numpy(),
                                      encoder.log_probs_at(seqs, reads).numpy())  # fmt: skip
        remote.close()


def test_the_batches_of_several_api_processes_run_as_one_forward_pass(encoder: MaskedLMEncoder, tmp_path: Path):
    address = str(tmp_path / "m.sock")
    with serving(encoder, address) as rows:
        clients = [RemoteEncoder(address, KEY) for _ in range(6)]
        inputs = [encoder.query_input(q) for q in QUESTIONS]
        gate = threading.Barrier(len(clients))
        got: dict[int, np.ndarray] = {}

        def mine(i: int) -> list:  # each client its own order: a pass that mixed up rows would show
            return inputs[i % 3 :] + inputs[: i % 3]

        def run(i: int) -> None:
            gate.wait()
            for _ in range(20):
                got[i] = clients[i].encode_heads(mine(i), 16)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sum(rows) == 6 * 20 * 3  # every row, once
    assert max(rows) > 3  # at least one pass held the rows of several clients' asks
    for i, emb in got.items():
        np.testing.assert_allclose(emb, encoder.encode(mine(i)).embeddings, rtol=1e-5, atol=1e-5)


def test_a_client_waits_for_the_replacement_of_its_model_process_and_refuses_another_model(
    encoder: MaskedLMEncoder, tmp_path: Path
):
    address = str(tmp_path / "m.sock")
    inputs = [encoder.query_input(QUESTIONS[0])]
    with serving(encoder, address):
        remote = RemoteEncoder(address, KEY, connect_timeout_s=0.5)
        before = remote.encode_heads(inputs, 8)[0]
    # gone while idle: the next ask is not failed by the dead connection, it looks for a new model process
    with pytest.raises(ModelUnavailable, match="does not answer"):  # nobody at the address within the timeout
        remote.encode_heads(inputs, 8)
    dying = threading.Thread(target=hang_up_on_first_ask, args=(address, ModelInfo.of(encoder).as_dict()))
    dying.start()
    with pytest.raises(ModelUnavailable, match="went away while answering"):  # gone with the ask in flight
        remote.encode_heads(inputs, 8)
    dying.join(5)
    Path(address).unlink(missing_ok=True)
    hung = threading.Thread(target=hang_up_on_first_ask, args=(address, ModelInfo.of(encoder).as_dict(), 2.0))
    hung.start()
    remote.reply_timeout_s = 0.3
    t = time.monotonic()
    with pytest.raises(ModelUnavailable, match="went away while answering"):  # hung: given up on, as gone
        remote.encode_heads(inputs, 8)
    assert time.monotonic() - t < 1.5
    hung.join(5)
    remote.reply_timeout_s = 300.0
    Path(address).unlink(missing_ok=True)
    with serving(encoder, address):  # the replacement: the same model, so the client goes on
        np.testing.assert_array_equal(remote.encode_heads(inputs, 8)[0], before)
    Path(address).unlink(missing_ok=True)
    other = MaskedLMEncoder.load(str(make_tiny_bert(tmp_path / "other", corpus_words(TINY_ARTICLES), seed=7)),
                                 device="cpu", dtype="float32", max_seq_len=32)  # fmt: skip
    with serving(other, address), pytest.raises(ModelLoadError, match="another model"):
        remote.encode_heads(inputs, 8)

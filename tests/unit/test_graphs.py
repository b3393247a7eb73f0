"""The service's forward as CUDA graphs (`bertknn.core.graphs`), everything but the device: the host-sync check
that decides whether a forward can be captured, the 4D mask that makes it capturable, and the buckets' padding,
reuse, check and fallback, with a capture that records nothing and replays by running the forward again."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.graphs import GraphedForward, Outputs, capturable, host_syncs
from tests.support.families import make_family_model

TEXTS = ["the cat sat on the mat .", "paris is the capital of france .", "a dog ran to the park and back ."] * 20


def replaying_capture(calls: list[int], *, broken: bool = False, noise: float = 0.0) -> Callable:
    """A stand-in for `cuda_capture` on the CPU: the static outputs are refreshed by running the forward again on
    the static inputs at each replay, which is what a replayed graph computes."""

    def capture(run: Callable[[], Outputs], pool: object) -> tuple[Outputs, Callable[[], None], object]:
        calls.append(1)
        if broken:
            raise RuntimeError("operation not permitted when stream is capturing")
        outputs = tuple(o.clone() for o in run())

        def replay() -> None:
            for static, new in zip(outputs, run(), strict=True):
                static.copy_(new + noise)

        return outputs, replay, pool

    return capture


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> MaskedLMEncoder:
    return MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)


def questions(enc: MaskedLMEncoder, n: int, words: int) -> list:
    mask = enc.tokenizer.mask_token
    return [enc.query_input(" ".join(["the"] * (words + i % 3) + [mask, "."])) for i in range(n)]


def test_host_syncs_finds_reads_of_device_values_and_nothing_else():
    x = torch.arange(6.0)
    assert host_syncs(lambda t: (t * 2).softmax(0), x) == []
    assert host_syncs(lambda t: bool((t > 2).all()), x)  # what Hugging Face's mask check does
    assert host_syncs(lambda t: t.sum().item(), x)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "xlm-roberta", "deberta-v2", "modernbert"])
def test_each_family_forward_is_made_capturable_with_the_same_outputs(tmp_path: Path, family: str):
    """Every family's service forward either runs with no host sync as it is, or takes the 4D mask with the same
    outputs on a padded batch; where neither holds, `capturable` says None (eager)."""
    model = make_family_model(tmp_path / family, family, TEXTS, vocab_size=300)
    enc = MaskedLMEncoder.load(str(model), device="cpu", dtype="float32", max_seq_len=32)
    batch = enc.eager.tensors(questions(enc, 3, 4))
    core = enc.eager.cores[True]
    found = capturable(core, batch, 1e-4)
    assert found is not None, f"{family}: no capturable forward"
    assert host_syncs(found, *batch) == []
    for got, want in zip(found(*batch), core(*batch), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_2d_mask_forward_syncs_so_the_4d_one_is_taken(encoder: MaskedLMEncoder):
    """With this transformers the 2D mask is looked at on the host (`padding_mask.all()`): the flag is what makes
    BERT capturable, so removing it from the cores fails here."""
    batch = encoder.eager.tensors(questions(encoder, 2, 3))
    core = encoder.eager.cores[True]
    found = capturable(core, batch, 1e-4)
    assert found is not None
    if host_syncs(core, *batch):
        assert found is not core and found.mask_4d and not core.mask_4d


def graphed(encoder: MaskedLMEncoder, capture: Callable, max_rows: int = 8) -> GraphedForward:
    batch = encoder.eager.tensors(questions(encoder, 2, 3))
    core = capturable(encoder.eager.cores[True], batch, 1e-4)
    assert core is not None
    return GraphedForward(core, pad_id=encoder.tokenizer.pad_token_id, device=torch.device("cpu"), max_rows=max_rows,
                          max_width=32, tol=1e-4, capture=capture)  # fmt: skip


@pytest.mark.parametrize(("rows", "words"), [(1, 2), (3, 5), (5, 9), (8, 14)])
def test_padded_buckets_give_the_eager_outputs(encoder: MaskedLMEncoder, rows: int, words: int):
    calls: list[int] = []
    g = graphed(encoder, replaying_capture(calls))
    batch = encoder.eager.tensors(questions(encoder, rows, words))
    want = encoder.eager.cores[True](*batch)
    for _ in range(2):  # the capture's first output, then a replay
        got = g(*batch)
        assert got is not None
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert len(calls) == 1


def test_one_capture_per_bucket_and_eager_beyond_the_largest(encoder: MaskedLMEncoder):
    calls: list[int] = []
    g = graphed(encoder, replaying_capture(calls), max_rows=8)
    assert g.bucket_of(3, 9) == (4, 16) and g.bucket_of(1, 16) == (1, 16) and g.bucket_of(8, 17) == (8, 32)
    for rows, words in [(3, 2), (4, 3), (3, 4), (2, 2)]:  # (4, 16) three times, then (2, 16)
        assert g(*encoder.eager.tensors(questions(encoder, rows, words))) is not None
    assert len(calls) == 2 and set(g.buckets) == {(4, 16), (2, 16)}
    assert g(*encoder.eager.tensors(questions(encoder, 9, 2))) is None  # more rows than any bucket
    ids, attn, rows_t, pos = encoder.eager.tensors(questions(encoder, 2, 2))
    assert g(ids, attn, torch.tensor([0, 0, 1]), torch.tensor([1, 2, 1])) is None  # several reads of one row


def test_a_failed_capture_leaves_the_bucket_eager_and_the_answers_right(encoder: MaskedLMEncoder, caplog):
    calls: list[int] = []
    g = graphed(encoder, replaying_capture(calls, broken=True))
    encoder.eager.graphs = g
    try:
        items = questions(encoder, 2, 3)
        with caplog.at_level(logging.WARNING, logger="bertknn.core.graphs"):
            emb, log_p = encoder.eager.run(items, with_mlm=True)
            encoder.eager.run(items, with_mlm=True)
        assert len(calls) == 1 and "not captured" in caplog.text  # tried once, then left eager
        want = encoder.eager.cores[True](*encoder.eager.tensors(items))
        torch.testing.assert_close(emb, want[0])
        assert log_p is not None
        torch.testing.assert_close(log_p, want[1])
    finally:
        encoder.eager.graphs = None


def test_a_replay_that_differs_from_the_eager_forward_is_not_used(encoder: MaskedLMEncoder, caplog):
    calls: list[int] = []
    g = graphed(encoder, replaying_capture(calls, noise=0.5))
    batch = encoder.eager.tensors(questions(encoder, 2, 3))
    with caplog.at_level(logging.WARNING, logger="bertknn.core.graphs"):
        assert g(*batch) is None
        assert g(*batch) is None
    assert len(calls) == 1 and "differs" in caplog.text


def test_the_service_forward_goes_through_the_graphs(encoder: MaskedLMEncoder):
    """`use_graphs` puts them on the p_MLM forward (the service's); the embeddings-only forward (the builder's) and
    every answer stay as they were."""
    items = questions(encoder, 3, 4)
    before = encoder.encode(items, with_mlm=True)
    calls: list[int] = []
    assert encoder.eager.use_graphs(encoder.query_input, encoder.tokenizer.mask_token, max_rows=4, max_width=32,
                                    capture=replaying_capture(calls))  # fmt: skip
    try:
        # every row bucket of short and medium questions captured by use_graphs itself, before any request
        warmed = {(r, w) for r in (1, 2, 4) for w in (16, 32)}
        assert len(calls) == 6 and encoder.eager.graphs is not None and set(encoder.eager.graphs.buckets) == warmed
        bucket, replays = encoder.eager.graphs.buckets[(4, 16)], []
        replay = bucket.replay
        assert replay is not None
        bucket.replay = lambda: (replays.append(1), replay())[1]
        after = encoder.encode(items, with_mlm=True)
        encoder.encode(items)  # embeddings only: not graphed
        assert replays == [1] and len(calls) == 6  # this batch's bucket replayed, nothing captured on the way
        torch.testing.assert_close(torch.from_numpy(after.embeddings), torch.from_numpy(before.embeddings), rtol=1e-4, atol=1e-4)
        assert after.mlm_log_probs is not None and before.mlm_log_probs is not None
        torch.testing.assert_close(after.mlm_log_probs, before.mlm_log_probs, rtol=1e-4, atol=1e-4)
    finally:
        encoder.eager.graphs = None

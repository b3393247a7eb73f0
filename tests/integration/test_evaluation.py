"""The LAMA evaluation CLI end to end: a tiny LAMA directory, the tiny BERT, a datastore built by the real builder.

The tiny corpus states made-up facts ("Zorblat was born in quimby"), so only the datastore can know them: kNN
must find them and the (random) tiny MLM must not.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bertknn.evaluation.__main__ import main
from tests.support.processes import service_process

RELATIONS = [
    {"relation": "P19", "template": "[X] was born in [Y] .", "label": "place of birth"},
    {"relation": "P1303", "template": "[X] plays [Y] .", "label": "instrument"},
]

# P19: three facts stated only in the tiny corpus, a duplicate pair, and two objects that are not one wordpiece.
TREX_P19 = [
    {"uuid": "u1", "sub_label": "Zorblat", "obj_label": "Quimby", "predicate_id": "P19", "evidences": []},
    {"uuid": "u2", "sub_label": "Frelle Dax", "obj_label": "vostok", "predicate_id": "P19", "evidences": []},
    {"uuid": "u3", "sub_label": "Émile Grusk", "obj_label": "plonk", "predicate_id": "P19", "evidences": []},
    {"uuid": "u4", "sub_label": "Zorblat", "obj_label": "quimby", "predicate_id": "P19", "evidences": []},
    {
        "uuid": "u5",
        "sub_label": "Zorblat",
        "obj_label": "Quimby Town",
        "predicate_id": "P19",
        "evidences": [],
    },
    {"uuid": "u6", "sub_label": "Zorblat", "obj_label": "Atlantis", "predicate_id": "P19", "evidences": []},
]
# Fact-only file for a relation without an evidence file.
FACTS_P1303 = [{"uuid": "i1", "sub_label": "Émile Grusk", "obj_label": "trumpet"}]
GOOGLE_RE = [
    {"uuid": "g1", "sub_label": "Zorblat", "obj_label": "quimby", "judgments": [{"judgment": "yes"}] * 3},
    {"uuid": "g2", "sub_label": "Frelle Dax", "obj_label": "plonk", "judgments": [{"judgment": "no"}] * 2},
]
SQUAD = [
    {
        "masked_sentences": ["Many poets live in [MASK] ."],
        "obj_label": "quimby",
        "id": "s1",
        "sub_label": "Squad",
    }
]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def tiny_lama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lama")
    _jsonl(root / "relations.jsonl", RELATIONS)
    _jsonl(root / "TREx" / "P19.jsonl", TREX_P19)
    _jsonl(root / "TREx_facts_all41" / "P1303.jsonl", FACTS_P1303)
    _jsonl(root / "Google_RE" / "place_of_birth_test.jsonl", GOOGLE_RE)
    _jsonl(root / "Squad" / "test.jsonl", SQUAD)
    return root


def _run(*args: object) -> int:
    return main(["lama", *map(str, args), "--device", "cpu", "--quiet"])


@pytest.fixture(scope="module")
def report(tiny_lama: Path, tiny_datastore: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("report") / "report.json"
    preds = out.with_name("predictions.jsonl")
    # Subject queries search the subject's own article alone (the service's rule); the random tiny model's [MASK]
    # vectors depend mostly on the mask's position, and within that article the stored sentence is the nearest.
    rc = _run("--data", tiny_lama, "--datastore", tiny_datastore, "--out", out, "--predictions", preds)
    assert rc == 0
    body = json.loads(out.read_text())
    body["_predictions"] = [json.loads(line) for line in preds.read_text().splitlines()]
    return body


def test_report_structure_and_counts(report):
    assert list(report)[:4] == ["macro", "datasets", "relations", "settings"]
    for block in [report["macro"], *(report["datasets"][d] for d in report["datasets"])]:
        for col in ("mlm", "knn", "bert_knn"):
            assert set(block[col]) == {"p@1", "p@5", "p@10"}
            assert all(0.0 <= v <= 100.0 for v in block[col].values())
    assert list(report["datasets"]) == ["Google-RE", "T-REx", "SQuAD"]
    rels = report["relations"]
    assert {r: (v["dataset"], v["facts"]) for r, v in rels.items()} == {
        "place_of_birth": ("Google-RE", 1),  # g2 rejected by its raters
        "P19": ("T-REx", 3),  # duplicate pair and two non-wordpiece objects dropped
        "P1303": ("T-REx", 1),  # from the fact-only directory
        "squad": ("SQuAD", 1),
    }
    # every subject but SQuAD's has its article in the tiny datastore, which is then the one searched
    # (SQuAD's facts name none: no count)
    assert {r: v.get("subjects_found") for r, v in rels.items()} == {
        "place_of_birth": 1, "P19": 3, "P1303": 1, "squad": None,
    }  # fmt: skip
    assert {d: v.get("subjects_found") for d, v in report["datasets"].items()} == {
        "Google-RE": 1, "T-REx": 4, "SQuAD": None,
    }  # fmt: skip
    s = report["settings"]
    assert s["filters"]["P19"]["duplicate"] == 1 and s["filters"]["P19"]["not_single_wordpiece"] == 2
    assert s["filters"]["place_of_birth"]["rejected_by_raters"] == 1
    assert s["retriever"] == "bm25" and s["num_articles"] == 3 and s["k"] == 128 and s["lambda"] == 0.3
    assert s["vocab"] is None and s["lowercase"] is True and s["split"] == "all" and s["queries"] == 6
    assert s["model"]["layer"] == 1 and s["mode"] == "in-process"
    assert "mean over all relations of all datasets" in s["averages"]
    # overall macro = mean over the 4 relations, not over the 3 datasets
    for col in ("mlm", "knn", "bert_knn"):
        mean = sum(r[col]["p@1"] for r in rels.values()) / len(rels)
        assert report["macro"][col]["p@1"] == pytest.approx(mean, abs=0.01)


def test_a_fact_only_in_the_datastore_is_found_by_knn_not_by_the_mlm(report):
    p19 = report["relations"]["P19"]
    assert p19["knn"]["p@1"] == 100.0
    assert p19["mlm"]["p@1"] == 0.0
    assert p19["bert_knn"]["p@1"] == 100.0
    assert report["relations"]["place_of_birth"]["knn"]["p@1"] == 100.0
    zorblat = next(p for p in report["_predictions"] if p["uid"] == "u1")
    assert zorblat["text"] == "zorblat was born in [MASK] ." and zorblat["subject"] == "Zorblat"
    assert zorblat["gold"] == "quimby" and zorblat["rank"]["knn"] == 1 and zorblat["top1"]["knn"] == "quimby"
    assert zorblat["top1"]["mlm"] != "quimby"


def test_no_retrieval_searches_the_whole_datastore(
    tiny_lama, tiny_datastore, tiny_datastore_ivfpq, tmp_path, capsys
):
    assert _run("--data", tiny_lama, "--datastore", tiny_datastore, "--no-retrieval") == 1
    assert "bert-knn ivfpq" in capsys.readouterr().err  # says how to add the index
    out = tmp_path / "none.json"
    assert _run("--data", tiny_lama, "--datastore", tiny_datastore_ivfpq, "--no-retrieval", "--out", out) == 0
    body = json.loads(out.read_text())
    assert body["settings"]["retriever"] == "none" and body["settings"]["num_articles"] is None
    assert body["relations"]["P19"]["knn"]["p@10"] > 0


def test_relations_limit_and_vocabulary_restriction(tiny_lama, tiny_datastore, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("quimby\nplonk\ntrumpet\nriver\n")
    out = tmp_path / "r.json"
    rc = _run(
        "--data", tiny_lama, "--datastore", tiny_datastore, "--relations", "P19,P1303", "--limit", "2",
        "--vocab", vocab, "--out", out,
    )  # fmt: skip
    assert rc == 0
    body = json.loads(out.read_text())
    assert set(body["relations"]) == {"P19", "P1303"} and list(body["datasets"]) == ["T-REx"]
    # vostok (u2) is outside the vocabulary and dropped before the limit: the first 2 kept are quimby and plonk
    assert body["relations"]["P19"]["facts"] == 2
    assert body["settings"]["filters"]["P19"]["not_in_vocab"] == 1
    assert body["settings"]["filters"]["P19"]["over_limit"] == 0
    assert (
        body["settings"]["vocab"]["tokens"] == 4 and "common vocabulary" in body["settings"]["vocab"]["note"]
    )
    assert body["relations"]["P19"]["knn"]["p@10"] == 100.0  # 4 allowed tokens: every rank is <= 4


def test_grid_search_prints_the_best_setting_and_evaluates_the_rest(
    tiny_lama, tiny_datastore, tmp_path, capsys
):
    root = _many_facts_lama(tiny_lama, tmp_path / "lama")  # both splits populated
    out = tmp_path / "grid.json"
    assert (
        _run("--data", root, "--datastore", tiny_datastore, "--relations", "P19", "--grid", "--out", out) == 0
    )
    printed = capsys.readouterr().out
    assert "grid search on the dev split" in printed and "best: N=" in printed
    body = json.loads(out.read_text())
    grid = body["settings"]["grid"]
    assert grid["points"] == 5 * 7 * 3 * 8 and grid["dev_queries"] > 0
    best = grid["best"]
    assert best["num_articles"] in range(1, 6) and 0.2 <= best["lambda"] <= 0.8
    assert best["k"] in (64, 128, 512) and 5 <= best["temperature"] <= 12
    s = body["settings"]
    assert s["split"] == "test" and s["queries"] + grid["dev_queries"] == 30
    assert (s["num_articles"], s["lambda"], s["k"], s["temperature"]) == (
        best["num_articles"], best["lambda"], best["k"], best["temperature"],
    )  # fmt: skip


def test_layer_ablation_checks_the_datastore_and_builds_one_from_a_corpus(
    tiny_lama, tiny_datastore, tiny_model_dir, tiny_corpus, tmp_path, capsys
):
    assert (
        _run("--data", tiny_lama, "--datastore", tiny_datastore, "--relations", "P19", "--layer", "-2") == 0
    )
    assert _run("--data", tiny_lama, "--datastore", tiny_datastore, "--relations", "P19", "--layer", "0") == 1
    err = capsys.readouterr().err
    assert "built at layer 1" in err and "--layer 0" in err
    out, ds0 = tmp_path / "l0.json", tmp_path / "ds-layer0"
    rc = _run(
        "--data", tiny_lama, "--datastore", ds0, "--relations", "P19", "--layer", "0", "--corpus", tiny_corpus,
        "--model", tiny_model_dir, "--out", out,
    )  # fmt: skip
    assert rc == 0
    body = json.loads(out.read_text())
    assert body["settings"]["model"]["layer"] == 0 and body["relations"]["P19"]["facts"] == 3


def test_bad_arguments_fail_with_a_message(tiny_lama, tiny_datastore, tmp_path, capsys):
    assert _run("--data", tiny_lama, "--datastore", tiny_datastore, "--relations", "P999") == 1
    assert "P999 not found" in capsys.readouterr().err
    assert _run("--data", tmp_path / "nowhere", "--datastore", tiny_datastore) == 1
    assert "no such directory" in capsys.readouterr().err
    assert _run("--data", tiny_lama) == 1
    assert "--datastore" in capsys.readouterr().err


def test_http_mode_gives_the_in_process_numbers(tiny_lama, tiny_datastore, tiny_model_dir, report, tmp_path):
    with service_process(tiny_datastore, env={"BERTKNN_MODEL__DEVICE": "cpu"}) as svc:
        out = tmp_path / "http.json"
        assert _run("--data", tiny_lama, "--url", svc.url, "--model", tiny_model_dir, "--out", out) == 0
        body = json.loads(out.read_text())
        assert body["settings"]["mode"] == "http"
        for part in ("datasets", "relations"):
            want = {k: {c: v.get(c) for c in ("mlm", "knn", "bert_knn", "subjects_found")} for k, v in report[part].items()}
            got = {k: {c: v.get(c) for c in ("mlm", "knn", "bert_knn", "subjects_found")} for k, v in body[part].items()}
            assert got == want, part
        assert body["macro"] == report["macro"]


def _many_facts_lama(tiny_lama: Path, root: Path) -> Path:
    """Every subject of the tiny corpus with every place (30 facts), so both splits are populated."""
    shutil.copytree(tiny_lama, root)
    subjects = ["Zorblat", "Frelle Dax", "Émile Grusk", "Quimby", "Plonk", "Vostok"]
    facts = [
        {"uuid": f"g{i}-{j}", "sub_label": s, "obj_label": o}
        for i, s in enumerate(subjects)
        for j, o in enumerate(["quimby", "plonk", "vostok", "bridge", "market"])
    ]
    _jsonl(root / "TREx" / "P19.jsonl", facts)
    return root


def test_adaptive_rule_is_fitted_on_dev_and_reported_against_fixed_on_test(
    tiny_lama, tiny_datastore, tmp_path, capsys
):
    from bertknn.service.interpolate import AdaptiveRule
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    root = _many_facts_lama(tiny_lama, tmp_path / "lama")
    out, rule_path, preds = tmp_path / "adaptive.json", tmp_path / "rule.json", tmp_path / "preds.jsonl"
    rc = _run(
        "--data", root, "--datastore", tiny_datastore, "--relations", "P19,squad", "--adaptive", "--adaptive-out",
        rule_path, "--out", out, "--predictions", preds,
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "adaptive rule fit on the dev split" in printed and "adaptive P@1/5/10" in printed
    assert "kNN skipped for" in printed
    body = json.loads(out.read_text())
    s, a = body["settings"], body["settings"]["adaptive"]
    assert s["split"] == "test" and s["queries"] + a["fit"]["dev_queries"] == 31
    for block in (body["macro"], body["datasets"]["T-REx"], body["relations"]["P19"]):
        assert set(block["bert_knn_adaptive"]) == {"p@1", "p@5", "p@10"}
    assert a["fit"]["rules"] == 3 * 11 * 5 * 5 * 10  # the run's lambda 0.3 is already a base lambda
    # the search contains the fixed interpolation, so on dev the fitted rule is at least as good
    assert a["fit"]["dev_macro_adaptive"]["p@1"] >= a["fit"]["dev_macro_fixed"]["p@1"]
    assert 0.0 <= a["knn_skipped"] <= 1.0
    rule = AdaptiveRule.load(rule_path)
    assert rule.model_dump() == a["rule"]
    assert rule.fitted is not None and rule.fitted["dev_queries"] == a["fit"]["dev_queries"]
    assert rule.fitted["setting"]["k"] == 128 and rule.fitted["datastore_id"] == s["datastore"]["id"]

    # Another rule from a file, with a threshold that makes some queries skip kNN: the column is what the
    # service answers in adaptive mode with that rule, query by query.
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    try:
        rows = [json.loads(line) for line in preds.read_text().splitlines()]
        encs, _ = pipe.queries.encode([pipe.check_query(Query(r["text"])) for r in rows])
        tops = sorted(float(e.top_probs.max()) for e in encs)
        skipping = rule.model_copy(update={"skip_threshold": tops[len(tops) // 2], "fitted": None})
        skipping.save(rule_path)
        out2 = tmp_path / "from-file.json"
        assert _run("--data", root, "--datastore", tiny_datastore, "--relations", "P19,squad", "--adaptive-rule",
                    rule_path, "--out", out2, "--predictions", preds) == 0  # fmt: skip
        body2 = json.loads(out2.read_text())
        assert body2["settings"]["split"] == "all" and body2["settings"]["adaptive"]["source"] == str(rule_path)
        assert 0.0 < body2["settings"]["adaptive"]["knn_skipped"] < 1.0
        rows = [json.loads(line) for line in preds.read_text().splitlines()]
        answers = pipe.predict_batch(
            [Query(r["text"], subject=r["subject"], interpolation="adaptive", rule=skipping) for r in rows],
            with_distributions=True,
        )
        tok = pipe.encoder.tokenizer
        for row, ans in zip(rows, answers, strict=True):
            assert row["adaptive"]["knn_skipped"] == ans.knn_skipped, row["text"]
            assert row["adaptive"]["lambda"] == pytest.approx(ans.lambda_used), row["text"]
            d = ans.distributions
            assert d is not None
            gold = tok.convert_tokens_to_ids(row["gold"])
            want = None if d.p[gold] <= 0 else int((d.p > d.p[gold]).sum() + (d.p[:gold] == d.p[gold]).sum() + 1)
            assert row["rank"]["bert_knn_adaptive"] == want, row["text"]
    finally:
        pipe.close()


def test_adaptive_options_fail_with_a_message(tiny_lama, tiny_datastore, tmp_path, capsys):
    assert _run("--data", tiny_lama, "--datastore", tiny_datastore, "--adaptive-out", tmp_path / "r.json") == 1
    assert "add --adaptive" in capsys.readouterr().err
    assert _run("--data", tiny_lama, "--url", "http://127.0.0.1:9", "--adaptive") == 1
    assert "drop --url" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"skip_threshold": 3}')
    assert _run("--data", tiny_lama, "--datastore", tiny_datastore, "--adaptive-rule", bad) == 1
    err = capsys.readouterr().err
    assert "skip_threshold" in err and "Traceback" not in err

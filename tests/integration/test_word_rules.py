"""Languages whose words carry combining marks (Hindi) and whose i has two case pairs (Turkish), end to end: a
corpus written here, built by a tiny XLM-R-style model whose tokenizer is trained on it, then its stored sentences,
TF-IDF retrieval, entity links and subject lookup checked (docs/languages.md: words, title case, links)."""

from __future__ import annotations

import json
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from bertknn.builder.build import build
from bertknn.builder.settings import BuildSettings
from bertknn.core.format import TFIDF_DIR
from bertknn.core.format.reader import Datastore
from bertknn.service.retrieval.sparse import TfidfRetriever
from bertknn.service.retrieval.subject import SubjectResolver
from tests.support.families import make_family_model, train_tokenizer

HINDI = {
    "दिल्ली": ["दिल्ली भारत की राजधानी है।", "यह यमुना नदी के किनारे बसा हुआ एक बड़ा शहर है।",
               "दिल्ली में लाल किला और कुतुब मीनार प्रसिद्ध हैं।"],
    "मुंबई": ["मुंबई महाराष्ट्र राज्य की राजधानी है।", "यह भारत का सबसे बड़ा बंदरगाह शहर है।",
              "मुंबई में हिंदी फिल्म उद्योग का केंद्र है।"],
    "गंगा": ["गंगा भारत की सबसे पवित्र नदी मानी जाती है।", "यह हिमालय के गंगोत्री हिमनद से निकलती है।",
             "गंगा बंगाल की खाड़ी में गिरती है।"],
    "महात्मा गांधी": ["महात्मा गांधी का जन्म पोरबंदर में हुआ था।", "उन्होंने भारत के स्वतंत्रता आंदोलन का नेतृत्व किया।",
                      "गांधी अहिंसा के सिद्धांत के लिए जाने जाते हैं।"],
}  # fmt: skip

TURKISH = {
    "İstanbul": "'''İstanbul''', [[Türkiye]]'nin en kalabalık şehridir ve birçok [[ilçe]]ye ayrılır. Şehir "
                "[[Boğaziçi]] kıyısında kurulmuştur ve tarihi yarımadası ünlüdür.",
    "Türkiye": "'''Türkiye''' bir ülkedir ve başkenti [[Ankara]] şehridir. En büyük şehri ise [[istanbul]] olarak "
               "bilinir ve nüfusu çok kalabalıktır.",
    "Işık": "'''Işık''' gözle görülebilen elektromanyetik ışınımdır ve boşlukta çok hızlı yayılır. Güneş ışığı "
            "dünyaya yaklaşık sekiz dakikada ulaşır.",
    "İlçe": "'''İlçe''' Türkiye'de illerin yönetim birimlerinden biridir ve her ilçenin bir kaymakamı vardır. "
            "Büyük şehirlerde ilçeler belediyelerle yönetilir.",
}  # fmt: skip


def _model(directory: Path, texts: list[str]) -> Path:
    tokenizer = train_tokenizer("xlm-roberta", texts, vocab_size=600)
    return make_family_model(directory, "xlm-roberta", texts, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def hindi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("hindi")
    corpus = work / "hiwiki.jsonl"
    corpus.write_text("".join(json.dumps({"title": t, "text": " ".join(s)}, ensure_ascii=False) + "\n"
                              for t, s in HINDI.items()), encoding="utf-8")  # fmt: skip
    model = _model(work / "model", [" ".join(s) for s in HINDI.values()])
    build(BuildSettings(corpus=[corpus], model=str(model), out=work / "ds", language="hi", bm25=False))
    return work / "ds"


@pytest.fixture(scope="module")
def turkish(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("turkish")
    pages = "".join(
        f"<page><title>{escape(t)}</title><ns>0</ns><id>{i}</id><revision><id>{i}0</id>"
        f'<text xml:space="preserve">{escape(text)}</text></revision></page>\n'
        for i, (t, text) in enumerate(TURKISH.items(), 1)
    )
    dump = work / "trwiki-test-pages-articles.xml"
    dump.write_text('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="tr">\n'
                    f"<siteinfo><sitename>Vikipedi</sitename></siteinfo>\n{pages}</mediawiki>\n", encoding="utf-8")
    model = _model(work / "model", list(TURKISH.values()))
    build(BuildSettings(corpus=[dump], model=str(model), out=work / "ds", bm25=False))  # the dump says "tr"
    return work / "ds"


def test_every_hindi_sentence_is_stored_and_tfidf_finds_its_article(hindi: Path) -> None:
    """Each sentence has at least four words (a vowel sign or virama is part of its word), so none is a fragment;
    a question cut from one finds its article by TF-IDF on its whole words."""
    ds = Datastore(hindi)
    assert ds.manifest.language == "hi"
    stored = [ds.articles[t] for t in HINDI]
    assert [a.sent_end - a.sent_start for a in stored] == [len(s) for s in HINDI.values()]
    tfidf = TfidfRetriever(hindi / TFIDF_DIR)
    for title, question in [("दिल्ली", "यह यमुना [MASK] के किनारे बसा हुआ शहर है।"),
                            ("गंगा", "गंगा [MASK] की खाड़ी में गिरती है।"),
                            ("महात्मा गांधी", "गांधी [MASK] के सिद्धांत के लिए जाने जाते हैं।")]:  # fmt: skip
        assert tfidf.top_articles(question, 1)[0][0] == title


def test_a_turkish_link_or_subject_written_with_i_names_the_dotted_i_article(turkish: Path) -> None:
    """[[istanbul]] links to İstanbul (MediaWiki's Turkish ucfirst), and a subject "istanbul" is that article by
    the exact rule; TF-IDF lower-cases Işık to ışık, so a question in lower case finds it."""
    ds = Datastore(turkish)
    assert ds.manifest.language == "tr"
    ref = ds.links.entity("İstanbul")
    assert ref is not None and ref.title == "İstanbul"
    assert ds.links.entity("Istanbul") is None
    found = SubjectResolver(ds).resolve_with_rule("istanbul")
    assert found is not None and (found.title, found.rule) == ("İstanbul", "exact")
    tfidf = TfidfRetriever(turkish / TFIDF_DIR)
    assert tfidf.top_articles("ışık boşlukta çok [MASK] yayılır", 1)[0][0] == "Işık"

"""Corpus readers (JSONL, MediaWiki XML) and the sentence splitter, on files the tests write."""

from __future__ import annotations

import bz2
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import pytest

from bertknn.builder.corpus import (
    CorpusStats,
    detect_format,
    read_corpora,
    read_jsonl,
    read_mediawiki_xml,
)
from bertknn.builder.sentences import SentenceSplitter
from bertknn.builder.wikitext import wikitext_to_text
from bertknn.core.errors import CorpusError

NS = "http://www.mediawiki.org/xml/export-0.11/"


def page(title: str, text: str, *, ns: int = 0, page_id: int = 1, redirect: str | None = None) -> str:
    redirect_el = f"<redirect title={quoteattr(redirect)} />" if redirect else ""
    return (
        f"<page><title>{escape(title)}</title><ns>{ns}</ns><id>{page_id}</id>{redirect_el}"
        f"<revision><id>{page_id * 10}</id><model>wikitext</model><format>text/x-wiki</format>"
        f'<text bytes="{len(text)}" xml:space="preserve">{escape(text)}</text></revision></page>\n'
    )


def dump(pages: list[str], *, tail: str = "</mediawiki>\n", lang: str = "en") -> str:
    return (
        f'<mediawiki xmlns="{NS}" version="0.11" xml:lang="{lang}">\n'
        "<siteinfo><sitename>Wikipedia</sitename><dbname>enwiki</dbname></siteinfo>\n" + "".join(pages) + tail
    )


ALBERT = """{{Short description|Physicist}}
{{Infobox scientist|name=Albert|birth_place=[[Ulm]]}}
'''Albert Einstein''' was a [[physicist]] born in [[Ulm|the city of Ulm]].<ref>{{cite web|title=Bio}}</ref> He developed
the theory of [[relativity]].
[[File:Einstein 1921.jpg|thumb|200px|Einstein in [[Bern]], 1921]]
== Life ==
He worked at the [[University of Zurich]] in [[1909]].
{| class="wikitable"
|-
! Year !! Event
|-
| 1905 || Annus mirabilis papers
|}
[[Category:Physicists]]
[[de:Albert Einstein]]
"""

PAGES = [
    page("Albert_Einstein", ALBERT, page_id=1),
    page("Einstein", "#REDIRECT [[Albert Einstein]]", page_id=2, redirect="Albert Einstein"),
    page("A. Einstein", "#redirect [[albert Einstein#Life]]", page_id=3),  # redirect given by the text only
    page("Mercury", "'''Mercury''' may refer to:\n* [[Mercury (planet)]]\n{{disambiguation}}", page_id=4),
    page("Paris (disambiguation)", "'''Paris''' may mean a city.", page_id=5),
    page("List of physicists", "This is a list of physicists.", page_id=6),
    page("Wikipedia:About", "Project page text.", ns=4, page_id=7),
    page("ulm", "'''Ulm''' is a city in [[Germany]] on the [[Danube]]. It has a tall church.", page_id=8),
]


@pytest.fixture(params=["xml", "xml.bz2", "xml.gz"])
def xml_dump(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    data = dump(PAGES).encode("utf-8")
    path = tmp_path / f"enwiki-test-pages-articles.{request.param}"
    compressors: dict[str, Callable[[bytes], bytes]] = {"xml": bytes, "xml.bz2": bz2.compress, "xml.gz": gzip.compress}
    path.write_bytes(compressors[request.param](data))
    return path


def test_xml_dump_is_read_plain_and_compressed(xml_dump: Path) -> None:
    stats = CorpusStats()
    articles = list(read_mediawiki_xml(xml_dump, stats))
    assert [(a.id, a.title) for a in articles] == [("1", "Albert Einstein"), ("8", "Ulm")]
    assert all(a.source == str(xml_dump) for a in articles)
    assert detect_format(xml_dump) == "mediawiki-xml"
    # Redirects are recorded (normalised, section dropped) and not yielded.
    assert stats.redirects == {"Einstein": "Albert Einstein", "A. Einstein": "Albert Einstein"}
    # The disambiguation page (template), the "(disambiguation)" title and the list page are skipped.
    assert stats.skipped_pages == 3


def test_xml_markup_is_stripped(xml_dump: Path) -> None:
    article = next(iter(read_mediawiki_xml(xml_dump, CorpusStats())))
    # The reader keeps the wikitext; conversion happens when the text is used (in the shard's worker).
    assert article.markup == "wikitext" and "[[physicist]]" in article.raw
    text = article.text
    assert "Albert Einstein was a physicist born in the city of Ulm." in text
    assert "He worked at the University of Zurich in 1909." in text
    for residue in ("[[", "]]", "{{", "}}", "'''", "<ref", "cite web", "Infobox", "thumb", "Category:", "de:Albert",
                    "Annus mirabilis", "Life\n", "==", "|"):
        assert residue not in text, residue


def test_wikitext_keeps_visible_link_text_including_titles_with_colons() -> None:
    text = wikitext_to_text("He saw [[Star Wars: Episode IV|the film]] and [[Alien: Covenant]] in [[:Category:Films|films]].")
    assert text == "He saw the film and Alien: Covenant in films."


def test_xml_is_streamed_page_by_page(tmp_path: Path) -> None:
    """The first page comes out before the reader reaches the (cut) end of the file; the cut page is not read,
    and the end is a one-line warning, not an error (a truncated download keeps its whole pages)."""
    path = tmp_path / "broken.xml"
    path.write_text(dump(PAGES[:1], tail="<page><title>Cut</ti"), encoding="utf-8")
    stats = CorpusStats()
    pages = read_mediawiki_xml(path, stats)
    assert next(pages).title == "Albert Einstein" and not stats.warnings
    assert list(pages) == []
    assert len(stats.warnings) == 1 and "broken.xml: the dump ends inside a page" in stats.warnings[0]
    assert "kept its 1 whole pages" in stats.warnings[0]


def test_jsonl_titles_are_normalised_and_blank_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "wiki.jsonl"
    rows = [{"id": "7", "title": "albert_einstein", "text": "A physicist."}, {"title": "Ulm", "text": "A city."}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n", encoding="utf-8")
    articles = list(read_jsonl(path))
    assert [(a.id, a.title, a.text) for a in articles] == [("7", "Albert einstein", "A physicist."), ("3", "Ulm", "A city.")]


def test_jsonl_bz2_is_read(tmp_path: Path) -> None:
    path = tmp_path / "wiki.jsonl.bz2"
    with bz2.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"id": "1", "title": "Ulm", "text": "A city."}) + "\n")
    assert [a.title for a in read_corpora([path], CorpusStats())] == ["Ulm"]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (b'{"id": "2", "title": "Broken", "text": ', r"not valid JSON \(Expecting value at column 41\)"),
        (b'{"id": "2", "title": "Tab\tin a string", "text": "x"}', r"not valid JSON \(Invalid control character at column 26\)"),
        (b'{"id": "2", "text": "no title"}', 'string "title" and "text"'),
        (b'["a", "list"]', 'string "title" and "text"'),
        (b'{"id": "2", "title": "  _ ", "text": "x"}', "empty title"),
        (b'{"id": "2", "title": "Caf\xe9", "text": "latin-1"}', "not valid UTF-8"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, bad_line: bytes, message: str) -> None:
    path = tmp_path / "wiki.jsonl"
    good = json.dumps({"id": "1", "title": "Ulm", "text": "A city."}).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + bad_line + b"\n")
    with pytest.raises(CorpusError, match=rf"wiki\.jsonl:3: .*{message}"):
        list(read_jsonl(path))


def test_unknown_format_and_missing_file_are_named(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(CorpusError, match=r"notes\.txt: unknown corpus format"):
        list(read_corpora([notes], CorpusStats()))
    with pytest.raises(CorpusError, match=r"absent\.jsonl: no such corpus file"):
        list(read_corpora([tmp_path / "absent.jsonl"], CorpusStats()))


def test_sentence_splitter_keeps_abbreviations_decimals_and_initials_together() -> None:
    text = (
        "Dr. Smith moved to the U.S. in 1990. He paid 3.5 million dollars for a house. "
        "J. R. R. Tolkien visited Mr. Jones, e.g. in St. Louis.\n\nA new paragraph starts here."
    )
    assert SentenceSplitter().split(text) == [
        "Dr. Smith moved to the U.S. in 1990.",
        "He paid 3.5 million dollars for a house.",
        "J. R. R. Tolkien visited Mr. Jones, e.g. in St. Louis.",
        "A new paragraph starts here.",
    ]


def test_sentence_splitter_splits_plain_sentences_and_ignores_blank_lines() -> None:
    assert SentenceSplitter().split("One sentence. Two sentences? Three!\n \n") == [
        "One sentence.",
        "Two sentences?",
        "Three!",
    ]


TURKISH = [
    page("İstanbul", "'''İstanbul''', [[Türkiye]]'nin en kalabalık şehridir ve [[ilçe]]leri vardır.\n\n== Kaynakça ==\n"
         "* Bir kaynak kitabı ve sayfaları burada.", page_id=1),
    page("Konstantinopolis", "#yönlendirme [[istanbul]]", page_id=2),  # a redirect told by its text alone
    page("Ankara (anlam ayrımı)", "'''Ankara''' şunlardan biri olabilir.", page_id=3),
    page("Yüzey", "'''Yüzey''' birden fazla anlama gelir.\n{{Anlam ayrımı}}", page_id=4),
    page("Türkiye'deki illerin listesi", "Bu liste Türkiye'deki illeri sayar.", page_id=5),
]


def test_a_turkish_dump_upper_cases_i_to_dotted_i_and_reads_its_own_magic_words(tmp_path: Path) -> None:
    """Turkish writes I/ı and İ/i as case pairs: a link or redirect to ``istanbul`` names the article İstanbul, as
    MediaWiki's LanguageTr::ucfirst makes it (Python's upper() gives Istanbul, no such page)."""
    path = tmp_path / "trwiki-test-pages-articles.xml"
    path.write_text(dump(TURKISH, lang="tr"), encoding="utf-8")
    stats = CorpusStats()
    (article,) = read_mediawiki_xml(path, stats)
    assert article.title == "İstanbul" and article.site.language == "tr"
    assert stats.redirects == {"Konstantinopolis": "İstanbul"}  # "#yönlendirme", not only "#YÖNLENDİRME"
    assert stats.skipped_pages == 3  # "(anlam ayrımı)", {{Anlam ayrımı}}, "... listesi"
    text, links = article.text_links()
    assert "Kaynakça" not in text and "kaynak kitabı" not in text  # the back matter goes
    # "[[ilçe]]leri": the link trail (Turkish letters after ]]) is part of the link's text, as MediaWiki shows it
    assert [(text[k.start : k.end], k.target) for k in links] == [("Türkiye", "Türkiye"), ("ilçeleri", "İlçe")]

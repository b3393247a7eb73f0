"""Language rules between a dump and a stored context: the dump's own site (namespaces, case, language), page
kinds, sentences, fragments, stopwords, title folding, TF-IDF terms, script warnings; read from the real
Japanese, Ukrainian and Vietnamese dumps in ../shared/data/wiki-i18n where a dump says it (Thai from written text)."""

from __future__ import annotations

import bz2
import dataclasses
import json
import logging
import lzma
import re
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from bertknn.builder.build import build
from bertknn.builder.corpus import CorpusStats, corpus_language, page_kind, read_corpora, read_siteinfo
from bertknn.builder.sentences import SentenceSplitter, UnicodeSentences
from bertknn.builder.settings import BuildSettings
from bertknn.builder.site import ENGLISH, Site
from bertknn.builder.targets import load_stopwords
from bertknn.builder.wikitext import link_target, sentence_problem, wikitext_links
from bertknn.core.errors import BuildError, CorpusError, ModelLoadError, SparseIndexError
from bertknn.core.format.sparse import NgramHasher
from bertknn.core.languages import (
    _BREAKERS,
    UNSPACED_CLASS,
    check_language,
    has_unspaced,
    is_unspaced_char,
    known_languages,
    rules_for,
    script,
    script_warning,
    scripts,
    unknown_language,
    unspaced_share,
    word_boundaries,
    word_breaker,
)
from bertknn.core.titles import fold_title, normalize_title

DUMPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "wiki-i18n"


def dump(language: str) -> Path:
    return DUMPS / f"{language}wiki-truncated-100k.xml.xz"


@pytest.fixture(scope="module")
def ja_site() -> Site:
    return read_siteinfo(dump("ja"))


# ---- the site a dump names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("language", ["ja", "uk", "vi"])
def test_a_dump_names_its_language_case_and_namespaces(language: str) -> None:
    site = read_siteinfo(dump(language))
    assert site.language == language and site.case == "first-letter"
    assert site.namespaces[6] and site.namespaces[14]  # the localised File: and Category:
    assert site.namespaces[6].casefold() in site.hidden_prefixes
    assert site.namespaces[10].casefold() in site.other_prefixes  # Template:


def test_language_given_must_agree_with_the_dump() -> None:
    with pytest.raises(CorpusError, match="the dump is in 'ja'.*--language says 'de'"):
        read_siteinfo(dump("ja"), "de")
    assert read_siteinfo(dump("ja"), "JA").language == "ja"


def test_corpus_files_in_two_languages_make_no_datastore(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"title": "Paris", "text": "Paris is a city in France."}) + "\n")
    assert corpus_language([jsonl]) == "en" and corpus_language([jsonl], "de") == "de"
    with pytest.raises(CorpusError, match="different languages"):
        corpus_language([dump("ja"), jsonl])


def test_language_codes_are_checked() -> None:
    assert check_language("pt_BR") == "pt-br" and rules_for("pt-br").code == "pt-br"
    assert rules_for("pt-br").redirect == rules_for("pt").redirect  # the base language's rules
    assert not rules_for("xx").known and rules_for("xx").sentences is None
    with pytest.raises(ValueError, match="Wikipedia language code"):
        check_language("Japanese!")


@pytest.mark.parametrize(("given", "meant"), [("jp", "ja"), ("JPN", "ja"), ("ua", "uk"), ("vn", "vi"), ("cn", "zh")])
def test_a_country_code_for_a_language_is_refused_with_the_right_one(tmp_path: Path, given: str, meant: str) -> None:
    with pytest.raises(ValidationError, match=rf"'{given}' is not a Wikipedia language code; .* is '{meant}'"):
        BuildSettings(corpus=[tmp_path / "c.jsonl"], model="m", out=tmp_path / "ds", language=given)
    assert BuildSettings(corpus=[tmp_path / "c.jsonl"], model="m", out=tmp_path / "ds", language=meant).language == meant
    assert check_language(given) == given.lower()  # (a datastore's manifest is read as it is)


def test_a_language_nothing_here_knows_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert unknown_language("ja", SentenceSplitter("ja").rule, load_stopwords(None, "ja")) is None
    assert unknown_language("hy", "pysbd:hy", frozenset()) is None  # pysbd splits it
    assert unknown_language("xx", "unicode", frozenset({"own"})) is None  # a stopword file was given
    line = unknown_language("sco", SentenceSplitter("sco").rule, load_stopwords(None, "sco"))
    assert line is not None and line.startswith("language 'sco' has no rules here: no stopword list")
    corpus = tmp_path / "sco.jsonl"
    corpus.write_text(json.dumps({"title": "Embra", "text": "Embra is the caipital o Scotland."}) + "\n")
    settings = BuildSettings(corpus=[corpus], model=str(tmp_path / "no-such-model"), out=tmp_path / "ds",
                             device="cpu", language="sco")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="bertknn.builder.build"), pytest.raises(ModelLoadError):
        build(settings)
    assert [r.getMessage() for r in caplog.records if r.name == "bertknn.builder.build"] == [line]  # before the model

# ---- a truncated dump ---------------------------------------------------------------------------------------------


def test_the_truncated_japanese_dump_reads_its_whole_pages_and_says_where_it_stopped() -> None:
    stats = CorpusStats()
    titles = [a.title for a in read_corpora([dump("ja")], stats)]
    assert len(stats.warnings) == 1 and "ends inside a page" in stats.warnings[0]
    assert "kept its 238 whole pages" in stats.warnings[0]  # what `grep -c '</page>'` counts in the dump
    assert len(titles) == len(set(titles)) > 150
    assert not any(t.startswith(("Wikipedia:", "Help:", "Template:", "ファイル:", "Category:")) for t in titles)
    assert stats.redirects and stats.skipped_pages > 0


def test_a_truncated_compressed_dump_keeps_the_pages_before_the_cut(tmp_path: Path) -> None:
    xml = lzma.decompress(dump("uk").read_bytes())
    cut = xml[: xml.index(b"</page>", len(xml) // 3) + 2000]  # inside the page after a whole one
    whole = cut.count(b"</page>")
    path = tmp_path / "ukwiki.xml.bz2"
    path.write_bytes(bz2.compress(cut)[:-30])  # the compressed stream is cut too
    stats = CorpusStats()
    articles = list(read_corpora([path], stats))
    assert articles and len(stats.warnings) == 1 and "ends inside a page" in stats.warnings[0]
    kept = int(re.search(r"kept its ([\d,]+) whole pages", stats.warnings[0]).group(1).replace(",", ""))  # type: ignore[union-attr]
    # bz2 decodes whole blocks: the pages of the cut block are lost with it, none half-read is kept
    assert 0 < kept <= whole and len(articles) <= kept


def test_xml_broken_in_the_middle_is_still_an_error(tmp_path: Path) -> None:
    xml = lzma.decompress(dump("vi").read_bytes())
    at = xml.index(b"<page>", len(xml) // 2)
    path = tmp_path / "vi.xml"
    path.write_bytes(xml[:at] + b"<page><title>x</title></oops>" + xml[at:])
    with pytest.raises(CorpusError, match="malformed XML"):
        list(read_corpora([path], CorpusStats()))


# ---- page kinds, namespaces, sections -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("language", "title", "wikitext", "kind"),
    [
        ("ja", "東京", "#転送 [[東京都]]", "redirect"),
        ("de", "Berlin", "#WEITERLEITUNG [[Berlin (Stadt)]]", "redirect"),
        ("uk", "Київ", "#перенаправлення [[Київ (місто)]]", "redirect"),
        ("en", "Paris", "#REDIRECT [[Paris, France]]", "redirect"),
        ("ja", "メルクリウス", "'''メルクリウス'''\n{{aimai}}", "disambiguation"),
        ("de", "Merkur", "'''Merkur''' steht für:\n{{Begriffsklärung}}", "disambiguation"),
        ("vi", "Sao Thủy (định hướng)", "Sao Thủy có thể là", "disambiguation"),
        ("ja", "日本の都市の一覧", "本文", "list"),
        ("uk", "Список міст України", "Текст", "list"),
        ("de", "Liste der Städte in Deutschland", "Text", "list"),
        ("ja", "東京", "'''東京'''は日本の首都である。{{aimai2}}", None),
        ("en", "Mercury", "{{disambiguation needed}} Mercury is a planet.", None),
    ],
)
def test_page_kinds_in_any_language(language: str, title: str, wikitext: str, kind: str | None) -> None:
    assert page_kind(title, wikitext, Site(rules_for(language))) == kind


def test_localised_file_and_category_links_render_nothing(ja_site: Site) -> None:
    wikitext = (
        "'''東京'''は[[日本]]の首都である。[[ファイル:Tokyo.jpg|thumb|right|300px|[[新宿]]の夜景]]"
        "[[画像:Old.png|サムネイル|古い地図]]\n[[カテゴリ:日本の都市]][[Category:首都]]\n"
        "== 脚注 ==\n参考になる[[文献]]がある。\n== 関連項目 ==\n* [[大阪]]\n"
    )
    text, links = wikitext_links(wikitext, ja_site)
    assert text == "東京は日本の首都である。"
    assert [ln.target for ln in links] == ["日本"]
    assert link_target("ファイル:Tokyo.jpg", ja_site) == "" and link_target("東京", ja_site) == "東京"
    german = Site(rules_for("de"), namespaces={6: "Datei", 14: "Kategorie"})
    assert link_target("Kategorie:Stadt", german) == "" and link_target("Bild:X.jpg", german) == ""
    text, _ = wikitext_links("Berlin ist eine Stadt.[[Datei:B.jpg|mini|Das Tor]]\n== Einzelnachweise ==\nQuelle.", german)
    assert text == "Berlin ist eine Stadt."


def test_titles_keep_the_dump_s_case_rule() -> None:
    assert normalize_title("über_uns") == "Über uns"
    assert normalize_title("über_uns", "case-sensitive") == "über uns"


# ---- sentences, fragments, stopwords ------------------------------------------------------------------------------


def test_sentences_per_language() -> None:
    assert SentenceSplitter("ja").split("東京は日本の首都である。大阪は「天下の台所」と呼ばれた。") == [
        "東京は日本の首都である。", "大阪は「天下の台所」と呼ばれた。",
    ]  # fmt: skip
    uk = SentenceSplitter("uk")
    assert uk.rule == "unicode"
    assert uk.split("Населення у 2021 р. становило 2,9 млн осіб. Київ — столиця.") == [
        "Населення у 2021 р. становило 2,9 млн осіб.", "Київ — столиця.",
    ]  # fmt: skip
    assert SentenceSplitter("vi").split("TP. Hồ Chí Minh là thành phố lớn nhất. Hà Nội là thủ đô.") == [
        "TP. Hồ Chí Minh là thành phố lớn nhất.", "Hà Nội là thủ đô.",
    ]  # fmt: skip
    assert SentenceSplitter("de").split("Er kam am 3. Oktober z. B. mit dem Zug. Dann ging er.") == [
        "Er kam am 3. Oktober z. B. mit dem Zug.", "Dann ging er.",
    ]  # fmt: skip
    # languages the data does not name: their own sentence marks end a sentence (Khmer, Burmese, Amharic)
    for code, text in [
        ("km", "ភ្នំពេញជារាជធានីនៃប្រទេសកម្ពុជា។ ទីក្រុងនេះមានប្រជាជនច្រើន។"),
        ("my", "ရန်ကုန်သည် မြို့ကြီးဖြစ်သည်။နေပြည်တော်သည် မြို့တော်ဖြစ်သည်။"),
        ("am", "አዲስ አበባ የኢትዮጵያ ዋና ከተማ ናት። ከተማዋ ትልቅ ናት።"),
    ]:
        splitter = SentenceSplitter(code)
        assert splitter.rule == "unicode"
        halves = splitter.split(text)
        assert len(halves) == 2 and "".join(halves).replace(" ", "") == text.replace(" ", ""), (code, halves)


THAI = (
    "ทักษิณ ชินวัตร เกิดที่จังหวัดเชียงใหม่ เป็นนายกรัฐมนตรีคนที่ 23 ของประเทศไทย "
    "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย ตั้งอยู่ริมแม่น้ำเจ้าพระยา\n"
    "มีประชากรประมาณ 8 ล้านคน กรุงเทพฯ ก่อตั้งเมื่อ พ.ศ. 2325 โดยรัชกาลที่ 1"
)


def test_thai_sentences_end_at_a_space_but_not_inside_a_name_or_a_date() -> None:
    """Thai writes a space between sentences, and also between a name and a surname, around numbers and after an
    abbreviation: the CRF segmenter tells them apart, and an abbreviation keeps the year it dates."""
    th = SentenceSplitter("th")
    assert th.rule == "pythainlp:crfcut"
    got = th.split(THAI)
    assert got[0] == "ทักษิณ ชินวัตร เกิดที่จังหวัดเชียงใหม่ เป็นนายกรัฐมนตรีคนที่ 23 ของประเทศไทย"
    assert "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย" in got
    assert any("พ.ศ. 2325" in s for s in got), got  # not "... พ.ศ." and "2325"
    assert "".join(got).replace(" ", "") == THAI.replace(" ", "").replace("\n", "")  # nothing lost
    assert all(sentence_problem(s) is None for s in got), got


def test_thai_without_its_segmenter_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pythainlp.tokenize", None)  # as if not installed
    with pytest.raises(BuildError, match=r"pip install 'bert-knn\[thai\]'"):
        SentenceSplitter("th")
    corpus = tmp_path / "th.jsonl"
    corpus.write_text(json.dumps({"title": "กรุงเทพมหานคร", "text": THAI}, ensure_ascii=False) + "\n")
    settings = BuildSettings(corpus=[corpus], model=str(tmp_path / "no-such-model"), out=tmp_path / "ds",
                             device="cpu", language="th")  # fmt: skip
    with pytest.raises(BuildError, match="PyThaiNLP"):  # not an error about the model
        build(settings)
    assert not (tmp_path / "ds").exists()


def test_fragments_count_letters_in_unspaced_scripts() -> None:
    assert sentence_problem("東京は日本の首都である。") is None
    assert sentence_problem("東京都。") == "fragment"
    assert sentence_problem("Paris is the capital of France.") is None
    assert sentence_problem("See the list.") == "fragment"
    assert sentence_problem("Tokyo.jpg|thumb|right|A view at night with many lights") == "markup"


def test_stopwords_per_language() -> None:
    assert {"は", "の", "を"} <= load_stopwords(None, "ja")
    assert {"в", "у", "і", "на", "та"} <= load_stopwords(None, "uk")
    assert {"của", "và", "là"} <= load_stopwords(None, "vi")
    assert "the" in load_stopwords(None, "en") and "der" not in load_stopwords(None, "en")
    assert load_stopwords(None, "xx") == frozenset()


# ---- folding, terms, scripts, words -------------------------------------------------------------------------------


def test_folding_keeps_letters_that_differ() -> None:
    assert fold_title("Émile Zola") == fold_title("emile zola")
    assert fold_title("が") != fold_title("か") and fold_title("й") != fold_title("и")
    assert fold_title("ガ") == fold_title("ｶﾞ")  # compatibility forms still fold (NFKC)


def test_tfidf_terms_per_language() -> None:
    ja = NgramHasher.for_language("ja", frozenset({"は"}), fold_accents=False)
    assert ja.terms("東京は日本") == ["東京", "京は", "は日", "日本"]
    assert NgramHasher.from_params(ja.to_params(), Path("x")) == ja
    vi = NgramHasher.for_language("vi", frozenset(), fold_accents=False)
    assert vi.terms("Hà Nội") == ["hà", "nội"]
    assert NgramHasher(frozenset()).terms("Émile Zola") == ["emile", "zola"]  # English as before


# Hindi, Bengali, Tamil and Persian: words whose vowel signs, viramas and non-joiners are combining marks or
# joiners, which Python's re leaves out of \w
HINDI = "महात्मा गांधी का जन्म पोरबंदर में हुआ था।"
TAMIL = "தமிழ் ஒரு திராவிட மொழி ஆகும். இது இந்தியாவில் பேசப்படுகிறது."


def test_a_word_keeps_its_combining_marks_and_joiners_in_tfidf_terms() -> None:
    hi = NgramHasher.for_language("hi", frozenset(), fold_accents=False)
    assert hi.terms(HINDI) == ["महात्मा", "गांधी", "का", "जन्म", "पोरबंदर", "में", "हुआ", "था", "।"]
    assert hi.terms("রবীন্দ্রনাথ ঠাকুর") == ["রবীন্দ্রনাথ", "ঠাকুর"]
    assert hi.terms("می\u200cخواهم") == ["می\u200cخواهم"]  # the zero-width non-joiner is inside the word
    greek = hi.terms("15 Μαΐου")  # casefold gives ι and two marks: one word, as the lower-case word gives it
    assert len(greek) == 2 and greek == hi.terms("15 μαΐου")
    assert NgramHasher.from_params(hi.to_params(), Path("x")) == hi


def test_dotted_and_dotless_i_in_tfidf_terms() -> None:
    de = NgramHasher.for_language("de", frozenset(), fold_accents=False)
    assert de.terms("İzmir und Izmir") == ["izmir", "und", "izmir"]  # not "i", a lone dot and "zmir"
    tr = NgramHasher.for_language("tr", frozenset(), rules_for("tr").fold_accents, rules_for("tr").dotted_i)
    assert tr.terms("İstanbul istanbul Işık ışık") == ["istanbul", "istanbul", "ışık", "ışık"]  # Turkish case pairs
    assert NgramHasher.from_params(tr.to_params(), Path("x")) == tr


def test_an_index_built_with_the_earlier_word_rule_is_read_with_it() -> None:
    """A non-English index written before marks counted as word characters records the earlier pattern: its
    queries are cut as its documents were, and an index of neither pattern is refused."""
    hi = NgramHasher.for_language("hi", frozenset(), fold_accents=False)
    params = hi.to_params()
    # what params.json recorded before (the pattern compiled with Python's re)
    earlier = f"[{UNSPACED_CLASS}]+|(?:(?![{UNSPACED_CLASS}])\\w)+|[^\\w\\s]; character bigrams of unspaced-script runs"
    tr_fold = NgramHasher.for_language("tr", frozenset(), False, dotted_i=True).fold  # only with the new words
    old = NgramHasher.from_params({**params, "token_pattern": earlier}, Path("x"))
    assert old.terms("जन्म İzmir") == ["जन", "्", "म", "i", "\u0307", "zmir"]
    with pytest.raises(SparseIndexError, match="another tokenisation"):
        NgramHasher.from_params({**params, "token_pattern": earlier, "fold": tr_fold}, Path("x"))
    with pytest.raises(SparseIndexError, match="another tokenisation"):
        NgramHasher.from_params({**params, "token_pattern": earlier + "; words: letters"}, Path("x"))


def test_sentences_of_marked_scripts_are_kept_and_end_after_a_marked_word() -> None:
    assert sentence_problem(HINDI) is None and sentence_problem("தமிழ் ஒரு திராவிட மொழி ஆகும்.") is None
    assert sentence_problem("का में") == "fragment"
    ends = UnicodeSentences().segment(TAMIL)
    assert ends == ["தமிழ் ஒரு திராவிட மொழி ஆகும்.", " இது இந்தியாவில் பேசப்படுகிறது."]
    assert len(UnicodeSentences().segment("அ. இராமசாமி ஒரு எழுத்தாளர்.")) == 1  # after an initial, no end
    # "км" is an abbreviation (no end after "км."), "км²" is not: the superscript is part of the word
    uk = UnicodeSentences(rules_for("uk").abbreviations)
    assert len(uk.segment("Площа міста 836 км². Довжина вздовж берега — понад 20 км. Далі.")) == 2
    assert sentence_problem("Ра́діус (radius — «промінь») —") == "fragment"  # three words, not four pieces


def test_turkic_titles_upper_case_i_to_dotted_i() -> None:
    tr, az, de = Site(rules_for("tr")), Site(rules_for("az")), Site(rules_for("de"))
    titles = (tr.title("istanbul"), az.title("içərişəhər"), de.title("istanbul"))
    assert titles == ("İstanbul", "İçərişəhər", "Istanbul")
    assert tr.title("ırmak") == "Irmak" and link_target("ilçe", tr) == "İlçe"
    assert Site(rules_for("tr"), case="case-sensitive").title("istanbul") == "istanbul"


def test_a_question_in_another_script_is_warned() -> None:
    assert "CJK" in (script_warning("東京は[MASK]の首都である。", "en") or "")
    assert "Latin" in (script_warning("Paris is the capital of [MASK].", "uk") or "")
    assert script_warning("Paris is the capital of [MASK].", "en") is None
    assert script_warning("Київ — столиця [MASK].", "uk") is None
    assert script_warning("anything", "xx") is None  # a language whose scripts are not known: no check


def test_icu_breaks_japanese_into_words() -> None:
    text = "東京は日本の首都である。"
    bounds = word_boundaries(text)
    assert bounds is not None and {2, 3, 5, 6, 8} <= bounds  # 東京|は|日本|の|首都|...


def test_icu_boundaries_count_characters_outside_the_basic_plane_once() -> None:
    """ICU counts UTF-16 units: a character outside the BMP (an emoji, 𠮷) is two of them, one of Python's."""
    wide, narrow = "😀東京は日本の首都", "☺東京は日本の首都"  # the same text but its first character's width
    assert word_boundaries(wide) == word_boundaries(narrow) == frozenset({1, 3, 4, 6, 7, 9})
    inner = word_boundaries("東京𠮷は日本")
    assert inner is not None and max(inner) == len("東京𠮷は日本") and {2, 3, 4} <= inner


def test_without_icu_unspaced_text_is_cut_by_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    assert word_breaker() == "icu"  # installed with the project
    monkeypatch.setitem(sys.modules, "icu", None)  # (an import of it raises ImportError)
    monkeypatch.delattr(_BREAKERS, "it", raising=False)
    assert word_breaker() == "tokens" and word_boundaries("東京は日本") is None


@pytest.mark.parametrize(
    ("ch", "name", "unspaced"),
    [("ก", "THAI", True), ("ລ", "LAO", True), ("\u0f00", "TIBETAN", True), ("က", "MYANMAR", True),
     ("ក", "KHMER", True), ("あ", "CJK", True), ("ア", "CJK", True), ("ｱ", "CJK", True), ("ㇰ", "CJK", True),
     ("東", "CJK", True), ("\u3400", "CJK", True), ("\u9fff", "CJK", True), ("\uf900", "CJK", True),
     ("\U00020000", "CJK", True), ("々", "CJK", True), ("한", "HANGUL", False), ("ж", "CYRILLIC", False),
     ("é", "LATIN", False), ("a", "LATIN", False), ("\u0378", "", False),
     # each unspaced block's first character, and the one after its last (where both are assigned)
     ("\u4e00", "CJK", True), ("\uff66", "CJK", True), ("\u10a0", "GEORGIAN", False), ("\u1800", "MONGOLIAN", False),
     ("\u4dc0", "HEXAGRAM", False), ("\ua000", "YI", False), ("\ufb00", "LATIN", False),
     ("\u3200", "PARENTHESIZED", False), ("\uffa0", "HALFWIDTH", False)],
)  # fmt: skip
def test_each_script_s_letters(ch: str, name: str, unspaced: bool) -> None:
    """Thai, Lao, Tibetan, Myanmar and Khmer are unspaced but their own scripts; kana and Han are CJK; a code
    point without a name has no script; the characters just past an unspaced block are not unspaced."""
    assert script(ch) == name and is_unspaced_char(ch) is unspaced and has_unspaced(f"ab {ch}") is unspaced


def test_letters_are_counted_by_script_and_their_unspaced_share() -> None:
    assert scripts("Київ ab, 12!") == {"CYRILLIC": 4, "LATIN": 2}
    assert scripts("1 + 1") == {}
    assert unspaced_share("東京abc") == pytest.approx(0.4)
    assert unspaced_share("東京 1-2!") == 1.0 and unspaced_share("12 !") == 0.0 and unspaced_share("") == 0.0


def test_a_question_without_letters_or_with_one_foreign_letter_is_not_warned() -> None:
    assert script_warning("1 + 1 = 2", "ja") is None
    assert script_warning("東 1", "en") is None  # one letter is not a script
    assert "CJK" in (script_warning("東京", "en") or "")  # two are


def test_rules_are_read_for_the_code_however_it_is_written() -> None:
    assert {"en", "ja", "uk", "vi"} <= set(known_languages())
    assert not any(k == "default" or k.startswith("_") for k in known_languages())
    assert rules_for("JA").code == "ja" and rules_for("JA").known and rules_for("JA").unspaced
    assert rules_for("pt_BR").code == "pt-br" and rules_for("pt_BR").known  # its base's rules
    assert unknown_language("EN", "unicode", frozenset()) is None
    with pytest.raises(dataclasses.FrozenInstanceError):  # shared by every caller (cached)
        rules_for("en").stopwords = frozenset()  # type: ignore[misc]


def test_back_matter_headings_alone_or_joined_are_matched() -> None:
    pattern = re.compile(rules_for("en").back_matter_pattern(), re.IGNORECASE)
    assert all(pattern.match(h) for h in ("References", " see also ", "Notes and references", "External links"))
    assert not any(pattern.match(h) for h in ("History", "References to the war", "Early life"))
    empty = dataclasses.replace(rules_for("en"), back_matter=())
    assert not re.match(empty.back_matter_pattern(), "")  # nothing is back matter


def test_english_site_is_the_default() -> None:
    assert ENGLISH.language == "en" and "category" in ENGLISH.hidden_prefixes and "wikt" in ENGLISH.other_prefixes


# ---- evaluation in another language, and saying when a datastore cannot work ---------------------------------------


def test_mlama_layout_is_read_in_the_datastore_s_language(tmp_path: Path) -> None:
    from bertknn.evaluation.lama import discover_relations

    ja = tmp_path / "mlama1.1" / "ja"
    ja.mkdir(parents=True)
    templates = [{"relation": "P36", "template": "[X]の首都は[Y]です。", "label": "capital"},
                 {"relation": "place_of_birth", "template": "[X]は[Y]で生まれた。"}]  # fmt: skip
    (ja / "templates.jsonl").write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in templates), "utf-8")
    (ja / "P36.jsonl").write_text(json.dumps({"sub_label": "日本", "obj_label": "東京", "lineid": 7}) + "\n")
    (ja / "place_of_birth.jsonl").write_text(json.dumps({"sub_label": "夏目漱石", "obj_label": "東京"}) + "\n")
    relations = discover_relations(tmp_path, language="ja")
    assert [(r.id, r.template) for r in relations] == [("P36", "[X]の首都は[Y]です。"),
                                                       ("place_of_birth", "[X]は[Y]で生まれた。")]  # fmt: skip
    from bertknn.evaluation.lama import read_facts

    assert [(f.uid, f.subject, f.obj) for f in read_facts(relations[0])] == [("7", "日本", "東京")]
    assert discover_relations(ja)[0].template == "[X]の首都は[Y]です。"  # the language folder itself
    from bertknn.core.errors import LamaError

    with pytest.raises(LamaError, match="no mLAMA folder for 'uk'"):
        discover_relations(tmp_path, language="uk")


def test_build_warnings_name_what_does_not_fit() -> None:
    from bertknn.core.format.health import dropped_warning, target_warning

    assert target_warning(0.5) is None and target_warning(None) is None
    assert "2.0% of the stored contexts are word answers" in (target_warning(0.02) or "")
    assert dropped_warning({"fragment": 10}, 90) is None
    line = dropped_warning({"fragment": 700, "short": 100}, 200) or ""
    assert line.startswith("80% of the sentences were dropped (700 fragment, 100 short)") and "--language" in line


def test_the_vocabulary_warning_needs_enough_words_and_a_low_share() -> None:
    from bertknn.core.format.health import MIN_WORDS_SEEN, vocabulary_warning

    assert vocabulary_warning(MIN_WORDS_SEEN - 1, 0, "single-piece", "uk") is None  # too few words to tell
    assert vocabulary_warning(1000, 200, "single-piece", "uk") is None  # a fifth kept: enough
    line = vocabulary_warning(1000, 199, "single-piece", "uk") or ""
    assert line.startswith("only 19.9% of the corpus's words") and "one token" in line and "('uk')" in line
    assert "--targets whole-word" in line
    line = vocabulary_warning(1000, 50, "whole-word", "el") or ""
    assert "at most 8 tokens" in line and "('el')" in line and "--targets" not in line

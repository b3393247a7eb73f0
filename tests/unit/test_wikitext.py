"""Article text from wikitext: the words templates render, no back matter, no references, no residue."""

from __future__ import annotations

import bz2
import shutil
from pathlib import Path

import pytest

from bertknn.builder.corpus import CorpusStats, read_corpora
from bertknn.builder.sentences import SentenceSplitter
from bertknn.builder.wikitext import drop_reason, sentence_problem, wikitext_to_text


@pytest.mark.parametrize(
    ("wikitext", "text"),
    [
        ("The city lies some {{convert|70|mi|km}} south of Washington.", "The city lies some 70 mi south of Washington."),
        ("A range of {{convert|2|to|4|km|mi}} wide.", "A range of 2 to 4 km wide."),
        ("Its motto is {{lang|fr|Liberté}} in French.", "Its motto is Liberté in French."),
        ("He said {{lang-de|Guten Tag}} twice.", "He said Guten Tag twice."),
        ("Open {{nowrap|9 to 5}} daily.", "Open 9 to 5 daily."),
        ("Born on {{birth date|1879|3|14}} in Ulm.", "Born on 14 March 1879 in Ulm."),
        ("Died {{death date and age|1955|4|18|1879|3|14}} in Princeton.", "Died 18 April 1955 in Princeton."),
        ("'''Albania''' ({{IPA-sq|ʃcipəˈɾi}}; {{lang-sq|Shqipëri}}), officially the Republic.",
         "Albania (Shqipëri), officially the Republic."),
        ("'''Albania''' ({{IPAc-en|æ|l|ˈ|b|eɪ}}; {{IPA-sq|x}}), officially the Republic.",
         "Albania, officially the Republic."),
        ("Einstein was a physicist.<ref>{{cite web |url=http://x.org |title=T}}</ref> He won.",
         "Einstein was a physicist. He won."),
        ("Text.{{sfn|Smith|2001|p=4}} More text.", "Text. More text."),
        # the argument counts and month numbers at each rule's boundary
        ("It is {{convert|70|mi}} long.", "It is 70 mi long."),
        ("A range of {{convert|2|to|4|km}} wide.", "A range of 2 to 4 km wide."),
        ("It is {{convert|5|km|mi|0}} long.", "It is 5 km long."),  # a fourth argument that is no range
        ("Born on {{birth date|1879|1|5}} in Ulm.", "Born on 5 January 1879 in Ulm."),
        ("Died {{death date|1955|12|18}} there.", "Died 18 December 1955 there."),
        ("Born in {{birth date|1879|12}} in Ulm.", "Born in December 1879 in Ulm."),
        ("Born in {{birth date|1879|1}} in Ulm.", "Born in January 1879 in Ulm."),
        ("Born in {{birth date|1879}} in Ulm.", "Born in 1879 in Ulm."),
        ("Born in {{birth date|1879|13|14}} in Ulm.", "Born in 1879 in Ulm."),  # no such month: the year
        ("Born in {{birth date|1879|13}} in Ulm.", "Born in 1879 in Ulm."),
        ("Born {{birth date|unknown}} in Ulm.", "Born in Ulm."),
        # templates within kept ones render too; within dropped ones they go with them
        ("It runs {{nowrap|{{convert|5|km|mi}}}} long.", "It runs 5 km long."),
        ("Born {{nowrap|{{birth date|1879|3|14}}}} in Ulm.", "Born 14 March 1879 in Ulm."),
        ("A {{nowrap|x {{cite web|url=u}} y}} b.", "A x y b."),
        ("{{Infobox person|height={{convert|5|ft}}}}Lead text here.", "Lead text here."),
        ("Built {{circa|1850}} by monks.", "Built c. 1850 by monks."),
        ("Built {{c.}} 1850 by monks.", "Built c. 1850 by monks."),
        ("Ben &amp; Jerry&#39;s is a brand.", "Ben & Jerry's is a brand."),  # entities as the characters
        ("He won.<small><ref>Smith 2001, p. 4.</ref></small> He left.", "He won. He left."),  # a nested reference
        ("He won.<div>[[File:X.jpg|thumb|A caption here]]</div> He left.", "He won. He left."),
        ("Text before.\n| stray cell || more\n! stray head\n{ stray\nText after.", "Text before.\nText after."),
        ("First line.\n Second line after a space.", "First line.\nSecond line after a space."),
        # a link with a leading colon shows its title without the colon (a category's, an article's)
        ("See [[:Category:Films]] and [[:Paris]] for more.", "See Category:Films and Paris for more."),
    ],
)
def test_templates_that_render_words_keep_them(wikitext: str, text: str) -> None:
    assert wikitext_to_text(wikitext) == text


def test_back_matter_sections_are_not_article_text() -> None:
    wikitext = """Lead sentence about the topic.
== History ==
The history of the topic is long.
== See also ==
* [[Other topic]]
The sister topic is described in another article.
== Notes and references ==
The figure is an estimate made in the year 1900.
{{reflist}}
== Further reading ==
* Stora, Benjamin (2001). ''Algeria''. ISBN 0-8014-8916-4.
== External links ==
* [http://example.org Official site]
"""
    # (prose in back matter: list items, templates and headings go whatever their section)
    assert wikitext_to_text(wikitext) == "Lead sentence about the topic.\nThe history of the topic is long."


def test_list_items_are_not_article_text() -> None:
    wikitext = "She starred in several westerns:\n* Trail of the Vigilantes (1940)\n# Second item\n; Term\nShe retired."
    assert wikitext_to_text(wikitext) == "She starred in several westerns:\nShe retired."


def test_tables_never_reach_the_text() -> None:
    wikitext = """Before the table.
{| class="wikitable"
! colspan=2 align=center | 870–274
|-
| a || b
|}
After the table."""
    assert wikitext_to_text(wikitext) == "Before the table.\nAfter the table."


@pytest.mark.parametrize(
    ("sentence", "problem"),
    [
        ("Stora, Benjamin (2001).", "fragment"),
        (".", "fragment"),
        ("ISBN 978-0-06-136050-3", "fragment"),
        ("! colspan=2 align=center | 870–274 wins and losses here", "markup"),
        ("<ref>{{cite web |url=http://x.org |title=Some title here}}</ref>", "markup"),
        ("See also Lack-of-fit sum of squares.", "hatnote"),
        ("Main article: History of the United States", "hatnote"),
        ("Paris is the capital of France.", None),
        ("Einstein was born in Ulm.", None),
        # at the rules' boundaries: four words of two letters or more; six letters of a script without spaces
        ("Einstein won prizes twice.", None),
        ("Einstein won prizes.", "fragment"),
        ("東京は首都だ。", None),
        ("東京は首都。", "fragment"),
        ("東京は首都 Tokyo", "fragment"),  # half its letters unspaced: counted in words, and two are too few
        ("Київ — столиця.", "fragment"),  # letters outside ASCII in a spaced script: still words
        ("Київ — столиця України й місто.", None),
    ],
)
def test_sentence_filter(sentence: str, problem: str | None) -> None:
    assert sentence_problem(sentence) == problem


def test_a_sentence_under_the_length_is_short_and_at_it_is_judged_by_its_words() -> None:
    sentence = "Paris is big and old."
    assert drop_reason(sentence, len(sentence) + 1) == "short"
    assert drop_reason(sentence, len(sentence)) is None
    assert drop_reason("See also Lack-of-fit sum of squares.", 10) == "hatnote"


def test_real_enwiki_pages_give_clean_sentences(tmp_path: Path) -> None:
    """gensim's wheel ships a real excerpt of an enwiki dump (with tables); read it from the installed package."""
    import gensim  # a dev dependency: its wheel ships the excerpt (never copied into this repository)

    data = Path(gensim.__file__).parent / "test" / "test_data"
    dump = data / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    local = tmp_path / dump.name
    shutil.copy(dump, local)
    splitter = SentenceSplitter()
    sentences = [s for a in read_corpora([local], CorpusStats()) for s in splitter.split(a.text)]
    kept = [s for s in sentences if sentence_problem(s) is None]
    assert len(kept) > 5000
    assert not [s for s in kept if "colspan" in s or "{{" in s or "<ref" in s or s.startswith(("!", "|"))]
    assert not [s for s in kept if "( )" in s or "(, ;" in s or "  " in s]
    assert not [s for s in kept if s.startswith(("See also", "External links"))]
    tables = data / "enwiki-table-markup.xml.bz2"
    text = [a.text for a in read_corpora([tables], CorpusStats())]
    assert text and not any("colspan" in t or "wikitable" in t for t in text)
    assert bz2.decompress(tables.read_bytes()).count(b"{|") > 0  # the excerpt does hold tables

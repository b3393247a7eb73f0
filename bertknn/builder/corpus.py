"""Corpus readers (JSON lines, MediaWiki XML dumps) -> articles -> sentences."""

from __future__ import annotations

import bz2
import gzip
import html
import io
import json
import logging
import lzma
import re
import time
import urllib.parse
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, cast

from bertknn.builder.site import ENGLISH, Site, site_for
from bertknn.builder.stages import StageTimes
from bertknn.builder.wikitext import Link, link_target, wikitext_links
from bertknn.core.errors import CorpusError, json_line_problem
from bertknn.core.languages import check_language, rules_for

logger = logging.getLogger(__name__)

CorpusFormat = Literal["jsonl", "mediawiki-xml"]


@dataclass(frozen=True)
class Article:
    """One article. A dump page keeps its raw wikitext and is converted to text on first use of ``text``: in the
    worker that prepares the article's shard, not in the reader, which every slice of a parallel build runs over
    the whole corpus."""

    id: str
    title: str  # normalised with titles.normalize_title
    raw: str
    source: str
    markup: Literal["text", "wikitext"] = "text"
    links: tuple[Link, ...] = ()  # text markup: the corpus's own links into ``raw`` (wikitext: found in it)
    site: Site = ENGLISH  # the wiki's language and namespaces (one object shared by a corpus's articles)

    @property
    def text(self) -> str:
        return self.text_links()[0]

    def text_links(self) -> tuple[str, list[Link]]:
        """The article text and its entity links (character spans into that text, normalised target titles)."""
        if self.markup == "wikitext":
            return wikitext_links(self.raw, self.site)
        return self.raw, list(self.links)


@dataclass
class CorpusStats:
    redirects: dict[str, str] = field(default_factory=dict)
    skipped_pages: int = 0
    times: StageTimes = field(default_factory=StageTimes)  # decompress and parse, in the reading process
    # bytes of each corpus file (as stored: compressed) read so far, for the build's ETA
    read: dict[str, int] = field(default_factory=dict)
    language: str | None = None  # the corpus's language as given (--language); a dump's own wins, and must agree
    warnings: list[str] = field(default_factory=list)  # one line each: a truncated dump
    _sites: dict[str, Site] = field(default_factory=dict)

    def site(self, path: Path) -> Site:
        """The site of a corpus file: a dump's own (`read_siteinfo`), else the given language's."""
        key = str(path)
        if key not in self._sites:
            xml = detect_format(Path(path)) == "mediawiki-xml"
            self._sites[key] = read_siteinfo(Path(path), self.language) if xml else site_for(self.language)
        return self._sites[key]

    def truncated(self, path: Path, pages: int, last: str, exc: Exception) -> None:
        """Record (and log, once) that a dump ends inside a page: its whole pages were read, the cut one not."""
        after = f", the last whole one {last!r}" if last else ""
        line = (
            f"{path}: the dump ends inside a page ({exc}), a truncated download or copy: kept its {pages:,} whole "
            f"pages{after}; the cut page is left out"
        )
        if line not in self.warnings:
            self.warnings.append(line)
            logger.warning("%s", line)

    def reader(self, path: Path) -> Callable[[int], None]:
        """A callback that records how far into ``path`` (stored bytes) reading has come."""
        key = str(path)

        def at(position: int) -> None:
            self.read[key] = position

        return at


class _TimedReader:
    """A binary file whose reads are timed as the ``decompress`` stage (bytes out of bz2/gzip, or the file), and
    whose position in the stored (compressed) file is reported to ``at``."""

    def __init__(self, f: IO[bytes], times: StageTimes, raw: IO[bytes] | None = None, at: Callable[[int], None] | None = None):
        self._f = f
        self._times = times
        self._raw, self._at = raw, at
        self.at_end = False  # a read came back empty: the content is read to its end

    def read(self, n: int = -1) -> bytes:
        t = time.perf_counter()
        data = self._f.read(n)
        self.at_end = self.at_end or (not data and n != 0)
        self._times.add("decompress", time.perf_counter() - t, len(data))
        self._report()
        return data

    def _report(self) -> None:
        if self._at is not None and self._raw is not None and not self._raw.closed:
            self._at(self._raw.tell())

    def readline(self, n: int = -1) -> bytes:
        t = time.perf_counter()
        data = self._f.readline(n)
        self._times.add("decompress", time.perf_counter() - t, len(data))
        self._report()
        return data

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line

    def close(self) -> None:
        self._f.close()
        if self._raw is not None and self._raw is not self._f:
            self._raw.close()

    def __enter__(self) -> _TimedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ParseClock:
    """Times a reader generator's own work (between resuming and yielding) as ``parse``, less its reads."""

    def __init__(self, times: StageTimes):
        self.times = times
        self.resume()

    def resume(self) -> None:
        self.t0 = time.perf_counter()
        self.read0 = self.times.seconds["decompress"]

    def pause(self, pages: int = 1) -> None:
        own = time.perf_counter() - self.t0 - (self.times.seconds["decompress"] - self.read0)
        self.times.add("parse", max(0.0, own), pages)


_BZ2_MAGIC = b"BZh"
_GZIP_MAGIC = b"\x1f\x8b"
_XZ_MAGIC = b"\xfd7zXZ\x00"


def _compression(path: Path) -> str | None:
    """bz2, gzip, xz or None, from the file's first bytes (Wikimedia names split dumps ``...xml-p10p30302.bz2``)."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head.startswith(_BZ2_MAGIC):
        return "bz2"
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if head.startswith(_XZ_MAGIC):
        return "xz"
    return None


def _decompressing(kind: str | None, f: IO[bytes] | Path) -> IO[bytes]:
    """A decompressing reader of a file (a path: closed with the reader; a file object: left open)."""
    if kind == "bz2":
        return cast(IO[bytes], bz2.open(f, "rb"))
    if kind == "gzip":
        return cast(IO[bytes], gzip.open(f, "rb"))
    if kind == "xz":
        return cast(IO[bytes], lzma.open(f, "rb"))
    return open(f, "rb") if isinstance(f, Path) else f  # noqa: SIM115 - the caller closes it


def _open(path: Path) -> IO[bytes]:
    return _decompressing(_compression(path), Path(path))


def _open_raw(path: Path) -> tuple[IO[bytes], IO[bytes]]:
    """The decompressed content, and the stored file under it (its position: how much has been read); closing
    the content does not close a compressed file's stored file: `_TimedReader` closes both."""
    raw = open(path, "rb")  # noqa: SIM115 - closed with the reader that wraps it
    return _decompressing(_compression(path), raw), raw


def _timed(path: Path, times: StageTimes, at: Callable[[int], None] | None) -> _TimedReader:
    f, raw = _open_raw(path)
    return _TimedReader(f, times, raw, at)


def _head(path: Path) -> bytes:
    """The first bytes of a corpus file's (decompressed) content after a byte order mark and leading space; empty
    only for a file with nothing else."""
    try:
        with _open(path) as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
            while not head and (more := f.read(1 << 20)):  # past a long run of blank lines
                head = more.lstrip()
    except OSError as exc:
        raise CorpusError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from exc
    except (EOFError, zlib.error, lzma.LZMAError) as exc:
        raise CorpusError(f"{path}: {_truncated(exc)}") from exc
    return head


def detect_format(path: Path) -> CorpusFormat:
    """JSON lines or a MediaWiki XML dump, from the first bytes of the (decompressed) content, whatever the name;
    CorpusError for a file that holds nothing but space."""
    text = _head(path)
    if not text:
        raise CorpusError(f"{path}: {NO_RECORDS['jsonl']}")
    if text.startswith(b"{"):
        return "jsonl"
    if text.startswith(b"<mediawiki") or (text.startswith(b"<?xml") and b"<mediawiki" in text):
        return "mediawiki-xml"
    raise CorpusError(
        f"{path}: unknown corpus format (the content starts with {text[:20]!r}); give JSON lines with "
        '{"id", "title", "text"} per line, or a MediaWiki pages-articles XML dump (plain, .bz2, .gz or .xz)'
    )


def _truncated(exc: Exception) -> str:
    """bz2, gzip and xz report a cut-off stream as EOFError (zlib.error or LZMAError for garbage), not OSError."""
    return f"the compressed data is truncated or corrupt ({exc}); download or compress the file again"


_ANCHOR = re.compile(r'<a href="([^"]*)">(.*?)</a>', re.DOTALL)


def html_anchor_links(text: str, site: Site = ENGLISH) -> tuple[str, list[Link]]:
    """WikiExtractor's ``--links`` output: ``<a href="Target%20title">anchor</a>`` in the text -> the text without
    the tags, and a link per anchor (the href URL-decoded and normalised; empty anchors and targets dropped)."""
    out: list[str] = []
    links: list[Link] = []
    pos = length = 0
    for m in _ANCHOR.finditer(text):
        out.append(text[pos : m.start()])
        length += m.start() - pos
        anchor = html.unescape(m.group(2))
        target = link_target(html.unescape(urllib.parse.unquote(m.group(1))), site)
        core = anchor.strip()
        if core and target:
            lead = len(anchor) - len(anchor.lstrip())
            links.append(Link(length + lead, length + lead + len(core), target))
        out.append(anchor)
        length += len(anchor)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out), links


def _json_links(value: object, text: str, where: str, site: Site) -> tuple[Link, ...]:
    """An article's ``"links"``: ``[{"start", "end", "target"}]``, character offsets into ``text``."""
    if not isinstance(value, list):
        raise CorpusError(f'{where}: "links" must be a list of {{"start", "end", "target"}} objects')
    links = []
    for i, item in enumerate(value):
        ok = isinstance(item, dict) and isinstance(item.get("target"), str)
        start, end = (item.get("start"), item.get("end")) if isinstance(item, dict) else (None, None)
        if not ok or type(start) is not int or type(end) is not int:
            raise CorpusError(f'{where}: links[{i}] must be {{"start": int, "end": int, "target": "Title"}}')
        if not 0 <= start < end <= len(text):
            raise CorpusError(
                f"{where}: links[{i}] spans characters {start}..{end}, outside the text's {len(text)} characters "
                "(offsets count characters, not bytes; end is exclusive)"
            )
        target = link_target(item["target"], site)
        if target and text[start:end].strip():
            links.append(Link(start, end, target))
    return tuple(links)


# what a corpus file that holds no record at all is told (an empty file, or the wrong one)
NO_RECORDS = {
    "jsonl": 'no article in it (the file is empty or holds only blank lines); pass JSON lines, one {"title", '
    '"text"} object per line',
    "mediawiki-xml": "no <page> in this dump (only its header); pass a pages-articles dump",
}


def read_jsonl(
    path: Path, times: StageTimes | None = None, at: Callable[[int], None] | None = None, site: Site = ENGLISH
) -> Iterator[Article]:
    """``{"id", "title", "text"}`` per line, as WikiExtractor and most Wikipedia tools emit; optional ``"links"``
    (``[{"start", "end", "target"}]``), or WikiExtractor ``--links`` anchors in the text."""
    lineno, records = 0, 0
    times = times if times is not None else StageTimes()
    clock = _ParseClock(times)
    try:
        with _timed(path, times, at) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                records += 1
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not valid JSON ({json_line_problem(exc)})") from exc
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason})") from exc
                if not isinstance(obj, dict) or not isinstance(obj.get("title"), str) or not isinstance(
                    obj.get("text"), str
                ):
                    raise CorpusError(f'{path}:{lineno}: expected an object with string "title" and "text"')
                title = site.title(obj["title"])
                if not title:
                    raise CorpusError(f"{path}:{lineno}: empty title")
                text: str = obj["text"]
                links: tuple[Link, ...] = ()
                if "links" in obj:
                    links = _json_links(obj["links"], text, f"{path}:{lineno}", site)
                elif "<a href=" in text:
                    text, found = html_anchor_links(text, site)
                    links = tuple(found)
                clock.pause()
                yield Article(str(obj.get("id", lineno)), title, text, str(path), links=links, site=site)
                clock.resume()
        if not records:
            raise CorpusError(f"{path}: {NO_RECORDS['jsonl']}")
    except (EOFError, zlib.error, lzma.LZMAError) as exc:
        where = f" after line {lineno}" if lineno else ""
        raise CorpusError(f"{path}: {_truncated(exc)}{where}") from exc
    except OSError as exc:
        raise CorpusError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _page_article(elem: ET.Element, path: Path, stats: CorpusStats, site: Site) -> Article | None:
    """The article of one finished ``<page>`` element, or None (another namespace, a redirect: recorded in
    ``stats.redirects``, a disambiguation or list page: counted), by the site's rules (`page_kind`)."""
    fields = {_local(c.tag): c for c in elem}
    title = site.title(fields["title"].text or "") if "title" in fields else ""
    ns = fields["ns"].text if "ns" in fields else "0"
    rev = fields.get("revision")
    text_el = None
    if rev is not None:
        text_el = next((c for c in rev if _local(c.tag) == "text"), None)
    wikitext = (text_el.text or "") if text_el is not None else ""
    redirect = fields.get("redirect")
    if ns != "0" or not title:
        return None
    kind = page_kind(title, wikitext, site, redirect is not None)
    if kind == "redirect":
        target = redirect.get("title") if redirect is not None else None
        if target is None:
            m = re.search(r"\[\[([^\]|#]+)", wikitext)
            target = m.group(1) if m else None
        if target:
            stats.redirects[title] = site.title(target)
        return None
    if kind is not None:
        stats.skipped_pages += 1
        return None
    page_id = fields["id"].text if "id" in fields else title
    return Article(str(page_id), title, wikitext, str(path), markup="wikitext", site=site)


def page_kind(title: str, wikitext: str, site: Site, redirect_element: bool = False) -> str | None:
    """``redirect``, ``disambiguation`` or ``list`` for a page that is no article, by the site's language
    (its magic words, disambiguation templates and title rules; English's hold everywhere), else None."""
    if redirect_element or site.is_redirect(wikitext):
        return "redirect"
    if site.is_disambiguation(title, wikitext):
        return "disambiguation"
    if site.is_list(title):
        return "list"
    return None


def read_siteinfo(path: Path, language: str | None = None) -> Site:
    """The site of a dump: its ``<mediawiki xml:lang>``, ``<case>`` and namespaces (read up to ``</siteinfo>``).
    ``language``, when given, must agree with the dump's."""
    lang, case, namespaces = None, "first-letter", {}
    try:
        with _open(path) as f:
            for event, elem in ET.iterparse(f, events=("start", "end")):
                tag = _local(elem.tag)
                if event == "start" and tag == "mediawiki":
                    lang = elem.get("{http://www.w3.org/XML/1998/namespace}lang")
                elif event == "end" and tag == "case" and elem.text:
                    case = elem.text.strip()
                elif event == "end" and tag == "namespace" and elem.get("key") is not None:
                    namespaces[int(elem.get("key", "0"))] = (elem.text or "").strip()
                elif (event == "end" and tag == "siteinfo") or (event == "start" and tag == "page"):
                    break
    except (ET.ParseError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
        raise CorpusError(f"{path}: cannot read the dump's <siteinfo> ({exc})") from exc
    if lang and language and check_language(lang) != check_language(language):
        raise CorpusError(
            f"{path}: the dump is in {lang!r} (its <mediawiki xml:lang>), --language says {language!r}; leave "
            "--language out for a dump"
        )
    code = lang or language or "en"
    try:
        return Site(rules_for(code), case, namespaces)
    except ValueError as exc:
        raise CorpusError(f"{path}: {exc}") from exc


def read_mediawiki_xml(path: Path, stats: CorpusStats) -> Iterator[Article]:
    """Stream a ``pages-articles`` dump (plain, .bz2, .gz or .xz); main namespace only.

    Redirects are recorded in ``stats.redirects`` (normalised source -> target) and skipped, as are
    disambiguation pages and list pages. A dump that ends inside a page (a truncated download) gives its whole
    pages and a warning in ``stats.warnings``; the cut page is not read.
    """
    site = stats.site(path)
    clock = _ParseClock(stats.times)
    pages, last = 0, ""
    try:
        with _timed(path, stats.times, stats.reader(path)) as f:
            try:
                root: ET.Element | None = None
                for event, elem in ET.iterparse(f, events=("start", "end")):
                    if root is None:
                        root = elem
                    if event != "end" or _local(elem.tag) != "page":
                        continue
                    article = _page_article(elem, path, stats, site)
                    pages += 1
                    last = next((c.text or "" for c in elem if _local(c.tag) == "title"), last)
                    # Drop the finished page from the tree (clearing it alone would leave an empty element per page).
                    root.clear()
                    if article is not None:
                        clock.pause()
                        yield article
                        clock.resume()
            except (ET.ParseError, EOFError) as exc:
                if pages == 0 or not (f.at_end or isinstance(exc, EOFError)):
                    raise  # broken in the middle, or cut before its first whole page: nothing to keep
                stats.truncated(path, pages, last, exc)
        if not pages:
            raise CorpusError(f"{path}: {NO_RECORDS['mediawiki-xml']}")
    except ET.ParseError as exc:
        raise CorpusError(f"{path}: malformed XML ({exc})") from exc
    except (EOFError, zlib.error, lzma.LZMAError) as exc:
        raise CorpusError(f"{path}: {_truncated(exc)}") from exc
    except OSError as exc:
        raise CorpusError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


# --- multistream dumps ---------------------------------------------------------------------------------------------
# ``pages-articles-multistream.xml.bz2`` is a concatenation of bz2 streams of (normally) 100 pages each, after one
# stream with the <siteinfo> header; ``...-multistream-index.txt.bz2`` has one line ``offset:page_id:title`` per
# page, offset being the byte offset of the page's stream. A reader seeks to a stream and decompresses only it.

_MULTISTREAM = re.compile(r"multistream(\d*)\.xml")


@dataclass(frozen=True)
class StreamIndex:
    """The page streams of a multistream dump, in file order: byte offsets and pages per stream."""

    dump: Path
    path: Path
    offsets: tuple[int, ...]
    pages: tuple[int, ...]

    def groups(self, max_pages: int) -> list[tuple[int, int]]:
        """Consecutive streams ``[a, b)`` of at most ``max_pages`` pages together (at least one stream each): the
        blocks of a build, a function of the index alone, so that every slice cuts the same blocks."""
        out: list[tuple[int, int]] = []
        start, pages = 0, 0
        for k, n in enumerate(self.pages):
            if k > start and pages + n > max_pages:
                out.append((start, k))
                start, pages = k, 0
            pages += n
        if start < len(self.pages):
            out.append((start, len(self.pages)))
        return out


def index_beside(dump: Path) -> Path | None:
    """Wikimedia's name for a multistream dump's index (``...-multistream.xml.bz2`` ->
    ``...-multistream-index.txt.bz2``; ``...-multistream1.xml-p1p41242.bz2`` -> ``...-multistream-index1.txt-p1p41242.bz2``)
    when that file exists beside it."""
    name, n = _MULTISTREAM.subn(r"multistream-index\1.txt", dump.name, count=1)
    candidate = dump.with_name(name)
    return candidate if n and candidate.is_file() else None


def read_stream_index(dump: Path, path: Path) -> StreamIndex:
    """Parse ``offset:page_id:title`` lines (plain or bz2); streams are the distinct offsets, ascending."""
    counts: dict[int, int] = {}
    try:
        with _open(path) as f:
            for lineno, raw in enumerate(f, 1):
                line = raw.strip()
                if not line:
                    continue
                head, sep, _ = line.partition(b":")
                if not sep or not head.isdigit():
                    raise CorpusError(f"{path}:{lineno}: not a multistream index line (offset:page_id:title)")
                offset = int(head)
                counts[offset] = counts.get(offset, 0) + 1
    except (EOFError, zlib.error, lzma.LZMAError) as exc:
        raise CorpusError(f"{path}: {_truncated(exc)}") from exc
    except OSError as exc:
        raise CorpusError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if not counts:
        raise CorpusError(f"{path}: an empty multistream index; give the index that belongs to {dump.name}")
    offsets = tuple(sorted(counts))
    size = dump.stat().st_size
    if offsets[-1] >= size:
        raise CorpusError(
            f"{path}: offset {offsets[-1]} lies past the end of {dump.name} ({size} bytes); the index belongs to "
            "another dump"
        )
    return StreamIndex(dump, path, offsets, tuple(counts[o] for o in offsets))


def _read_stream(f: IO[bytes], offset: int, times: StageTimes) -> bytes:
    """Decompress the one bz2 stream that starts at ``offset``."""
    f.seek(offset)
    dec = bz2.BZ2Decompressor()
    parts = []
    t = time.perf_counter()
    while not dec.eof:
        chunk = f.read(1 << 20)
        if not chunk:
            raise EOFError("the file ends inside a bz2 stream")
        parts.append(dec.decompress(chunk))
    data = b"".join(parts)
    times.add("decompress", time.perf_counter() - t, len(data))
    return data


def read_streams(index: StreamIndex, first: int, end: int, stats: CorpusStats) -> Iterator[Article]:
    """The articles of streams ``[first, end)`` of a multistream dump, decompressing only those streams."""
    path = index.dump
    site = stats.site(path)
    k = first
    try:
        with open(path, "rb") as f:
            done, size = stats.reader(path), path.stat().st_size
            for k in range(first, end):
                data = _read_stream(f, index.offsets[k], stats.times)
                # the streams read so far, in bytes of the dump (a slice reads only its own)
                stream_end = index.offsets[k + 1] if k + 1 < len(index.offsets) else size
                done(stats.read.get(str(path), 0) + stream_end - index.offsets[k])
                t = time.perf_counter()
                # a stream holds <page> elements without a root (the first and last streams of a dump hold the
                # <mediawiki> header and footer instead, and are not in the index; trimmed here all the same)
                start, stop = data.find(b"<page>"), data.rfind(b"</page>")
                pages: list[Article] = []
                if start >= 0 and stop >= 0:
                    body = io.BytesIO(b"<pages>" + data[start : stop + len(b"</page>")] + b"</pages>")
                    n = 0
                    for _, elem in ET.iterparse(body, events=("end",)):
                        if _local(elem.tag) != "page":
                            continue
                        n += 1
                        article = _page_article(elem, path, stats, site)
                        elem.clear()
                        if article is not None:
                            pages.append(article)
                    stats.times.add("parse", time.perf_counter() - t, n)
                yield from pages
    except ET.ParseError as exc:
        raise CorpusError(f"{path}: malformed XML in the stream at byte {index.offsets[k]} ({exc})") from exc
    except (EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
        raise CorpusError(
            f"{path}: the bz2 stream at byte {index.offsets[k]} cannot be read ({exc}); check that {index.path.name} "
            "is this dump's index, or download the dump again"
        ) from exc


def read_corpora(paths: Iterable[Path], stats: CorpusStats) -> Iterator[Article]:
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise CorpusError(f"{path}: no such corpus file")
        if detect_format(path) == "jsonl":
            yield from read_jsonl(path, stats.times, stats.reader(path), stats.site(path))
        else:
            yield from read_mediawiki_xml(path, stats)


def corpus_language(paths: Iterable[Path], language: str | None = None) -> str:
    """The one language of a build's corpus files: each dump's own (``xml:lang``, which ``language`` must match),
    JSON lines ``language`` (else English). Files in different languages make no datastore: CorpusError."""
    found: dict[str, str] = {}
    for path in paths:
        path = Path(path)
        if detect_format(path) == "mediawiki-xml":
            found[str(path)] = read_siteinfo(path, language).language
        else:
            found[str(path)] = check_language(language) if language else "en"
    codes = sorted(set(found.values()))
    if len(codes) > 1:
        listed = ", ".join(f"{Path(p).name}: {c}" for p, c in found.items())
        raise CorpusError(f"the corpus files are in different languages ({listed}); build one datastore per language")
    return codes[0] if codes else check_language(language or "en")

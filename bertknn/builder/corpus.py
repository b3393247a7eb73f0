"""Corpus readers (JSON lines, MediaWiki XML dumps) -> articles -> sentences."""

from __future__ import annotations

import bz2
import gzip
import html
import io
import json
import logging
import re
import time
import urllib.parse
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, cast

import pysbd

from bertknn.builder.stages import StageTimes
from bertknn.builder.wikitext import Link, link_target, wikitext_links
from bertknn.core.errors import CorpusError
from bertknn.core.titles import normalize_title

logger = logging.getLogger(__name__)

CorpusFormat = Literal["jsonl", "mediawiki-xml"]
_DISAMBIG_TEMPLATES = re.compile(
    r"\{\{\s*(disambiguation|disambig|dab|hndis|geodis|set index article|surname|given name)\b", re.IGNORECASE
)
_LIST_TITLE = re.compile(r"^(List|Lists|Index|Outline) of ", re.IGNORECASE)



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

    @property
    def text(self) -> str:
        return self.text_links()[0]

    def text_links(self) -> tuple[str, list[Link]]:
        """The article text and its entity links (character spans into that text, normalised target titles)."""
        if self.markup == "wikitext":
            return wikitext_links(self.raw)
        return self.raw, list(self.links)


@dataclass
class CorpusStats:
    redirects: dict[str, str] = field(default_factory=dict)
    skipped_pages: int = 0
    times: StageTimes = field(default_factory=StageTimes)  # decompress and parse, in the reading process
    # bytes of each corpus file (as stored: compressed) read so far, for the build's ETA
    read: dict[str, int] = field(default_factory=dict)

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

    def read(self, n: int = -1) -> bytes:
        t = time.perf_counter()
        data = self._f.read(n)
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


def _compression(path: Path) -> str | None:
    """bz2, gzip or None, from the file's first bytes (Wikimedia names split dumps ``...xml-p10p30302.bz2``)."""
    with open(path, "rb") as f:
        head = f.read(3)
    if head.startswith(_BZ2_MAGIC):
        return "bz2"
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    return None


def _open(path: Path) -> IO[bytes]:
    kind = _compression(path)
    if kind == "bz2":
        return cast(IO[bytes], bz2.open(path, "rb"))
    if kind == "gzip":
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def _open_raw(path: Path) -> tuple[IO[bytes], IO[bytes]]:
    """The decompressed content, and the stored file under it (its position: how much has been read); closing
    the content does not close a compressed file's stored file: `_TimedReader` closes both."""
    kind = _compression(path)
    raw = open(path, "rb")  # noqa: SIM115 - closed with the reader that wraps it
    if kind == "bz2":
        return cast(IO[bytes], bz2.open(raw, "rb")), raw
    if kind == "gzip":
        return cast(IO[bytes], gzip.open(raw, "rb")), raw
    return raw, raw


def _timed(path: Path, times: StageTimes, at: Callable[[int], None] | None) -> _TimedReader:
    f, raw = _open_raw(path)
    return _TimedReader(f, times, raw, at)


def detect_format(path: Path) -> CorpusFormat:
    """JSON lines or a MediaWiki XML dump, from the first bytes of the (decompressed) content, whatever the name."""
    try:
        with _open(path) as f:
            head = f.read(4096)
    except OSError as exc:
        raise CorpusError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from exc
    except (EOFError, zlib.error) as exc:
        raise CorpusError(f"{path}: {_truncated(exc)}") from exc
    text = head.lstrip(b"\xef\xbb\xbf").lstrip()
    if not text or text.startswith(b"{"):  # (an empty file reads as JSON lines without articles)
        return "jsonl"
    if text.startswith(b"<mediawiki") or (text.startswith(b"<?xml") and b"<mediawiki" in text):
        return "mediawiki-xml"
    raise CorpusError(
        f"{path}: unknown corpus format (the content starts with {text[:20]!r}); give JSON lines with "
        '{"id", "title", "text"} per line, or a MediaWiki pages-articles XML dump (plain, .bz2 or .gz)'
    )


def _truncated(exc: Exception) -> str:
    """bz2 and gzip report a cut-off stream as EOFError (zlib.error for garbage), which is not an OSError."""
    return f"the compressed data is truncated or corrupt ({exc}); download or compress the file again"


_ANCHOR = re.compile(r'<a href="([^"]*)">(.*?)</a>', re.DOTALL)


def html_anchor_links(text: str) -> tuple[str, list[Link]]:
    """WikiExtractor's ``--links`` output: ``<a href="Target%20title">anchor</a>`` in the text -> the text without
    the tags, and a link per anchor (the href URL-decoded and normalised; empty anchors and targets dropped)."""
    out: list[str] = []
    links: list[Link] = []
    pos = length = 0
    for m in _ANCHOR.finditer(text):
        out.append(text[pos : m.start()])
        length += m.start() - pos
        anchor = html.unescape(m.group(2))
        target = link_target(html.unescape(urllib.parse.unquote(m.group(1))))
        core = anchor.strip()
        if core and target:
            lead = len(anchor) - len(anchor.lstrip())
            links.append(Link(length + lead, length + lead + len(core), target))
        out.append(anchor)
        length += len(anchor)
        pos = m.end()
    out.append(text[pos:])
    return "".join(out), links


def _json_links(value: object, text: str, where: str) -> tuple[Link, ...]:
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
        target = link_target(item["target"])
        if target and text[start:end].strip():
            links.append(Link(start, end, target))
    return tuple(links)


def read_jsonl(path: Path, times: StageTimes | None = None, at: Callable[[int], None] | None = None) -> Iterator[Article]:
    """``{"id", "title", "text"}`` per line, as WikiExtractor and most Wikipedia tools emit; optional ``"links"``
    (``[{"start", "end", "target"}]``), or WikiExtractor ``--links`` anchors in the text."""
    lineno = 0
    times = times if times is not None else StageTimes()
    clock = _ParseClock(times)
    try:
        with _timed(path, times, at) as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
                except UnicodeDecodeError as exc:
                    raise CorpusError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason})") from exc
                if not isinstance(obj, dict) or not isinstance(obj.get("title"), str) or not isinstance(
                    obj.get("text"), str
                ):
                    raise CorpusError(f'{path}:{lineno}: expected an object with string "title" and "text"')
                title = normalize_title(obj["title"])
                if not title:
                    raise CorpusError(f"{path}:{lineno}: empty title")
                text: str = obj["text"]
                links: tuple[Link, ...] = ()
                if "links" in obj:
                    links = _json_links(obj["links"], text, f"{path}:{lineno}")
                elif "<a href=" in text:
                    text, found = html_anchor_links(text)
                    links = tuple(found)
                clock.pause()
                yield Article(str(obj.get("id", lineno)), title, text, str(path), links=links)
                clock.resume()
    except (EOFError, zlib.error) as exc:
        where = f" after line {lineno}" if lineno else ""
        raise CorpusError(f"{path}: {_truncated(exc)}{where}") from exc
    except OSError as exc:
        raise CorpusError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _page_article(elem: ET.Element, path: Path, stats: CorpusStats) -> Article | None:
    """The article of one finished ``<page>`` element, or None (another namespace, a redirect: recorded in
    ``stats.redirects``, a disambiguation or list page: counted)."""
    fields = {_local(c.tag): c for c in elem}
    title = normalize_title(fields["title"].text or "") if "title" in fields else ""
    ns = fields["ns"].text if "ns" in fields else "0"
    rev = fields.get("revision")
    text_el = None
    if rev is not None:
        text_el = next((c for c in rev if _local(c.tag) == "text"), None)
    wikitext = (text_el.text or "") if text_el is not None else ""
    redirect = fields.get("redirect")
    if ns != "0" or not title:
        return None
    if redirect is not None or wikitext.lstrip().lower().startswith("#redirect"):
        target = redirect.get("title") if redirect is not None else None
        if target is None:
            m = re.search(r"\[\[([^\]|#]+)", wikitext)
            target = m.group(1) if m else None
        if target:
            stats.redirects[title] = normalize_title(target)
        return None
    if title.endswith("(disambiguation)") or _DISAMBIG_TEMPLATES.search(wikitext) or _LIST_TITLE.match(title):
        stats.skipped_pages += 1
        return None
    page_id = fields["id"].text if "id" in fields else title
    return Article(str(page_id), title, wikitext, str(path), markup="wikitext")


def read_mediawiki_xml(path: Path, stats: CorpusStats) -> Iterator[Article]:
    """Stream a ``pages-articles`` dump (plain, .bz2 or .gz); main namespace only.

    Redirects are recorded in ``stats.redirects`` (normalised source -> target) and skipped, as are
    disambiguation pages and list pages.
    """
    clock = _ParseClock(stats.times)
    try:
        with _timed(path, stats.times, stats.reader(path)) as f:
            root: ET.Element | None = None
            for event, elem in ET.iterparse(f, events=("start", "end")):
                if root is None:
                    root = elem
                if event != "end" or _local(elem.tag) != "page":
                    continue
                article = _page_article(elem, path, stats)
                # Drop the finished page from the tree (clearing it alone would leave an empty element per page).
                root.clear()
                if article is not None:
                    clock.pause()
                    yield article
                    clock.resume()
    except ET.ParseError as exc:
        raise CorpusError(f"{path}: malformed XML ({exc})") from exc
    except (EOFError, zlib.error) as exc:
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
    except (EOFError, zlib.error) as exc:
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
                        article = _page_article(elem, path, stats)
                        elem.clear()
                        if article is not None:
                            pages.append(article)
                    stats.times.add("parse", time.perf_counter() - t, n)
                yield from pages
    except ET.ParseError as exc:
        raise CorpusError(f"{path}: malformed XML in the stream at byte {index.offsets[k]} ({exc})") from exc
    except (EOFError, OSError, zlib.error) as exc:
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
            yield from read_jsonl(path, stats.times, stats.reader(path))
        else:
            yield from read_mediawiki_xml(path, stats)


class SentenceSplitter:
    """pysbd's rule-based splitter (abbreviations, decimals, initials), over each paragraph of an article."""

    def __init__(self, language: str = "en"):
        self._seg = pysbd.Segmenter(language=language, clean=False)

    def split(self, text: str) -> list[str]:
        out = []
        for para in text.split("\n"):
            if not para.strip():
                continue
            for s in self._seg.segment(para):
                s = s.strip()
                if s:
                    out.append(s)
        return out

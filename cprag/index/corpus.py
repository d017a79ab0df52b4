"""Reading corpora (JSONL, SQuAD JSON, folders of .txt/.md/.html/.pdf) and splitting documents into passages that fit.

Bad records never stop a run: empty, binary or non-UTF-8 files, invalid JSON lines, ids that are neither strings
nor integers, text with NUL characters and documents over MAX_DOCUMENT_CHARS are skipped and reported. A corpus
whose ids repeat is refused whole: which of two records to keep is the user's call, not ours.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from cprag.errors import CorpusError
from cprag.index.documents import Corpus, Document, Passage, Skipped

TEXT_SUFFIXES = {".txt"}  # read as they are, as ever; the rest go through cprag.index.readers
STRUCTURED_SUFFIXES = {".md", ".markdown", ".html", ".htm", ".pdf"}
FOLDER_SUFFIXES = TEXT_SUFFIXES | STRUCTURED_SUFFIXES
# about 2.5M tokens, 35 minutes of encoding on 2 cores: a larger single document is almost always a mistake
# (a whole dump on one line), and a user who means it can split it into files
MAX_DOCUMENT_CHARS = 10_000_000


def read_corpus(path: str | Path, glob: str | None = None) -> Corpus:
    """Documents from a JSONL file, a SQuAD JSON file, one document file, or a folder of .txt/.md/.markdown/.html/
    .htm/.pdf files (recursively, or those `glob` matches relative to the folder, e.g. `**/*.html`)."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(str(path), "no such file or directory")
    if glob is not None and not path.is_dir():
        raise CorpusError(str(path), f"a glob ({glob!r}) selects files in a folder, and this is a file")
    skipped: list[Skipped] = []
    if path.is_dir():
        documents = list(_read_folder(path, skipped, glob))
    elif path.suffix == ".jsonl":
        documents = list(_read_jsonl(path, skipped))
    elif path.suffix == ".json":
        documents = _read_json(path, skipped)
    elif path.suffix.lower() in FOLDER_SUFFIXES:
        documents = list(_read_files([path], path.parent, skipped))
    else:
        raise CorpusError(str(path), "expected a .jsonl or SQuAD .json file, a .txt/.md/.html/.pdf file, or a folder "
                          "of them")
    _refuse_duplicates(path, documents)
    return Corpus(documents=documents, skipped=skipped)


def _refuse_duplicates(path: Path, documents: list[Document]) -> None:
    seen: dict[str, Document] = {}
    repeated = []
    for document in documents:
        if document.id in seen:
            repeated.append((seen[document.id], document))
        seen.setdefault(document.id, document)
    if repeated:
        first, second = repeated[0]
        more = f" (and {len(repeated) - 1} more repeats)" if len(repeated) > 1 else ""
        raise CorpusError(str(path), f"id {first.id!r} is used twice, at {first.source} and {second.source}"
                          f"{more}: ids must be unique")


def _decode_text(raw: bytes) -> str | None:
    if b"\x00" in raw[:8192]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_folder(root: Path, skipped: list[Skipped], glob: str | None = None) -> Iterator[Document]:
    try:
        found = sorted(p for p in (root.glob(glob) if glob else root.rglob("*")) if p.is_file())
    except (ValueError, NotImplementedError) as error:  # an empty or absolute pattern
        raise CorpusError(str(root), f"unusable glob {glob!r}: {error}") from None
    if glob:  # files the user named by pattern are reported when unreadable, not silently passed over
        skipped.extend(Skipped(str(p), f"unsupported file type {p.suffix or '(no suffix)'}") for p in found
                       if p.suffix.lower() not in FOLDER_SUFFIXES)
    yield from _read_files([p for p in found if p.suffix.lower() in FOLDER_SUFFIXES], root, skipped)


def _read_files(files: list[Path], root: Path, skipped: list[Skipped]) -> Iterator[Document]:
    """Each file by its suffix, in the given order: .txt as it is, the others through cprag.index.readers."""
    for file in files:
        if file.suffix.lower() in TEXT_SUFFIXES:
            yield from _read_folder_files([file], root, skipped)
        else:
            from cprag.index.structured_corpus import read_structured_file  # imports the readers only when needed

            document = read_structured_file(file, root, skipped, MAX_DOCUMENT_CHARS)
            if document is not None:
                yield document


def _read_folder_files(files: list[Path], root: Path, skipped: list[Skipped]) -> Iterator[Document]:
    for file in files:
        raw = file.read_bytes()
        text = None if b"\x00" in raw else _decode_text(raw)
        if text is None:
            skipped.append(Skipped(str(file), "binary or not UTF-8"))
            continue
        if not text.strip():
            skipped.append(Skipped(str(file), "empty"))
            continue
        if len(text) > MAX_DOCUMENT_CHARS:
            skipped.append(Skipped(str(file), f"{len(text):,} characters, over the {MAX_DOCUMENT_CHARS:,} a "
                                   "document may hold: split it into several"))
            continue
        doc_id = file.relative_to(root).as_posix()
        title = next((line.lstrip("# ").strip() for line in text.splitlines() if line.strip()), file.stem)
        yield Document(id=doc_id, text=text, title=title[:200], metadata={"path": doc_id}, source=str(file))


def _read_jsonl(path: Path, skipped: list[Skipped]) -> Iterator[Document]:
    text = _decode_text(path.read_bytes())
    if text is None:
        raise CorpusError(str(path), "binary or not UTF-8")
    if not text.strip():
        raise CorpusError(str(path), "the file is empty")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            skipped.append(Skipped(where, f"invalid JSON ({error.msg})"))
            continue
        except RecursionError:
            skipped.append(Skipped(where, "invalid JSON (nested too deeply)"))
            continue
        document = _record_document(record, where, skipped)
        if document is not None:
            yield document


def _record_document(record, where: str, skipped: list[Skipped]) -> Document | None:
    """One JSONL line's (or JSON array item's) document, or None with the reason in `skipped`."""
    if not isinstance(record, dict) or not isinstance(record.get("text"), str) or "id" not in record:
        skipped.append(Skipped(where, 'expected an object with "id" and "text"'))
        return None
    doc_id = record["id"]
    # 7 and "7" name one document; 7.0, true, null or a list name none
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or not str(doc_id).strip():
        skipped.append(Skipped(where, f"id {doc_id!r} is not a non-empty string or an integer"))
        return None
    text = record["text"]
    if not text.strip():
        skipped.append(Skipped(where, "empty text"))
        return None
    if "\x00" in text:
        skipped.append(Skipped(where, "text contains NUL characters (binary data?)"))
        return None
    if len(text) > MAX_DOCUMENT_CHARS:
        skipped.append(Skipped(where, f"{len(text):,} characters, over the {MAX_DOCUMENT_CHARS:,} a document may "
                               "hold: split it into several"))
        return None
    metadata = {k: v for k, v in record.items() if k not in {"id", "text", "title"}}
    return Document(id=str(doc_id), text=text, title=str(record.get("title", "")), metadata=metadata,
                    source=where)


def _read_json(path: Path, skipped: list[Skipped]) -> list[Document]:
    """SQuAD JSON ({"data": [articles]}), or a JSON array of {"id", "text"} objects as JSONL holds them."""
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorpusError(str(path), f"not valid JSON ({error})") from None
    except RecursionError:
        raise CorpusError(str(path), "not valid JSON (nested too deeply)") from None
    if isinstance(data, list):
        documents = [_record_document(record, f"{path}[{i}]", skipped) for i, record in enumerate(data)]
        documents = [d for d in documents if d is not None]
        if not documents:
            raise CorpusError(str(path), 'a JSON array without one usable {"id", "text"} object')
        return documents
    return _read_squad(path, data)


def _read_squad(path: Path, data) -> list[Document]:
    try:
        articles = data["data"]
        return [
            Document(id=f"{article['title']}#{i}", text=paragraph["context"], title=article["title"],
                     source=f"{path}: article {article['title']!r}")
            for article in articles
            for i, paragraph in enumerate(article["paragraphs"])
        ]
    except (KeyError, TypeError) as error:
        raise CorpusError(str(path), f"not SQuAD format: missing {error}") from None


def split_document(document: Document, tokenizer, max_tokens: int) -> list[Passage]:
    """Cut a document into passages of at most `max_tokens` tokens, preferring sentence ends, with offsets.

    A document read with sections (PDF, HTML, Markdown) is cut at its structure instead: cprag.index.structured_corpus.
    """
    if document.sections:
        from cprag.index.structured_corpus import structured_split

        return structured_split(document, tokenizer, max_tokens)
    encoded = tokenizer(document.text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    doc_hash = document.content_hash
    if len(offsets) <= max_tokens:
        return [Passage(document.id, document.id, document.title, document.text, 0, doc_hash)]
    passages, start_token = [], 0
    while start_token < len(offsets):
        end_token = min(start_token + max_tokens, len(offsets))
        if end_token < len(offsets):
            end_token = _sentence_cut(document.text, offsets, start_token, end_token)
        char_start = offsets[start_token][0]
        char_end = offsets[end_token][0] if end_token < len(offsets) else len(document.text)
        passages.append(Passage(
            f"{document.id}@{len(passages)}", document.id, document.title,
            document.text[char_start:char_end], char_start, doc_hash,
        ))
        start_token = end_token
    return passages


def _sentence_cut(text: str, offsets, start: int, end: int) -> int:
    """The latest token in the last quarter of [start, end) that begins a new sentence, else `end`."""
    floor = start + (end - start) * 3 // 4
    for token in range(end, floor, -1):
        # the last non-space character before the token (a scan back, not a copy of the whole prefix: a
        # document of millions of characters would make every passage cost its length)
        at = offsets[token][0] - 1
        while at >= 0 and text[at].isspace():
            at -= 1
        if at >= 0 and text[at] in ".!?":
            return token
    return end

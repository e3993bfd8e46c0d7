"""The corpus script's pure parts: cleaning, the document split, and each source's markup stripping."""

import os

from training import corpus as c

GCIDE_ENTRY = """Abaca \\Ab"a*ca\\ ([a^]b"[.a]*k[.a]), n. [The native name.]
   The Manila-hemp plant ({Musa textilis}); also, its fiber. See
   {Manila hemp} under {Manila}. From AS. b[ae]c, a d[ae]mon.
   [1913 Webster]
"""


def test_clean_normalises_newlines_spaces_and_controls():
    text = "a  \r\nb\rc\x00\x07\t\n\n\n\n\n\nd   \n" + c.EOS + "\n"
    assert c.clean(text) == "a\nb\nc\n\n\nd"  # trailing tab stripped, 5 blank lines to 2
    assert c.clean("Cafe\u0301") == "Caf\u00e9"  # NFC
    assert "<|im_start|>" not in c.clean("x <|im_start|> y")


def test_is_text_drops_short_and_binary():
    assert c.is_text("word " * 50)
    assert not c.is_text("too short")
    assert not c.is_text("\ufffd" * 100 + "x" * 200)


def test_split_is_deterministic_and_roughly_96_2_2():
    keys = [f"src/file{i}.txt" for i in range(5000)]
    first = [c.split_of(k) for k in keys]
    assert first == [c.split_of(k) for k in keys]
    share = {s: first.count(s) / len(keys) for s in ("train", "valid", "test")}
    assert 0.94 < share["train"] < 0.98 and 0.01 < share["valid"] < 0.03 and 0.01 < share["test"] < 0.03


def test_chunks_keys_are_stable():
    docs = list(c.chunks([str(i) for i in range(25)], 10, "k"))
    assert [k for k, _ in docs] == ["k#00000", "k#00001", "k#00002"]
    assert docs[2][1] == "20\n\n21\n\n22\n\n23\n\n24"


def test_gcide_markup_is_stripped():
    out = c.strip_gcide(GCIDE_ENTRY)
    assert out.startswith("Abaca, n. [The native name.]")
    assert "Musa textilis" in out and "{" not in out and "\\" not in out
    assert "baec" in out and "daemon" in out and "Webster" not in out


def test_wordnet_line():
    line = ("00003553 00 s 02 emergent 0 emerging_star(a) 0 003 & 00003356 a 0000 + 02625016 v 0102 | "
            'coming into existence; "an emergent republic"  ')
    assert c.wordnet_line(line) == 'emergent, emerging star (adj): coming into existence; "an emergent republic"'
    assert c.wordnet_line("  1 This software and database is being provided") is None


def test_brown_detokenises_tags_quotes_and_punctuation():
    raw = ("\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, (/( he/pps said/vbd )/) ;/. ;/. "
           "it/pps did/dod not/* ./.\n\n\tAnd/cc so/rb ?/.\n")
    assert c.brown_detok(raw) == 'The jury said "no evidence", (he said); it did not. And so?'


def test_rst_roles_and_labels():
    text = ".. _intro:\n\nUse :func:`os.path.join` and :class:`~collections.OrderedDict` or :ref:`the guide <g>`.\n"
    text += ".. index::\n   single: foo\n\nNext.\n"
    assert c.strip_rst(text) == "\n\nUse os.path.join and collections.OrderedDict or the guide.\n\nNext.\n"


def test_tree_docs_walks_in_order_and_bounds_bytes(tmp_path):
    for rel in ("b/x.rst.txt", "a/y.rst.txt", "a/skip.png", "t/z.rst.txt"):
        os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
        (tmp_path / rel).write_text(rel * 10)
    docs = list(c.tree_docs(str(tmp_path), ".", ".rst.txt", "src", skip=("t/",)))
    assert [k for k, _ in docs] == ["src/a/y.rst.txt", "src/b/x.rst.txt"]
    assert len(list(c.tree_docs(str(tmp_path), ".", ".rst.txt", "src", max_bytes=150))) == 1

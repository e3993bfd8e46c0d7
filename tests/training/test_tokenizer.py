"""The BPE tokenizer script on a few KB of generated text: round trips, special ids, the files that
transformers and moestream load, the chat template, and the .bin encoding of the splits."""

import random

import numpy as np
import pytest

from training.corpus import EOS, SPLITS
from training.tokenizer import encode_corpus, iter_documents, load_bin, main, train_bpe

WORDS = "the of and expert layer token cache stream naïve café déjà vu 日本語 def return self print".split()


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) + rng.choice([".", "?", ":"]) for _ in range(4)]
        docs.append("\n".join(lines) + "\n\n    def f(x):\n        return x * 2\n")
    return docs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus, out = root / "corpus", root / "tok"
    corpus.mkdir()
    for i, split in enumerate(SPLITS):
        (corpus / f"{split}.txt").write_text("".join(f"{d}\n{EOS}\n" for d in _docs(40 if i == 0 else 3, i)))
    main([str(corpus), str(out), "--vocab", "300"])
    return corpus, out


def test_iter_documents_inverts_the_split_format(trained):
    corpus, _ = trained
    assert list(iter_documents(str(corpus / "valid.txt"))) == _docs(3, 1)


def test_round_trip_and_special_ids(trained):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(trained[1] / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|im_start|>")] == [0, 1, 2]
    assert tok.get_vocab_size() == 300
    for text in ("Hello  world,\n\tthe cache streams.  ", "naïve café — 日本語 ✓ emoji 🙂", "x = {'a': [1, 2]}\n"):
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        assert 0 not in ids and 1 not in ids and 2 not in ids
    assert tok.encode("a<|im_start|>b").ids[1] == 2  # specials in text map to their single id


def test_autotokenizer_and_chat_template(trained):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from moestream.engine.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(trained[1]))
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert (hf.eos_token, hf.eos_token_id, hf.pad_token_id) == ("<|im_end|>", 1, 0)
    messages = [{"role": "user", "content": "hi, café"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi, café<|im_end|>\n<|im_start|>assistant\n"
    engine = Tokenizer(str(trained[1]))
    ids = engine.chat(messages)
    assert ids[0] == 2 and ids.count(1) == 1 and engine.eos_ids == {1}
    assert engine.decode(engine.encode("the naïve  cache.")) == "the naïve  cache."


def test_bin_matches_encode(trained):
    from tokenizers import Tokenizer

    corpus, out = trained
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    for split in SPLITS:
        expected = [i for d in iter_documents(str(corpus / f"{split}.txt")) for i in tok.encode(d).ids + [0]]
        got = load_bin(str(out / f"{split}.bin"))
        assert got.dtype == np.uint16 and got.tolist() == expected
    info = encode_corpus(str(corpus), str(out), batch=2)  # batching does not change the ids
    assert info["tokens"]["valid"] == len(load_bin(str(out / "valid.bin")))


def test_bad_vocab_is_one_line_error():
    with pytest.raises(SystemExit, match="error: --vocab"):
        train_bpe(["text"], 100)

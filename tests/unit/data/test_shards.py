"""Dataset shards: manifest names and content hashes, lease -> indices, Shakespeare blocks."""

from __future__ import annotations

import hashlib
import itertools
import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from p2ptrain.core.manifests import DatasetManifest, ShardInfo
from p2ptrain.data.shakespeare import (
    _BLANK_LINES,
    _BOLD,
    _HEADING,
    Corpus,
    ShakespeareChars,
    load_corpus,
    plain_text,
    spread_order,
)
from p2ptrain.data.shards import dataset_manifest, lease_indices, sample_bytes
from p2ptrain.errors import LocalError
from p2ptrain.protocol.leases import Lease


class Pairs:
    """``n`` samples ``(x, label)``; ``x`` depends on ``offset`` so two datasets can differ."""

    def __init__(self, n: int, offset: float = 0.0) -> None:
        self.n = n
        self.offset = offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.arange(3, dtype=torch.float32) + index + self.offset, index % 2


def test_shards_cover_the_dataset_with_a_partial_last_shard() -> None:
    manifest = dataset_manifest(Pairs(10), name="pairs", samples_per_shard=4)
    assert [s.name for s in manifest.shards] == ["pairs-00000", "pairs-00001", "pairs-00002"]
    assert [s.samples for s in manifest.shards] == [4, 4, 2]
    assert manifest.total_samples == 10


def test_blob_ids_are_the_hash_of_canonical_sample_bytes() -> None:
    manifest = dataset_manifest(Pairs(10), name="pairs", samples_per_shard=4)
    digest = hashlib.sha256(b"p2ptrain/v1/shard\n")
    for index in (8, 9):
        x = torch.arange(3, dtype=torch.float32) + index
        digest.update(b"sample 2\n")
        digest.update(b"float32[3]\n" + x.numpy().tobytes())
        digest.update(b"int64[]\n" + (index % 2).to_bytes(8, "little"))
    assert manifest.shards[2].blob_id == digest.hexdigest()
    assert b"".join(sample_bytes(torch.zeros(2, 0))) == b"sample 1\nfloat32[2,0]\n"


def test_equal_data_gives_equal_manifests_and_different_data_different_ids() -> None:
    first = dataset_manifest(Pairs(10), name="pairs", samples_per_shard=4)
    again = dataset_manifest(Pairs(10), name="pairs", samples_per_shard=4)
    changed = dataset_manifest(Pairs(10, offset=0.5), name="pairs", samples_per_shard=4)
    assert first == again
    assert all(a.blob_id != b.blob_id for a, b in zip(first.shards, changed.shards, strict=True))
    # the dtype is part of the bytes: the same values as float64 hash differently
    assert sample_bytes(torch.ones(2)) != sample_bytes(torch.ones(2, dtype=torch.float64))


def test_dict_rows_hash_by_sorted_key_and_never_like_tuples() -> None:
    ids, labels = torch.tensor([5, 6, 7]), torch.tensor([6, 7, -100])
    row = {"input_ids": ids, "labels": labels}
    expected = (
        b"sample dict 2\n"
        + b"key 9:input_ids\n" + b"int64[3]\n" + ids.numpy().tobytes()
        + b"key 6:labels\n" + b"int64[3]\n" + labels.numpy().tobytes()
    )  # fmt: skip
    assert b"".join(sample_bytes(row)) == expected
    # the order a dataset builds its dict in does not matter; the values and names do
    assert sample_bytes({"labels": labels, "input_ids": ids}) == sample_bytes(row)
    assert sample_bytes({"input_ids": ids, "label": labels}) != sample_bytes(row)
    assert sample_bytes((ids, labels)) != sample_bytes(row)
    assert b"".join(sample_bytes((ids, 1))) == (
        b"sample 2\nint64[3]\n" + ids.numpy().tobytes() + b"int64[]\n" + (1).to_bytes(8, "little")
    )  # tuples hash as they always did
    rows = [{"input_ids": ids + i, "n": i} for i in range(6)]
    first = dataset_manifest(rows, name="rows", samples_per_shard=4)
    assert first == dataset_manifest(list(rows), name="rows", samples_per_shard=4)
    with pytest.raises(LocalError, match=r"key 'text'.*remove_columns"):
        sample_bytes({"input_ids": ids, "text": "hello"}, 3)
    with pytest.raises(LocalError, match="string keys"):
        sample_bytes({1: ids})


def test_bad_shard_settings_are_local_errors() -> None:
    with pytest.raises(LocalError, match="samples_per_shard"):
        dataset_manifest(Pairs(3), name="pairs", samples_per_shard=0)
    with pytest.raises(LocalError, match="cannot name"):
        dataset_manifest(Pairs(3), name="bad name", samples_per_shard=2)
    with pytest.raises(LocalError, match="tensors, numbers"):
        dataset_manifest(["text"], name="strings", samples_per_shard=1)


def _dataset() -> DatasetManifest:
    shards = [("d-00000", 4), ("d-00001", 4), ("d-00002", 2)]
    return DatasetManifest(
        name="d",
        shards=tuple(
            ShardInfo(name=n, blob_id=hashlib.sha256(n.encode()).hexdigest(), samples=s)
            for n, s in shards
        ),
    )


def test_lease_indices_take_each_part_from_its_start_in_lease_order() -> None:
    lease = Lease(
        window=1, peer_id="p", parts=(("d-00002", 0, 2), ("d-00000", 1, 3), ("d-00001", 0, 4))
    )
    assert lease_indices(_dataset(), lease) == [8, 9, 1, 2, 3, 4, 5, 6, 7]


def test_lease_indices_wrap_around_the_end_of_a_shard() -> None:
    lease = Lease(window=1, peer_id="p", parts=(("d-00001", 3, 3), ("d-00002", 1, 2)))
    assert lease_indices(_dataset(), lease) == [7, 4, 5, 9, 8]


def test_lease_indices_reject_unknown_shards_and_oversized_parts() -> None:
    with pytest.raises(LocalError, match="recompute it with lease_for"):
        lease_indices(_dataset(), Lease(window=1, peer_id="p", parts=(("other-00000", 0, 1),)))
    with pytest.raises(LocalError, match="holds 2"):
        lease_indices(_dataset(), Lease(window=1, peer_id="p", parts=(("d-00002", 0, 3),)))
    with pytest.raises(LocalError, match="starts at sample 2 of shard 'd-00002', which holds 2"):
        lease_indices(_dataset(), Lease(window=1, peer_id="p", parts=(("d-00002", 2, 1),)))
    with pytest.raises(LocalError, match="starts at sample -1"):
        lease_indices(_dataset(), Lease(window=1, peer_id="p", parts=(("d-00000", -1, 1),)))


def test_plain_text_strips_the_markdown() -> None:
    markdown = "# Play\n\n## ACT I\n\n_Enter\nHAMLET_\n\n**HAMLET**  \nTo be,  \nor not.\n"
    assert plain_text(markdown) == "Play\n\nACT I\n\nEnter\nHAMLET\n\nHAMLET\nTo be,\nor not.\n\n"


def test_shakespeare_blocks_and_vocabulary() -> None:
    corpus = load_corpus()
    assert "**" not in corpus.text and "  \n" not in corpus.text
    assert corpus.vocab == "".join(sorted(set(corpus.text)))
    train, val = ShakespeareChars(32, "train"), ShakespeareChars(32, "val")
    assert train.vocab_size == val.vocab_size == len(corpus.vocab) <= 256
    blocks = len(corpus.tokens) // 33
    assert len(train) + len(val) == blocks
    assert len(val) == round(blocks * 0.1)
    x, y = train[5]
    assert x.shape == y.shape == (32,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    assert corpus.decode(torch.cat([x, y[-1:]])) == corpus.text[5 * 33 : 6 * 33]
    first_val, _ = val[0]
    assert corpus.decode(first_val) == corpus.text[len(train) * 33 : len(train) * 33 + 32]
    with pytest.raises(IndexError):
        train[len(train)]


@given(st.integers(0, 5000))
def test_the_spread_order_is_a_permutation(count: int) -> None:
    order = spread_order(count).tolist()
    assert sorted(order) == list(range(count))


def test_the_spread_order_is_fixed_arithmetic() -> None:
    # stride round(10 * 0.618) = 6 shares 2 with 10; 7 is the first coprime one
    assert spread_order(10).tolist() == [0, 7, 4, 1, 8, 5, 2, 9, 6, 3]


def test_spread_blocks_are_the_same_blocks_and_a_shard_spans_the_text() -> None:
    plain, spread = ShakespeareChars(64, "train"), ShakespeareChars(64, "train", spread=True)
    order = spread_order(len(plain))
    assert torch.equal(
        spread.stacked_samples(0, len(spread))[0], plain.stacked_samples(0, len(plain))[0][order]
    )
    x, y = spread[3]
    assert torch.equal(x, plain[int(order[3])][0]) and torch.equal(y, plain[int(order[3])][1])
    # a shard of 256 consecutive samples: blocks from every stretch of a 256th of the text
    shard = sorted(order[1000:1256].tolist())
    gaps = [b - a for a, b in itertools.pairwise(shard)]
    assert max(gaps) <= 2 * len(plain) // 256, max(gaps)
    # the validation split keeps the text's order
    assert torch.equal(ShakespeareChars(64, "val")[0][0], plain_val_first(64))


def plain_val_first(block_size: int) -> torch.Tensor:
    corpus = load_corpus()
    blocks = len(corpus.tokens) // (block_size + 1)
    start = (blocks - round(blocks * 0.1)) * (block_size + 1)
    return corpus.tokens[start : start + block_size].long()


class Stacked(Pairs):
    """:class:`Pairs` with float features and an int64 label, and their stacked form
    (``wrong``: one that does not hold the samples)."""

    def __init__(self, n: int, wrong: bool = False) -> None:
        super().__init__(n)
        self.wrong = wrong

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x, label = super().__getitem__(index)
        return x, label

    def stacked_samples(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.arange(start, stop)
        x = torch.arange(3, dtype=torch.float32) + index[:, None].float()
        labels = (index % 2) + (1 if self.wrong else 0)
        return x, labels


class OneByOne:
    """``dataset`` without its stacked form: hashed sample by sample."""

    def __init__(self, dataset: object) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> object:
        return self.dataset[index]  # type: ignore[index]


def test_stacked_samples_hash_like_the_samples_one_by_one() -> None:
    stacked = dataset_manifest(Stacked(10), name="pairs", samples_per_shard=4)
    assert stacked == dataset_manifest(OneByOne(Stacked(10)), name="pairs", samples_per_shard=4)
    chars = ShakespeareChars(16)
    assert dataset_manifest(chars, name="c", samples_per_shard=500) == dataset_manifest(
        OneByOne(chars), name="c", samples_per_shard=500
    )


def test_stacked_samples_that_differ_from_the_samples_are_refused() -> None:
    with pytest.raises(LocalError, match=r"stacked_samples\(0, 4\) does not hold"):
        dataset_manifest(Stacked(10, wrong=True), name="pairs", samples_per_shard=4)


# the definitions plain_text and Corpus had before they were made faster: the same output
_UNDERSCORED_BEFORE = re.compile(r"(?<![A-Za-z0-9])_(.+?)_(?![A-Za-z0-9])", re.DOTALL)
_TRAILING_BLANKS_BEFORE = re.compile(r"[ \t]+$", re.MULTILINE)


@given(st.text(alphabet="_a9 \t\n*#—", max_size=40))
def test_the_markdown_is_stripped_as_the_regular_expressions_did(markdown: str) -> None:
    text = _HEADING.sub("", markdown)
    text = _BOLD.sub(r"\1", text)
    text = _UNDERSCORED_BEFORE.sub(r"\1", text)
    text = _TRAILING_BLANKS_BEFORE.sub("", text)
    assert plain_text(markdown) == _BLANK_LINES.sub("\n\n", text).strip() + "\n\n"


@given(st.text(alphabet=st.characters(max_codepoint=0x2100), max_size=60))
def test_the_corpus_encodes_as_sorted_vocabulary_indices(text: str) -> None:
    vocab = "".join(sorted(set(text)))
    assume(len(vocab) <= 256)
    corpus = Corpus(text)
    assert corpus.vocab == vocab
    assert corpus.tokens.dtype == torch.uint8
    assert corpus.tokens.tolist() == [vocab.index(char) for char in text]
    assert corpus.decode(corpus.tokens) == text


def test_char_gpt_spreads_its_blocks_unless_told_not_to() -> None:
    from p2ptrain.torch.char_gpt import DEFAULT_CONFIG, char_gpt_workload

    assert DEFAULT_CONFIG["spread_blocks"] is True
    plain = ShakespeareChars(64, "train")
    order = spread_order(len(plain))
    for config, expected in (({}, int(order[7])), ({"spread_blocks": False}, 7)):
        train = char_gpt_workload(config).train_dataset
        assert torch.equal(train[7][0], plain[expected][0]), config

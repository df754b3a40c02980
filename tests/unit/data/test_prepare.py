"""data prepare: every source kind becomes shard files whose manifest names their hashes;
errors say where; a crash never leaves a half-prepared dataset at --out."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import p2ptrain
from p2ptrain.data import prepare as prepare_module
from p2ptrain.data.columns import Column, columns_from_samples
from p2ptrain.data.prepare import (
    DATASET_FORMAT,
    PreparedDataset,
    prepare_dataset,
    read_prepared,
)
from p2ptrain.data.shard_cut import Batch, cut_shards
from p2ptrain.data.shard_format import open_shard
from p2ptrain.data.staging import remove_stale
from p2ptrain.errors import LocalError

SEED = 20240611


def rows_of(dataset: PreparedDataset) -> list[Any]:
    """Every sample of a prepared dataset, in manifest order."""
    rows: list[Any] = []
    for shard in dataset.manifest.shards:
        rows.extend(open_shard(dataset.shard_path(shard.name), shard=shard.name))
    return rows


def ids_of(dataset: PreparedDataset) -> list[list[int]]:
    return [row["input_ids"].tolist() for row in rows_of(dataset)]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- the manifest and the files -------------------------------------------------------------


def test_the_manifest_names_each_file_by_its_hash_and_size(tmp_path: Path) -> None:
    np.save(tmp_path / "tokens.npy", np.arange(100 * 8, dtype=np.int32).reshape(100, 8))
    dataset = prepare_dataset(tmp_path / "tokens.npy", tmp_path / "out", samples_per_shard=30)
    manifest = dataset.manifest
    assert (manifest.kind, manifest.name) == ("sharded", "tokens")
    assert [s.name for s in manifest.shards] == [f"tokens-{i:05d}" for i in range(4)]
    assert [s.samples for s in manifest.shards] == [30, 30, 30, 10]
    for shard in manifest.shards:
        data = (tmp_path / "out" / "shards" / f"{shard.name}.safetensors").read_bytes()
        assert shard.blob_id == hashlib.sha256(data).hexdigest()
        assert shard.bytes == len(data)
    document = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert document["format"] == DATASET_FORMAT
    assert document["files"]["tokens-00001"] == "shards/tokens-00001.safetensors"
    assert document["manifest"]["kind"] == "sharded"
    descriptor = document["descriptor"]
    assert descriptor["columns"] == [{"key": "input_ids", "dtype": "int32", "shape": [8]}]
    assert descriptor["rows"] == "dict" and descriptor["source"]["kind"] == "npy"
    assert descriptor["created_by"].startswith("p2ptrain ")
    again = read_prepared(tmp_path / "out", verify=True)
    assert again.manifest == manifest and again.files == dataset.files
    assert dataset.describe() == {
        "kind": "sharded",
        "name": "tokens",
        "shards": 4,
        "samples": 100,
        "bytes": manifest.total_bytes,
        "validation_shards": 0,
        "validation_samples": 0,
        "location": str(tmp_path / "out"),
    }
    assert ids_of(dataset) == np.arange(800).reshape(100, 8).tolist()


def test_the_same_source_gives_the_same_manifest(tmp_path: Path) -> None:
    rng = np.random.default_rng(SEED)
    np.save(tmp_path / "x.npy", rng.integers(0, 1000, (500, 16)))
    first = prepare_dataset(tmp_path / "x.npy", tmp_path / "a", shard_bytes=8 << 10)
    second = prepare_dataset(tmp_path / "x.npy", tmp_path / "b", shard_bytes=8 << 10)
    assert first.manifest == second.manifest


def test_shards_are_cut_by_bytes_as_stored(tmp_path: Path) -> None:
    np.save(tmp_path / "f.npy", np.zeros((100, 10), np.float32))  # 40 bytes a row
    dataset = prepare_dataset(tmp_path / "f.npy", tmp_path / "out", shard_bytes=400)
    assert [s.samples for s in dataset.manifest.shards] == [10] * 10
    assert all(s.bytes - 400 < 256 for s in dataset.manifest.shards)  # data + header
    one = prepare_dataset(tmp_path / "f.npy", tmp_path / "one", shard_bytes=30)
    assert len(one.manifest.shards) == 100  # a row larger than a shard is a shard
    np.save(tmp_path / "i.npy", np.full((100, 10), 200, np.int64))  # stored as uint8
    narrow = prepare_dataset(tmp_path / "i.npy", tmp_path / "narrow", shard_bytes=400)
    assert [s.samples for s in narrow.manifest.shards] == [40, 40, 20]


def batch(first: int, lengths: list[int], dtype: str = "int64") -> Batch:
    rows = [np.full(length, first + i, dtype) for i, length in enumerate(lengths)]
    _, columns = columns_from_samples([{"ids": row} for row in rows], first)
    return Batch("dict", columns, first)


def test_cut_shards_regroups_batches_and_widens_shapes() -> None:
    batches = [batch(0, [3, 3]), batch(2, [3, 3, 3]), batch(5, [2])]
    shards = list(cut_shards(batches, samples_per_shard=4, shard_bytes=0))
    assert [(len(shard), shard.first) for shard, _ in shards] == [(4, 0), (2, 4)]
    assert shards[0][0].columns[0].offsets is None  # four rows of 3: stacked
    assert shards[1][0].columns[0].offsets is not None  # 3 then 2: ragged
    assert [s.columns for _, s in shards] == [
        (("ids", "int64", (3,)),),
        (("ids", "int64", (None,)),),
    ]
    ids = [row.tolist() for shard, _ in shards for row in split_rows(shard.columns[0])]
    assert ids == [[i] * 3 for i in range(5)] + [[5] * 2]
    with pytest.raises(LocalError, match="sample 2, key 'ids' is float32 but the samples before"):
        list(
            cut_shards(
                [batch(0, [1, 1]), batch(2, [1], "float32")], samples_per_shard=9, shard_bytes=0
            )
        )


def split_rows(column: Column) -> list[np.ndarray]:
    if column.offsets is None:
        return list(column.data)
    return [column.data[a:b] for a, b in itertools.pairwise(column.offsets.tolist())]


def test_a_directory_of_npy_files_is_one_column_in_name_order(tmp_path: Path) -> None:
    source = tmp_path / "tokens"
    source.mkdir()
    np.save(source / "b.npy", np.full((3, 4), 2, np.uint16))
    np.save(source / "a.npy", np.full((2, 4), 1, np.uint16))
    dataset = prepare_dataset(source, tmp_path / "out", column="tokens")
    rows = rows_of(dataset)
    assert [row["tokens"].tolist() for row in rows] == [[1] * 4] * 2 + [[2] * 4] * 3
    assert rows[0]["tokens"].dtype == torch.uint16
    np.save(source / "c.npy", np.full((3, 5), 2, np.uint16))
    with pytest.raises(LocalError, match=r"c\.npy: array 'input_ids' has rows of uint16 \[5\]"):
        prepare_dataset(source, tmp_path / "other")


def test_npz_arrays_are_the_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(SEED)
    images = rng.random((6, 2, 2), dtype=np.float32)
    np.savez(tmp_path / "set.npz", image=images, label=np.arange(6))
    rows = rows_of(prepare_dataset(tmp_path / "set.npz", tmp_path / "out"))
    assert [row["label"].item() for row in rows] == list(range(6))
    assert torch.equal(rows[5]["image"], torch.from_numpy(images[5]))
    np.savez(tmp_path / "bad.npz", image=images, label=np.arange(5))
    with pytest.raises(LocalError, match="different numbers of rows"):
        prepare_dataset(tmp_path / "bad.npz", tmp_path / "bad")


# -- text -----------------------------------------------------------------------------------


def test_text_files_as_bytes_are_cut_into_blocks(tmp_path: Path) -> None:
    source = tmp_path / "books"
    source.mkdir()
    (source / "2.txt").write_text("world!")
    (source / "1.txt").write_text("hello ")
    dataset = prepare_dataset(source, tmp_path / "out", block_size=5)
    assert ids_of(dataset) == [list(b"hello"), list(b" worl")]
    assert rows_of(dataset)[0]["input_ids"].dtype == torch.int64
    descriptor = dataset.descriptor
    assert descriptor["tokenizer"] == {"kind": "bytes", "vocab_size": 256}
    assert (descriptor["block_size"], descriptor["tokens"], descriptor["dropped_tokens"]) == (
        5,
        12,
        2,
    )
    assert dataset.manifest.name == "books"


def test_text_as_chars_keeps_its_vocabulary(tmp_path: Path) -> None:
    text = "to be, or not to be: ünïcode"
    (tmp_path / "play.txt").write_text(text)
    dataset = prepare_dataset(
        tmp_path / "play.txt", tmp_path / "out", block_size=4, tokenizer="chars"
    )
    tokenizer: Any = dataset.descriptor["tokenizer"]
    vocab = tokenizer["vocab"]
    assert vocab == "".join(sorted(set(text)))
    decoded = "".join(vocab[i] for row in ids_of(dataset) for i in row)
    assert decoded == text[: len(text) // 4 * 4]


def test_text_needs_a_block_size_and_enough_tokens(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("short")
    with pytest.raises(LocalError, match="text needs --block-size"):
        prepare_dataset(tmp_path / "a.txt", tmp_path / "out")
    with pytest.raises(LocalError, match="5 tokens, fewer than one block of 8"):
        prepare_dataset(tmp_path / "a.txt", tmp_path / "out", block_size=8)
    assert not (tmp_path / "out").exists()
    (tmp_path / "bad.txt").write_bytes(b"abc\xff")
    with pytest.raises(LocalError, match=r"bad\.txt: not UTF-8 text at byte offset 3"):
        prepare_dataset(tmp_path / "bad.txt", tmp_path / "out", block_size=1)


def hf_tokenizer(directory: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>", "the", "cat", "sat", "on", "mat", "a"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="[UNK]")
    tokenizer.save_pretrained(directory)
    return tokenizer


def test_a_local_hugging_face_tokenizer_separates_documents_by_eos(tmp_path: Path) -> None:
    hf_tokenizer(tmp_path / "tok")
    with open(tmp_path / "docs.jsonl", "w") as handle:
        for text in ["the cat sat", "on a mat", "the mat"]:
            handle.write(json.dumps({"text": text, "id": 1}) + "\n")
    dataset = prepare_dataset(
        tmp_path / "docs.jsonl",
        tmp_path / "out",
        block_size=3,
        tokenizer=str(tmp_path / "tok"),
        text_field="text",
    )
    assert ids_of(dataset) == [[2, 3, 4], [1, 5, 7], [6, 1, 2]]
    tokenizer: Any = dataset.descriptor["tokenizer"]
    assert (tokenizer["kind"], tokenizer["vocab_size"]) == ("huggingface", 8)
    assert dataset.descriptor["dropped_tokens"] == 2  # "mat", "</s>"
    with pytest.raises(LocalError, match="use bytes, chars, or the path of a local"):
        prepare_dataset(
            tmp_path / "docs.jsonl",
            tmp_path / "x",
            block_size=3,
            tokenizer="gpt2",
            text_field="text",
        )


# -- JSON lines -----------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_jsonl_rows_become_tensors(tmp_path: Path) -> None:
    rows = [
        {"ids": [1, 2, 3], "score": 1, "flag": True, "grid": [[1.5, 2], [3, 4]]},
        {"ids": [], "score": 2.5, "flag": False, "grid": [[0, 0], [0, 1]]},
    ]
    write_lines(tmp_path / "rows.jsonl", [json.dumps(row) for row in rows])
    read = rows_of(prepare_dataset(tmp_path / "rows.jsonl", tmp_path / "out"))
    assert read[0]["ids"].tolist() == [1, 2, 3] and read[1]["ids"].tolist() == []
    assert read[0]["ids"].dtype == torch.int64
    assert [row["score"].item() for row in read] == [1.0, 2.5]  # ints with floats: floats
    assert read[0]["flag"].dtype == torch.bool
    assert read[0]["grid"].tolist() == [[1.5, 2.0], [3.0, 4.0]]


def test_jsonl_errors_name_the_file_line_and_byte_offset(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    write_lines(path, ['{"x": 1}', '{"x": 2}', '{"x": 3'])
    with pytest.raises(LocalError) as raised:
        prepare_dataset(path, tmp_path / "out")
    assert f"{path}, line 3 (byte offset 18) is not valid JSON" in str(raised.value)

    write_lines(path, ['{"x": 1, "title": "A"}', '{"x": 2, "title": "B"}'])
    with pytest.raises(LocalError) as raised:
        prepare_dataset(path, tmp_path / "out")
    message = str(raised.value)
    assert f"{path}, line 1 (byte offset 0), key 'title': text" in message
    assert "--text-field title" in message

    write_lines(path, ['{"x": 1}', '{"x": [1, 2], "y": 1}'])
    with pytest.raises(LocalError, match=r"line 2 .* has the keys"):
        prepare_dataset(path, tmp_path / "out")
    write_lines(path, ['{"x": [[1, 2], [3]]}'])
    with pytest.raises(LocalError, match="inner lists differ in length"):
        prepare_dataset(path, tmp_path / "out")
    write_lines(path, ["[1, 2]"])
    with pytest.raises(LocalError, match="not an object"):
        prepare_dataset(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_jsonl_text_field_documents_end_with_a_newline(tmp_path: Path) -> None:
    write_lines(tmp_path / "d.jsonl", [json.dumps({"text": t}) for t in ("ab", "cd")])
    dataset = prepare_dataset(
        tmp_path / "d.jsonl", tmp_path / "out", block_size=3, text_field="text"
    )
    assert ids_of(dataset) == [list(b"ab\n"), list(b"cd\n")]
    assert dataset.descriptor["documents"] == 2


# -- Parquet and Hugging Face datasets ------------------------------------------------------


def test_parquet_columns_become_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "ids": pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int32())),
            "label": pa.array([0, 1, 0], pa.int8()),
            "vec": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float32(), 2)),
            "text": ["a b", "c", "d e f"],
        }
    )
    pq.write_table(table.drop_columns(["text"]), tmp_path / "t.parquet")
    read = rows_of(prepare_dataset(tmp_path / "t.parquet", tmp_path / "out"))
    assert [row["ids"].tolist() for row in read] == [[1, 2], [3], [4, 5, 6]]
    assert read[1]["label"].dtype == torch.int8 and read[2]["vec"].tolist() == [5.0, 6.0]

    pq.write_table(table, tmp_path / "text.parquet")
    with pytest.raises(LocalError, match=r"text\.parquet, row 0, column 'text': text"):
        prepare_dataset(tmp_path / "text.parquet", tmp_path / "x")
    texts = prepare_dataset(
        tmp_path / "text.parquet", tmp_path / "t", block_size=4, text_field="text"
    )
    assert ids_of(texts) == [list(b"a b\n"), list(b"c\nd "), list(b"e f\n")]

    nulls = pa.table({"x": pa.array([1, None, 3])})
    pq.write_table(nulls, tmp_path / "nulls.parquet")
    with pytest.raises(LocalError, match=r"nulls\.parquet, row 1, column 'x': null"):
        prepare_dataset(tmp_path / "nulls.parquet", tmp_path / "x")


def hf_dataset() -> Any:
    import datasets

    rng = np.random.default_rng(SEED)
    return datasets.Dataset.from_dict(
        {
            "input_ids": [rng.integers(0, 100, int(n)).tolist() for n in rng.integers(1, 6, 20)],
            "label": [i % 3 for i in range(20)],
            "score": [i / 4 for i in range(20)],
        }
    )


def expected_hf_rows(dataset: Any) -> list[dict[str, torch.Tensor]]:
    torch_rows = dataset.with_format("torch")
    return [torch_rows[i] for i in range(len(torch_rows))]


def assert_rows_equal(read: list[Any], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(read) == len(expected)
    for got, want in zip(read, expected, strict=True):
        assert sorted(got) == sorted(want)
        for key in want:
            assert got[key].dtype == want[key].dtype, key
            assert torch.equal(got[key], want[key]), key


def test_hugging_face_save_to_disk_datasets_read_as_the_torch_format(tmp_path: Path) -> None:
    import datasets

    dataset = hf_dataset()
    dataset.save_to_disk(str(tmp_path / "hf"))
    prepared = prepare_dataset(tmp_path / "hf", tmp_path / "out", samples_per_shard=7)
    assert_rows_equal(rows_of(prepared), expected_hf_rows(dataset))
    assert [s.samples for s in prepared.manifest.shards] == [7, 7, 6]

    splits = datasets.DatasetDict({"train": dataset, "test": dataset.select(range(5))})
    splits.save_to_disk(str(tmp_path / "dd"))
    test = prepare_dataset(tmp_path / "dd", tmp_path / "test", split="test")
    assert_rows_equal(rows_of(test), expected_hf_rows(dataset.select(range(5))))
    assert test.descriptor["source"] == {
        "kind": "huggingface",
        "path": str(tmp_path / "dd"),
        "split": "test",
        "rows": 5,
    }
    train = prepare_dataset(tmp_path / "dd", tmp_path / "train")
    assert train.manifest.total_samples == 20
    with pytest.raises(LocalError, match=r"no split 'validation'; pick one of \['test', 'train'\]"):
        prepare_dataset(tmp_path / "dd", tmp_path / "x", split="validation")


def test_hugging_face_objects_map_style_and_iterable(tmp_path: Path) -> None:
    dataset = hf_dataset()
    shuffled = dataset.shuffle(seed=SEED)
    prepared = prepare_dataset(shuffled, tmp_path / "map", name="shuffled")
    assert_rows_equal(rows_of(prepared), expected_hf_rows(shuffled))
    assert prepared.manifest.name == "shuffled"
    iterable = dataset.to_iterable_dataset()
    streamed = prepare_dataset(iterable, tmp_path / "iterable", samples_per_shard=8)
    expected = list(iterable.with_format("torch"))
    assert_rows_equal(rows_of(streamed), expected)
    assert streamed.manifest.name == "iterable"  # named after --out


def test_hugging_face_text_column(tmp_path: Path) -> None:
    import datasets

    dataset = datasets.Dataset.from_dict({"text": ["ab", "cde"], "n": [1, 2]})
    with pytest.raises(LocalError, match="key 'text' holds text"):
        prepare_dataset(dataset, tmp_path / "x")
    prepared = prepare_dataset(dataset, tmp_path / "out", text_field="text", block_size=2)
    assert ids_of(prepared) == [list(b"ab"), list(b"\nc"), list(b"de")]


# -- Python datasets ------------------------------------------------------------------------


class Pairs:
    """A map-style dataset of (features, label) with ragged features."""

    def __len__(self) -> int:
        return 25

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(SEED + index)
        return torch.randn(index % 3 + 1, 4, generator=generator), index % 5


def test_a_map_style_dataset_and_a_generator(tmp_path: Path) -> None:
    pairs = Pairs()
    read = rows_of(prepare_dataset(pairs, tmp_path / "pairs", samples_per_shard=10))
    for index, (features, label) in enumerate(read):
        want_features, want_label = pairs[index]
        assert torch.equal(features, want_features) and label.item() == want_label

    def generate() -> Iterator[dict[str, object]]:
        for i in range(12):
            yield {"x": torch.full((2,), float(i)), "y": i}

    generated = rows_of(prepare_dataset(generate(), tmp_path / "gen"))
    assert [row["y"].item() for row in generated] == list(range(12))

    def mixed() -> Iterator[object]:
        yield from [{"x": 1}] * 100
        yield {"x": 1.5}

    with pytest.raises(LocalError, match="sample 100, key 'x' is float64 but sample"):
        prepare_dataset(mixed(), tmp_path / "mixed")


# -- options and paths ----------------------------------------------------------------------


def test_sources_and_options_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("x")
    np.save(mixed / "b.npy", np.zeros(3))
    with pytest.raises(
        LocalError, match=r"several kinds or an unknown kind: \.txt \(1\), \.npy \(1\)"
    ):
        prepare_dataset(mixed, tmp_path / "out")
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"block_size": 4}, "--block-size and --tokenizer apply to text"),
        ({"split": "train"}, "--split picks a split"),
        ({"samples_per_shard": 0}, "--samples-per-shard 0"),
        ({"shard_bytes": (1 << 30) + 1}, "at most 1024"),
        ({"name": "bad name!"}, "--name 'bad name!'"),
    ]
    for options, message in cases:
        with pytest.raises(LocalError, match=message):
            prepare_dataset(tmp_path / "x.npy", tmp_path / "out", **options)
    with pytest.raises(LocalError, match="does not exist"):
        prepare_dataset(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(LocalError, match=r"cannot prepare a builtins\.int"):
        prepare_dataset(3, tmp_path / "out")
    assert prepare_dataset(tmp_path / "x.npy", tmp_path / "my data!").manifest.name == "x"
    assert not any(entry.name.startswith(".") for entry in tmp_path.iterdir())


def test_too_many_shards_says_which_option_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare_module, "MAX_SHARDS", 2)
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    with pytest.raises(LocalError, match="more than 2 shards: raise --shard-mb"):
        prepare_dataset(tmp_path / "x.npy", tmp_path / "out", samples_per_shard=1)
    assert not (tmp_path / "out").exists()


# -- replacing and crashing -----------------------------------------------------------------


def test_out_is_replaced_only_when_asked_and_only_a_dataset(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    np.save(tmp_path / "y.npy", np.ones((4, 2)))
    prepare_dataset(tmp_path / "x.npy", tmp_path / "out")
    with pytest.raises(LocalError, match="exists; pass --overwrite"):
        prepare_dataset(tmp_path / "y.npy", tmp_path / "out")
    replaced = prepare_dataset(tmp_path / "y.npy", tmp_path / "out", overwrite=True)
    assert read_prepared(tmp_path / "out").manifest == replaced.manifest
    assert replaced.manifest.total_samples == 4
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(LocalError, match="is not a prepared dataset"):
        prepare_dataset(tmp_path / "y.npy", tmp_path / "home", overwrite=True)
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "out", "x.npy", "y.npy"]


def test_a_failure_mid_prepare_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.save(tmp_path / "x.npy", np.zeros((30, 2)))
    write = prepare_module._ShardWriter.write

    def write_then_fail(self: Any, batch: Any) -> None:
        write(self, batch)
        raise OSError("the disk went away")

    monkeypatch.setattr(prepare_module._ShardWriter, "write", write_then_fail)
    with pytest.raises(OSError, match="the disk went away"):
        prepare_dataset(tmp_path / "x.npy", tmp_path / "out", samples_per_shard=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]

    monkeypatch.setattr(prepare_module._ShardWriter, "write", write)
    prepare_dataset(tmp_path / "x.npy", tmp_path / "out", samples_per_shard=10)
    monkeypatch.setattr(prepare_module._ShardWriter, "write", write_then_fail)
    old = read_prepared(tmp_path / "out").manifest
    with pytest.raises(OSError):
        prepare_dataset(tmp_path / "x.npy", tmp_path / "out", samples_per_shard=5, overwrite=True)
    assert read_prepared(tmp_path / "out", verify=True).manifest == old


CHILD = """
import sys, time
from p2ptrain.data.prepare import prepare_dataset

def progress(done):
    print(done.shards, flush=True)
    if done.shards == 2:
        time.sleep(600)  # killed here, mid-way

prepare_dataset(sys.argv[1], sys.argv[2], samples_per_shard=10, on_progress=progress)
"""


def test_a_killed_prepare_leaves_no_dataset_and_the_next_cleans_up(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(100).reshape(50, 2))
    source_root = str(Path(p2ptrain.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": source_root}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "x.npy"), str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert [child.stdout.readline().strip() for _ in range(2)] == ["1", "2"]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.preparing-")]
    assert len(leftovers) == 1 and f"-{child.pid}-" in leftovers[0].name
    assert len(list((leftovers[0] / "shards").iterdir())) == 2
    assert not (tmp_path / "out").exists()

    dataset = prepare_dataset(tmp_path / "x.npy", tmp_path / "out", samples_per_shard=10)
    assert dataset.manifest.total_samples == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "x.npy"]


def test_a_dataset_set_aside_by_an_interrupted_overwrite_comes_back(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    kept = prepare_dataset(tmp_path / "x.npy", tmp_path / "out").manifest
    aside = tmp_path / f".out.replaced-{dead_pid()}-0badc0de"
    (tmp_path / "out").rename(aside)
    stale = tmp_path / f".out.preparing-{dead_pid()}-12345678"
    stale.mkdir()
    running = tmp_path / f".out.preparing-{os.getpid()}-87654321"
    running.mkdir()
    assert remove_stale(tmp_path / "out") == [stale]
    assert read_prepared(tmp_path / "out").manifest == kept
    assert running.exists()  # a live prepare's directory is left alone


# -- reading back ---------------------------------------------------------------------------


def test_read_prepared_finds_damage(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(40).reshape(20, 2))
    dataset = prepare_dataset(tmp_path / "x.npy", tmp_path / "out", samples_per_shard=5)
    path = dataset.shard_path("x-00002")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert read_prepared(tmp_path / "out").manifest == dataset.manifest  # sizes still match
    with pytest.raises(LocalError, match=r"shard x-00002 .* does not match its hash"):
        read_prepared(tmp_path / "out", verify=True)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(LocalError, match=r"shard x-00002 .* has \d+ bytes but the manifest says"):
        read_prepared(tmp_path / "out")
    path.unlink()
    with pytest.raises(LocalError, match=r"the file of shard x-00002 .* is missing"):
        read_prepared(tmp_path / "out")

    index = tmp_path / "out" / "dataset.json"
    document = json.loads(index.read_text())
    index.write_text(json.dumps({**document, "format": "p2ptrain-dataset/0"}))
    with pytest.raises(LocalError, match="is not a p2ptrain-dataset/1 description"):
        read_prepared(tmp_path / "out")
    document["files"]["x-00000"] = "../../etc/passwd"
    index.write_text(json.dumps(document))
    with pytest.raises(LocalError, match="shard x-00000 has no file inside"):
        read_prepared(tmp_path / "out")
    index.write_text("{")
    with pytest.raises(LocalError, match="is not valid JSON"):
        read_prepared(tmp_path / "out")
    with pytest.raises(LocalError, match=r"has no dataset\.json"):
        read_prepared(tmp_path)

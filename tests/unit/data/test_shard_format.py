"""Shard files (p2ptrain-shard/1): samples round-trip, the bytes are canonical, and a damaged
file raises MalformedShard naming the shard and where, never anything else."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load

from p2ptrain.data.shard_format import (
    SHARD_FORMAT,
    MalformedShard,
    ShardRows,
    decode_shard,
    encode_shard,
    open_shard,
)
from p2ptrain.errors import LocalError


def same(a: object, b: object) -> bool:
    """Equal structure, dtypes and values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(same, a, b))
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def as_read(sample: object) -> object:
    """What a sample reads back as: numbers as 0-d tensors, lists as tuples, dicts sorted."""
    if isinstance(sample, dict):
        return {key: as_read(sample[key]) for key in sorted(sample)}
    if isinstance(sample, tuple | list):
        return tuple(as_read(part) for part in sample)
    if isinstance(sample, bool):
        return torch.tensor(sample)
    if isinstance(sample, int):
        return torch.tensor(sample, dtype=torch.int64)
    if isinstance(sample, float):
        return torch.tensor(sample, dtype=torch.float64)
    assert isinstance(sample, torch.Tensor)
    return sample


def round_trip(samples: list[object]) -> ShardRows:
    rows = decode_shard(encode_shard(samples), shard="test-00000")
    assert len(rows) == len(samples)
    for i, sample in enumerate(samples):
        assert same(rows[i], as_read(sample)), i
    return rows


def test_tensor_rows_round_trip_stacked() -> None:
    generator = torch.Generator().manual_seed(0)
    samples: list[object] = [torch.randn(3, 4, generator=generator) for _ in range(5)]
    rows = round_trip(samples)
    assert rows.rows == "tensor"
    assert [(c.key, c.kind, c.dtype, c.shape) for c in rows.columns] == [
        ("0", "stacked", "float32", (3, 4))
    ]


def test_tuple_rows_with_numbers_round_trip() -> None:
    samples: list[object] = [(torch.arange(3) * i, i % 2 == 0, i * 1.5, i) for i in range(4)]
    rows = round_trip(samples)
    assert rows.rows == "tuple"
    assert [c.dtype for c in rows.columns] == ["int64", "bool", "float64", "int64"]
    assert same(rows[-1], rows[3])  # negative indices count from the end
    with pytest.raises(IndexError):
        rows[4]


def test_dict_rows_with_a_ragged_column_round_trip() -> None:
    generator = torch.Generator().manual_seed(1)
    samples: list[object] = [
        {
            "input_ids": torch.randint(0, 50_000, (n,), generator=generator),
            "pixels": torch.randint(0, 255, (n, 2, 3), dtype=torch.uint8, generator=generator),
            "label": n % 3,
            "weight": torch.tensor(0.5, dtype=torch.bfloat16),
        }
        for n in (4, 0, 7, 1)
    ]
    rows = round_trip(samples)
    assert rows.rows == "dict"
    described = {c.key: (c.kind, c.dtype, c.shape, c.stored) for c in rows.columns}
    assert described == {
        "input_ids": ("ragged", "int64", (None,), "uint16"),
        "label": ("stacked", "int64", (), "uint8"),
        "pixels": ("ragged", "uint8", (None, 2, 3), "uint8"),
        "weight": ("stacked", "bfloat16", (), "bfloat16"),
    }


def test_number_and_numpy_rows_round_trip() -> None:
    round_trip([1, 2, -3])
    round_trip([0.5, 1.5])
    round_trip([True, False])
    rows = decode_shard(
        encode_shard([np.arange(3, dtype=np.int16), np.int16(7) + np.zeros(3, np.int16)]), shard="s"
    )
    assert rows[1].dtype == torch.int16 and rows[1].tolist() == [7, 7, 7]


def test_integers_are_stored_narrow_and_read_back_in_their_dtype() -> None:
    cases = {
        (0, 255): "uint8",
        (-1, 100): "int8",
        (-200, 5): "int16",
        (0, 40_000, 1 << 31): "uint32",
        (0, 50_256): "uint16",
        (-40_000, 1): "int32",
        (0, 1 << 40): "int64",
    }
    for values, stored in cases.items():
        rows = decode_shard(encode_shard([torch.tensor(values)]), shard="s")
        assert rows.columns[0].stored == stored
        assert same(rows[0], torch.tensor(values))


def test_the_bytes_are_the_documented_safetensors_layout() -> None:
    data = encode_shard([torch.tensor([1, 2]), torch.tensor([3, 4])])
    header = (
        b'{"__metadata__":{"format":"p2ptrain-shard/1","samples":"2","rows":"tensor",'
        b'"columns":"[{\\"key\\":\\"0\\",\\"kind\\":\\"stacked\\",\\"dtype\\":\\"int64\\",'
        b'\\"shape\\":[2]}]"},"0":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]}} '
    )
    assert data == len(header).to_bytes(8, "little") + header + bytes([1, 2, 3, 4])
    ragged = encode_shard([{"ids": torch.tensor([5, 6, 7])}, {"ids": torch.tensor([8])}])
    tensors = safetensors_load(ragged)
    assert tensors["ids.values"].tolist() == [5, 6, 7, 8]
    assert tensors["ids.offsets"].tolist() == [0, 3, 4]
    assert tensors["ids.offsets"].dtype == torch.int64


def test_the_bytes_depend_on_the_samples_only() -> None:
    def samples(order: list[str]) -> list[object]:
        return [
            {key: torch.full((i + 1,), i) if key == "a" else float(i) for key in order}
            for i in range(3)
        ]

    first = encode_shard(samples(["a", "b"]))
    assert encode_shard(samples(["b", "a"])) == first
    assert int.from_bytes(first[:8], "little") % 8 == 0  # padded: the data starts aligned


def test_open_shard_maps_a_file(tmp_path: Path) -> None:
    samples: list[object] = [{"x": torch.arange(i + 1)} for i in range(6)]
    path = tmp_path / "s.safetensors"
    path.write_bytes(encode_shard(samples))
    rows = open_shard(path, shard="s")
    assert rows.nbytes == path.stat().st_size
    assert all(same(row, as_read(sample)) for row, sample in zip(rows, samples, strict=True))
    row = rows[2]
    assert isinstance(row, dict)
    row["x"] += 1  # a row is the caller's copy
    assert same(rows[2], {"x": torch.arange(3)})


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([{"x": 1}, {"x": 1.5}], "sample 1, key 'x' is float64 but sample 0 has int64"),
        ([(torch.zeros(2, 3),), (torch.zeros(2, 4),)], "sample 1, position 0 has shape [2, 4]"),
        ([{"x": 1}, {"y": 1}], "sample 1 is a dict row with keys ['y']"),
        ([torch.zeros(2), (torch.zeros(2),)], "sample 1 is a tuple row"),
        (
            [{"x": 1}, {"x": "text"}],
            "sample 1, key 'x' holds text (str); to tokenize it pass --text-field x",
        ),
        ([{1: 1}], "sample 0 is a dict with the key 1"),
        ([{"x": [1, 2]}], "sample 0, key 'x' holds a list"),
        ([torch.zeros(2, dtype=torch.complex64)], "sample 0 is a complex64 tensor"),
        ([], "a shard needs at least one"),
    ],
)
def test_bad_samples_are_refused_naming_the_sample_and_key(
    samples: list[object], expected: str
) -> None:
    with pytest.raises(LocalError) as raised:
        encode_shard(samples)
    assert expected in str(raised.value)


# -- damaged files --------------------------------------------------------------------------

GOOD: list[object] = [{"ids": torch.arange(n) + 300, "label": n} for n in (3, 1, 4, 1, 5)]


def edited(data: bytes, edit: Callable[[dict[str, dict[str, object]]], None]) -> bytes:
    """``data`` with its JSON header edited (the tensors' bytes kept)."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length :]


def with_offsets(data: bytes, offsets: list[int]) -> bytes:
    """``data`` with the ``ids`` column's offsets replaced."""
    length = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + length])["ids.offsets"]["data_offsets"]
    base = 8 + length
    return data[: base + start] + np.array(offsets, "<i8").tobytes() + data[base + end :]


def malformed(data: bytes) -> MalformedShard:
    with pytest.raises(MalformedShard) as raised:
        decode_shard(data, shard="books-00007")
    assert "shard 'books-00007' is malformed at" in str(raised.value)
    assert "re-run `p2ptrain data prepare`" in str(raised.value)
    return raised.value


def test_damaged_files_name_the_shard_the_place_and_the_problem() -> None:
    data = encode_shard(GOOD)
    assert decode_shard(data, shard="ok")

    fault = malformed(data[:-3])
    assert fault.where.startswith("byte ") and "truncated" in fault.problem

    fault = malformed(b"PK\x03\x04 this is a zip file, not a shard")
    assert fault.where == "byte 0"

    fault = malformed(data[:4])
    assert fault.where == "byte 0" and "too short" in fault.problem

    def other_format(header: dict[str, dict[str, object]]) -> None:
        header["__metadata__"]["format"] = "p2ptrain-shard/0"

    fault = malformed(edited(data, other_format))
    assert fault.where == "byte 8" and "p2ptrain-shard/0" in fault.problem

    def no_metadata(header: dict[str, dict[str, object]]) -> None:
        del header["__metadata__"]

    assert "not a p2ptrain shard" in malformed(edited(data, no_metadata)).problem

    def more_samples(header: dict[str, dict[str, object]]) -> None:
        header["__metadata__"]["samples"] = "6"

    fault = malformed(edited(data, more_samples))
    assert "the shard has 6" in fault.problem or "not I64 [7]" in fault.problem

    fault = malformed(with_offsets(data, [1, 3, 4, 8, 9, 14]))
    assert (fault.where, "start at 1" in fault.problem) == ("sample 0", True)
    fault = malformed(with_offsets(data, [0, 3, 4, 2, 9, 14]))
    assert (fault.where, "decrease (4 to 2)" in fault.problem) == ("sample 2", True)
    fault = malformed(with_offsets(data, [0, 3, 4, 8, 9, 15]))
    assert fault.where == "sample 4" and "end at 15" in fault.problem
    fault = malformed(with_offsets(data, [0, 3, 4, 8, 9, 13]))
    assert fault.where == "sample 4" and "hold 14 rows" in fault.problem


def test_a_column_with_the_wrong_length_is_malformed() -> None:
    data = encode_shard([(torch.zeros(2), 1)] * 4)

    def fewer_rows(header: dict[str, dict[str, object]]) -> None:
        entry = header["0"]
        entry["shape"] = [3, 2]

    fault = malformed(edited(data, fewer_rows))
    assert fault.where.startswith("byte")  # the sizes no longer tile the data


def test_the_header_length_is_bounded() -> None:
    fault = malformed((1 << 40).to_bytes(8, "little") + b"{}")
    assert "header length" in fault.problem


@settings(max_examples=300)
@given(st.data())
def test_any_damage_decodes_or_raises_malformed_shard(data: st.DataObject) -> None:
    """The h11-style invariant: whatever the bytes, decoding either works -- and then
    every row reads -- or raises MalformedShard; nothing else."""
    original = bytearray(encode_shard(GOOD))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(original) - 1))
        original[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(original)))
    try:
        rows = decode_shard(bytes(original[:cut]), shard="fuzz")
    except MalformedShard:
        return
    for i in range(len(rows)):
        rows[i]


def test_format_constant() -> None:
    assert SHARD_FORMAT == "p2ptrain-shard/1"

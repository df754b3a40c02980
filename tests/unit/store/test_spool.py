"""Blobs spooled to files: ids hashed as they are written, tensors mapped from the file, files
adopted by a blob store or deleted with their last user."""

from __future__ import annotations

import gc
import hashlib
from pathlib import Path

import torch

from p2ptrain.core.spool import MemorySpool
from p2ptrain.core.tensors import decode_state_dict, encode_state_dict, write_state_dict
from p2ptrain.store.blobs import BlobStore
from p2ptrain.store.spool import FileSpool, SpooledFile


def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "b": torch.randn(5, generator=generator),
        "w": torch.randn(3, 4, generator=generator),
        "z": torch.zeros(0),
        "h": torch.arange(6, dtype=torch.int64),
    }


def test_a_state_dict_written_to_a_file_is_its_encoding(tmp_path: Path) -> None:
    expected = bytes(encode_state_dict(state()))
    spooled = write_state_dict(state(), FileSpool(tmp_path))
    assert isinstance(spooled, SpooledFile)
    assert len(spooled) == len(expected)
    assert spooled.read(0, len(spooled)) == expected
    assert spooled.blob_id == spooled.verified_id == hashlib.sha256(expected).hexdigest()
    assert write_state_dict(state(), MemorySpool()) == expected
    tensors = spooled.tensors()
    for name, value in decode_state_dict(expected).items():
        assert torch.equal(tensors[name], value), name


def test_writes_out_of_order_still_give_the_right_id(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    sink = FileSpool(tmp_path).open(len(data))
    sink.write(1000, data[1000:])
    sink.write(0, data[:1000])
    blob = sink.close()
    assert isinstance(blob, SpooledFile)
    assert blob.blob_id == hashlib.sha256(data).hexdigest()
    assert blob.read(123, 10) == data[123:133]


def test_spooled_files_nobody_kept_are_deleted(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path)
    unfinished = spool.open(100)
    unfinished.write(0, b"x" * 10)
    finished = spool.open(10)
    finished.write(0, b"y" * 10)
    blob = finished.close()
    assert len(list(tmp_path.iterdir())) == 2
    del unfinished, finished, blob
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_a_store_adopts_a_spooled_file_by_moving_it(tmp_path: Path) -> None:
    with BlobStore(tmp_path / "blobs") as store:
        spool = FileSpool(store.spool_directory)
        first = write_state_dict(state(), spool)
        again = write_state_dict(state(), spool)
        assert isinstance(first, SpooledFile) and isinstance(again, SpooledFile)
        blob_id = store.adopt(first)
        assert store.get(blob_id) == encode_state_dict(state())
        assert store.adopt(again) == blob_id  # already there: the spooled copy goes
        assert list(store.spool_directory.iterdir()) == []
        assert first.path == str(store.path(blob_id))
        assert torch.equal(first.tensors()["w"], state()["w"])
        del first, again
        gc.collect()
        assert store.has(blob_id)  # the store's file stays

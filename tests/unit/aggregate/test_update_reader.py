"""The streamed update reader and the streamed passes: the same bits as decoding whole.

A reduction reads each update a window at a time (:class:`UpdateVector`); these tests pin
that every span it decodes is bit for bit the span of ``decode_update``'s tensors, that
blobs in a store read by range reduce to the same head as blobs in memory, and that the
first pass (:func:`measure`) refuses what ``decode_update`` refuses. (Hostile blobs: the
fuzz tests of ``test_codecs.py`` run both decoders on every case.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from p2ptrain.aggregate import native, screening
from p2ptrain.aggregate.codecs import decode_update, make_encoder, max_update_bytes
from p2ptrain.aggregate.cohort import Contribution
from p2ptrain.aggregate.exact import CHUNK, flatten, norm64
from p2ptrain.aggregate.rules import make_rule
from p2ptrain.aggregate.rules_basic import WINDOW, TrimmedSpans, Workspace
from p2ptrain.aggregate.screening import measure
from p2ptrain.aggregate.update_reader import UpdateVector
from p2ptrain.core.manifests import UPDATE_CODECS, AggregationSpec, CodecSpec
from p2ptrain.core.tensors import schema_of
from p2ptrain.errors import ProtocolViolation
from p2ptrain.store.blobs import BlobStore
from p2ptrain.store.kernel_build import ensure_kernel

SEED = 20261128


def model(seed: int = SEED) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"a.w": (37, 29), "a": (1000,), "b": (3,), "z": (300, 300), "e": (0,)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


CODECS = [(name, {}) for name in UPDATE_CODECS] + [
    (name, {"block_size": 7}) for name in ("int8", "int4", "int2")
]


@pytest.mark.parametrize(("name", "config"), CODECS, ids=[f"{n}{c}" for n, c in CODECS])
def test_every_span_decodes_to_the_bits_of_the_whole_decode(name: str, config: dict) -> None:
    weights = model()
    schema = schema_of(weights)
    spec = CodecSpec(name=name, config=config)
    blob = make_encoder(spec, schema).encode({k: v * 0.01 for k, v in weights.items()})
    limit = max_update_bytes(spec, schema)
    whole = flatten(decode_update(blob, spec, schema, max_bytes=limit)).view(torch.int32)
    vector = UpdateVector(bytes(blob), spec, schema, max_bytes=limit)
    assert vector.numel() == whole.numel()
    draw = random.Random(SEED)
    for _ in range(60):
        start = draw.randrange(vector.numel())
        end = draw.randrange(start, vector.numel() + 1)
        assert torch.equal(vector[start:end].view(torch.int32), whole[start:end]), (
            f"seed {SEED}: span {start}..{end} of {name} {config}"
        )


@pytest.mark.parametrize(("name", "config"), CODECS, ids=[f"{n}{c}" for n, c in CODECS])
def test_a_vector_that_keeps_its_decoded_values_reads_the_same_bits(
    name: str, config: dict
) -> None:
    """keep_decoded: passes from the first value on keep what they decode and later reads
    copy it; a read that starts past what is kept decodes as before. Every span is the
    whole decode's bits either way, and the finite check is the decode's own."""
    weights = model()
    schema = schema_of(weights)
    spec = CodecSpec(name=name, config=config)
    blob = make_encoder(spec, schema).encode({k: v * 0.01 for k, v in weights.items()})
    limit = max_update_bytes(spec, schema)
    whole = flatten(decode_update(blob, spec, schema, max_bytes=limit)).view(torch.int32)
    plain = UpdateVector(bytes(blob), spec, schema, max_bytes=limit)
    kept = UpdateVector(bytes(blob), spec, schema, max_bytes=limit)
    kept.keep_decoded()
    numel, draw = kept.numel(), random.Random(SEED)
    ahead = draw.randrange(numel // 2, numel)  # past what is kept: decoded, not kept
    assert torch.equal(kept[ahead:numel].view(torch.int32), whole[ahead:numel])
    for _ in range(2):  # the first pass fills what is kept, the second copies it
        first = 0
        while first < numel:
            last = min(numel, first + draw.randrange(1, 20_000))
            span = kept[first:last].view(torch.int32)
            assert torch.equal(span, whole[first:last]), f"seed {SEED}: {first}..{last}"
            plain[first:last]
            assert kept.checked_finite == plain.checked_finite, f"seed {SEED}: {name}"
            first = last
    start = draw.randrange(numel)
    end = draw.randrange(start, numel + 1)
    assert torch.equal(kept[start:end].view(torch.int32), whole[start:end])


def test_a_kept_vector_refuses_bad_values_on_every_read() -> None:
    """A span that failed to decode is not kept: reading it again raises again."""
    weights = {"w": torch.ones(100)}
    schema = schema_of(weights)
    spec = CodecSpec(name="int8")
    limit = max_update_bytes(spec, schema)
    bad = bytearray(make_encoder(spec, schema).encode({"w": torch.full((100,), 0.5)}))
    bad[bad.index(bytes([127] * 8)) + 3] = 0x80  # -128
    vector = UpdateVector(bytes(bad), spec, schema, max_bytes=limit)
    vector.keep_decoded()
    for _ in range(2):
        with pytest.raises(ProtocolViolation, match="-128"):
            vector[0:100]


def test_a_stored_blob_reads_by_range_and_reduces_to_the_same_bits(tmp_path: Path) -> None:
    """Updates of a model longer than one window, read from a blob store's files by range,
    give the same norms and the same aggregate as the decoded tensors in memory."""
    ensure_kernel()
    generator = torch.Generator().manual_seed(SEED)
    weights = {"p": torch.randn(WINDOW + 3 * CHUNK + 5, generator=generator), "q": torch.ones(9)}
    schema = schema_of(weights)
    spec = CodecSpec(name="int8")
    encoder = make_encoder(spec, schema)
    limit = max_update_bytes(spec, schema)
    blobs = [
        encoder.encode({k: v * (0.5 + i) + 0.01 * i for k, v in weights.items()}) for i in range(5)
    ]
    decoded = [flatten(decode_update(b, spec, schema, max_bytes=limit)) for b in blobs]
    with BlobStore(tmp_path / "blobs") as store:
        ids = [store.put(blob) for blob in blobs]
        readers = [store.reader(blob_id) for blob_id in ids]
        assert [r.verified_id for r in readers] == ids
        vectors = [UpdateVector(r, spec, schema, max_bytes=limit) for r in readers]
        assert measure(vectors) == [norm64(d) for d in decoded]
        rule = make_rule(AggregationSpec(rule="trimmed_mean"))
        streamed = rule.aggregate([Contribution(f"{i:02d}", v) for i, v in enumerate(vectors)])
        whole = rule.aggregate([Contribution(f"{i:02d}", d) for i, d in enumerate(decoded)])
        assert streamed.aggregate is not None and whole.aggregate is not None
        assert torch.equal(streamed.aggregate.view(torch.int32), whole.aggregate.view(torch.int32))
        assert streamed.diagnostics == whole.diagnostics
        for reader in readers:
            reader.close()


def test_measure_names_the_updates_it_cannot_use() -> None:
    """The first pass: a norm for a good update, the reason for a non-finite one or one
    whose values are bad bytes (int8 code -128)."""
    weights = {"w": torch.ones(100)}
    schema = schema_of(weights)
    spec = CodecSpec(name="int8")
    limit = max_update_bytes(spec, schema)
    good = make_encoder(spec, schema).encode({"w": torch.full((100,), 0.5)})
    vectors = [UpdateVector(good, spec, schema, max_bytes=limit), torch.full((100,), 2.0)]
    infinite = torch.ones(100)
    infinite[57] = float("inf")
    bad = bytearray(good)
    q_start = bad.index(bytes([127] * 8))  # the codes of an all-0.5 tensor are all 127
    bad[q_start + 3] = 0x80  # -128
    vectors += [infinite, UpdateVector(bytes(bad), spec, schema, max_bytes=limit)]
    norms = measure(vectors)
    decoded = decode_update(good, spec, schema, max_bytes=limit)["w"]
    assert norms[:2] == [norm64(decoded), 20.0]
    assert isinstance(norms[2], str) and "not all finite" in norms[2]
    assert isinstance(norms[3], str) and "-128" in norms[3]
    with pytest.raises(ProtocolViolation, match="-128"):
        vectors[3][0:100]


def test_an_int8_value_that_overflows_is_refused_once_decoded() -> None:
    """A finite scale times a code can still overflow float32: the first pass names the
    update, with or without the kernel (which checks it while decoding, and says so)."""
    weights = {"w": torch.ones(100)}
    schema = schema_of(weights)
    spec = CodecSpec(name="int8")
    limit = max_update_bytes(spec, schema)
    good = bytearray(make_encoder(spec, schema).encode({"w": torch.full((100,), 0.5)}))
    header = int.from_bytes(good[:8], "little")
    begin = 8 + header + json.loads(good[8 : 8 + header])["w/scale"]["data_offsets"][0]
    good[begin : begin + 4] = torch.tensor([3.0e38], dtype=torch.float32).numpy().tobytes()
    loader = native.installed_loader()
    for use in (ensure_kernel, lambda: native.install_kernel(None)):
        use()
        vector = UpdateVector(bytes(good), spec, schema, max_bytes=limit)
        (norm,) = measure([vector])
        assert isinstance(norm, str), f"kernel {native.available()}: {norm}"
        assert "overflow" in norm or "not all finite" in norm
    native.install_kernel(loader)
    ensure_kernel()
    if native.available():
        with pytest.raises(ProtocolViolation, match="overflow"):
            UpdateVector(bytes(good), spec, schema, max_bytes=limit)[0:100]
    honest = UpdateVector(make_encoder(spec, schema).encode(weights), spec, schema, max_bytes=limit)
    honest[0:100]
    assert honest.checked_finite is native.available()


@pytest.mark.parametrize("block_size", [7, 256])
def test_int8_codes_decoded_inside_the_kernel_give_the_bits_of_decoded_windows(
    tmp_path: Path, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first pass over int8 updates in memory or mapped from a store decodes their
    codes inside the kernel: the same norms, centre, mean, distances and drop counts as
    when the windows are decoded first; a bad code leaves the naming to measure()."""
    ensure_kernel()
    if not native.available():
        pytest.skip("no C compiler: the kernel is not built here")
    generator = torch.Generator().manual_seed(SEED)
    weights = {
        "a": torch.randn(CHUNK + 1000, generator=generator),
        "empty": torch.ones(0),
        "b": torch.randn(3, 5, generator=generator),
        "c": torch.randn(WINDOW + 77, generator=generator),
    }
    schema = schema_of(weights)
    spec = CodecSpec(name="int8", config={"block_size": block_size})
    encoder = make_encoder(spec, schema)
    limit = max_update_bytes(spec, schema)
    blobs = [
        encoder.encode({k: v * (0.5 + i) + 0.01 * i for k, v in weights.items()}) for i in range(6)
    ]
    with BlobStore(tmp_path / "blobs") as store:
        readers = [store.reader(store.put(blob)) for blob in blobs[:3]]
        sources = [*readers, *(bytes(blob) for blob in blobs[3:])]
        vectors = [UpdateVector(source, spec, schema, max_bytes=limit) for source in sources]
        assert screening._int8_rows(vectors) is not None
        inside = screening.measure_with_centre(vectors, 1)
        monkeypatch.setattr(screening, "_int8_rows", lambda vectors: None)
        decoded = screening.measure_with_centre(vectors, 1)
        monkeypatch.undo()
        assert inside is not None and decoded is not None
        assert inside.mean is not None and decoded.mean is not None
        assert torch.equal(inside.mean.view(torch.int32), decoded.mean.view(torch.int32))
        assert (inside.norms, inside.dots, inside.centre_norm) == (
            decoded.norms, decoded.dots, decoded.centre_norm
        ), f"seed {SEED}"  # fmt: skip
        assert (inside.distances, inside.dropped) == (decoded.distances, decoded.dropped)
        bad = bytearray(blobs[4])
        header = int.from_bytes(bad[:8], "little")
        begin = 8 + header + json.loads(bad[8 : 8 + header])["c/q"]["data_offsets"][0]
        bad[begin + WINDOW] = 0x80  # -128, in the second window
        vectors[4] = UpdateVector(bytes(bad), spec, schema, max_bytes=limit)
        assert screening.measure_with_centre(vectors, 1) is None
        problems = measure(vectors)
        assert isinstance(problems[4], str) and "-128" in problems[4]
        for reader in readers:
            reader.close()


def test_the_kernel_computes_an_aggregate_alone() -> None:
    """``partial=None``: the trimmed mean of a span of rows, nothing else (screening's
    centre), the same bits as with the distances."""
    ensure_kernel()
    if not native.available():
        pytest.skip("no C compiler: the kernel is not built here")
    generator = torch.Generator().manual_seed(SEED)
    rows = [torch.randn(3 * CHUNK, generator=generator) for _ in range(5)]
    full = torch.empty(3 * CHUNK)
    partial = torch.zeros((5, 3, 256), dtype=torch.float64)
    trimmed = TrimmedSpans(5, 1, Workspace()).native()
    assert trimmed is not None
    assert native.stream_pass(rows, trimmed, full, partial, CHUNK)
    alone = torch.empty(2 * CHUNK)
    spans = [row[CHUNK:] for row in rows]
    assert native.stream_pass(
        spans, trimmed, alone, None, CHUNK, blocks=(1, 3), base=CHUNK, length=3 * CHUNK
    )
    assert torch.equal(alone.view(torch.int32), full[CHUNK:].view(torch.int32))


@pytest.mark.parametrize("block_size", [1, 7, 256])
def test_int8_spans_decode_alike_with_and_without_the_kernel(block_size: int) -> None:
    """The kernel's int8 decode and torch's give the same bits, whatever the span."""
    weights = model()
    schema = schema_of(weights)
    spec = CodecSpec(name="int8", config={"block_size": block_size})
    limit = max_update_bytes(spec, schema)
    blob = make_encoder(spec, schema).encode({k: v * 0.01 for k, v in weights.items()})
    spans = [(0, 92076), (5, 1006), (1000, 1003), (2077, 90000)]
    loader = native.installed_loader()
    try:
        ensure_kernel()
        with_kernel = UpdateVector(blob, spec, schema, max_bytes=limit)
        kernel = [with_kernel[a:b].clone() for a, b in spans]
        native.install_kernel(None)
        without = UpdateVector(blob, spec, schema, max_bytes=limit)
        plain = [without[a:b].clone() for a, b in spans]
    finally:
        native.install_kernel(loader)
    for (a, b), one, two in zip(spans, kernel, plain, strict=True):
        assert torch.equal(one.view(torch.int32), two.view(torch.int32)), f"span {a}..{b}"

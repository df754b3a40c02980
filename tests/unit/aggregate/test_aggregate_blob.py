"""The canonical aggregate encoding: exact round trips (signed zeros included), the sparse
form exactly when it is smaller, and every non-canonical blob refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.aggregate.aggregate_blob import (
    decode_aggregate,
    encode_aggregate,
    settle_aggregate,
)
from p2ptrain.core.tensors import TensorSpec, decode_state_dict, encode_state_dict, schema_of
from p2ptrain.errors import ProtocolViolation
from p2ptrain.store.spool import FileSpool

LIMIT = 1 << 30


def _round_trip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return decode_aggregate(encode_aggregate(tensors), schema_of(tensors), max_bytes=LIMIT)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _sparse(numel: int, positions: list[int], value: float = 0.5) -> torch.Tensor:
    flat = torch.zeros(numel)
    flat[positions] = value
    return flat


def test_a_sparse_aggregate_round_trips_bit_for_bit_and_is_small() -> None:
    big = _sparse(300_000, list(range(0, 300_000, 50)))  # 2% dense, over several chunks
    big[7] = -0.0  # a signed zero is a value the outer step must see
    tensors = {"w": big.reshape(600, 500), "b": torch.randn(10)}
    back = _round_trip(tensors)
    assert all(_same_bits(tensors[n], back[n]) for n in tensors)
    blob = encode_aggregate(tensors)
    assert len(blob) < 0.05 * 300_000 * 4  # 6 bytes per stored value, not 4 per element
    parts = decode_state_dict(blob, max_bytes=LIMIT)
    assert {"w/counts", "w/offsets", "w/values", "b/dense"} <= set(parts)
    assert parts["w/values"].numel() == 6000 + 1


def test_the_same_aggregate_always_gives_the_same_bytes() -> None:
    tensors = {"a": _sparse(1000, [3, 999]), "b": torch.ones(4)}
    assert encode_aggregate(tensors) == encode_aggregate({k: v.clone() for k, v in tensors.items()})


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 140_000),
            st.lists(st.floats(width=32, allow_nan=False), min_size=0, max_size=40),
        ),
        min_size=1,
        max_size=3,
    ),
    st.randoms(use_true_random=False),
)
def test_any_aggregate_round_trips(shapes: list[tuple[int, list[float]]], rng: object) -> None:
    tensors = {}
    for i, (numel, values) in enumerate(shapes):
        flat = torch.zeros(numel)
        for value in values:
            if numel:
                flat[rng.randrange(numel)] = value  # type: ignore[attr-defined]
        tensors[f"t{i}"] = flat
    back = _round_trip(tensors)
    assert all(_same_bits(tensors[n], back[n]) for n in tensors)


def _tampered(tensors: dict[str, torch.Tensor], **parts: torch.Tensor | None) -> bytes:
    container = decode_state_dict(encode_aggregate(tensors), max_bytes=LIMIT)
    for name, value in parts.items():
        key = name if name == "__aggregate__" else name.replace("__", "/")
        if value is None:
            container.pop(key)
        elif key.endswith("/offsets"):
            container[key] = value.to(torch.int16)
        else:
            container[key] = value
    return bytes(encode_state_dict(container))


SPARSE = {"w": _sparse(70_000, [1, 2, 66_000])}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"__aggregate__": None}, "format tag"),
        ({"w__values": torch.tensor([0.5, 0.0, 0.5])}, r"\+0.0"),
        ({"w__counts": torch.tensor([3, 1], dtype=torch.int32)}, "add up"),
        ({"w__counts": torch.tensor([-1, 4], dtype=torch.int32)}, "add up"),
        ({"w__offsets": torch.tensor([2, 1, 464]) - 32768}, "out of order"),
        ({"w__offsets": torch.tensor([1, 2, 65535]) - 32768}, "out of range"),
        ({"w__counts": None}, "lacks parameter"),
        ({"w__dense": torch.zeros(70_000)}, "both dense and sparse"),
        ({"x__dense": torch.zeros(3)}, "parts of no parameter"),
        ({"w__values": torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)}, "dtypes or shapes"),
    ],
)
def test_a_non_canonical_aggregate_is_refused(
    changes: dict[str, torch.Tensor | None], message: str
) -> None:
    with pytest.raises(ProtocolViolation, match=message):
        decode_aggregate(_tampered(SPARSE, **changes), schema_of(SPARSE), max_bytes=LIMIT)


def test_dense_where_sparse_is_canonical_and_the_reverse_are_refused() -> None:
    tag = decode_state_dict(encode_aggregate(SPARSE), max_bytes=LIMIT)["__aggregate__"]
    dense_blob = bytes(encode_state_dict({"__aggregate__": tag, "w/dense": SPARSE["w"]}))
    with pytest.raises(ProtocolViolation, match="sparse is canonical"):
        decode_aggregate(dense_blob, schema_of(SPARSE), max_bytes=LIMIT)
    full = {"w": torch.ones(8)}
    positions = torch.arange(8)
    sparse_blob = bytes(
        encode_state_dict(
            {
                "__aggregate__": tag,
                "w/counts": torch.tensor([8], dtype=torch.int32),
                "w/offsets": (positions - 32768).to(torch.int16),
                "w/values": torch.ones(8),
            }
        )
    )
    with pytest.raises(ProtocolViolation, match="dense is canonical"):
        decode_aggregate(sparse_blob, schema_of(full), max_bytes=LIMIT)
    assert math.isclose(float(_round_trip(full)["w"].sum()), 8.0)


# ------------------------------------------------------------------ int8 precision


def _block_scale(block: torch.Tensor, levels: int) -> torch.Tensor:
    """absmax / levels in float32, one ulp up where that fell below (codec_dense's rule)."""
    absmax = block.abs().max()
    scale = absmax / levels
    if float(scale.double() * levels) < float(absmax.double()):
        scale = torch.nextafter(scale, torch.tensor(math.inf))
    return scale


def test_int8_settles_to_the_rounded_values_it_stores_in_a_quarter_of_the_bytes() -> None:
    generator = torch.Generator().manual_seed(11)
    tensors = {
        "w": torch.randn(300, 257, generator=generator),  # blocks straddle rows
        "b": torch.randn(7, generator=generator) * 1e-30,  # tiny, subnormal scales
        "z": torch.zeros(3),
    }
    rounded, blob = settle_aggregate(tensors, "int8")
    exact, fp32_blob = settle_aggregate(tensors, "fp32")
    assert all(_same_bits(exact[n], tensors[n]) for n in tensors)
    assert len(blob) < 0.27 * len(fp32_blob)
    back = decode_aggregate(blob, schema_of(tensors), max_bytes=LIMIT, precision="int8")
    assert all(_same_bits(rounded[n], back[n]) for n in tensors)
    # by hand: one block of 256, its absmax over 127, codes rounded to nearest
    flat = tensors["w"].reshape(-1)[:256]
    scale = _block_scale(flat, 127)
    codes = (flat / scale).round().clamp(-127, 127)
    assert torch.equal(rounded["w"].reshape(-1)[:256], codes * scale)
    assert float((rounded["w"] - tensors["w"]).abs().max()) <= float(
        tensors["w"].abs().max() / 127 / 2 * 1.0001
    )
    assert torch.equal(rounded["z"], torch.zeros(3))
    again = settle_aggregate({n: t.clone() for n, t in tensors.items()}, "int8")[1]
    assert again == blob


def test_an_int8_aggregate_refuses_other_forms() -> None:
    tensors = {"w": torch.randn(600)}
    schema = schema_of(tensors)
    _, blob = settle_aggregate(tensors, "int8")
    with pytest.raises(ProtocolViolation, match="lacks the 'q' part"):
        decode_aggregate(encode_aggregate(tensors), schema, max_bytes=LIMIT, precision="int8")
    with pytest.raises(ProtocolViolation, match="lacks parameter"):
        decode_aggregate(blob, schema, max_bytes=LIMIT)  # read as fp32
    parts = decode_state_dict(blob, max_bytes=LIMIT)
    bad_code = dict(parts)
    bad_code["w/q"] = parts["w/q"].clone()
    bad_code["w/q"][5] = -128
    with pytest.raises(ProtocolViolation, match="-128"):
        decode_aggregate(
            bytes(encode_state_dict(bad_code)), schema, max_bytes=LIMIT, precision="int8"
        )
    short = dict(parts)
    short["w/scale"] = parts["w/scale"][:1]
    with pytest.raises(ProtocolViolation, match="wrong dtypes or shapes"):
        decode_aggregate(bytes(encode_state_dict(short)), schema, max_bytes=LIMIT, precision="int8")
    negative = dict(parts)
    negative["w/scale"] = -parts["w/scale"]
    with pytest.raises(ProtocolViolation, match="finite and >= 0"):
        decode_aggregate(
            bytes(encode_state_dict(negative)), schema, max_bytes=LIMIT, precision="int8"
        )


@pytest.mark.parametrize(("precision", "levels", "share"), [("int4", 7, 0.14), ("int2", 1, 0.08)])
def test_packed_precisions_round_like_their_codecs(
    precision: str, levels: int, share: float
) -> None:
    generator = torch.Generator().manual_seed(12)
    tensors = {"w": torch.randn(40, 33, generator=generator), "b": torch.zeros(5)}
    rounded, blob = settle_aggregate(tensors, precision)
    assert len(blob) < share * 4 * (40 * 33 + 5) + 600  # container framing aside
    back = decode_aggregate(blob, schema_of(tensors), max_bytes=LIMIT, precision=precision)
    assert all(_same_bits(rounded[n], back[n]) for n in tensors)
    flat = tensors["w"].reshape(-1)[:256]  # by hand: the first block
    scale = _block_scale(flat, levels)
    codes = (flat / scale).round().clamp(-levels, levels)
    assert torch.equal(rounded["w"].reshape(-1)[:256], codes * scale)
    assert torch.equal(rounded["b"], torch.zeros(5))
    with pytest.raises(ProtocolViolation, match="lacks the 'codes' part"):
        decode_aggregate(
            settle_aggregate(tensors, "int8")[1],
            schema_of(tensors),
            max_bytes=LIMIT,
            precision=precision,
        )


def test_a_sparse_tensor_larger_than_a_slab_is_encoded_as_one_container(tmp_path: Path) -> None:
    """Encoded a slab at a time (in memory or into a file), a sparse tensor of several
    slabs gives the bytes of the whole container encoded at once."""
    generator = torch.Generator().manual_seed(34)
    big = torch.randn(5_000_003, generator=generator)
    big[torch.rand(big.numel(), generator=generator) < 0.8] = 0.0
    big[17] = -0.0  # stored: only +0.0 is left out
    tensors = {"big": big, "dense": torch.randn(3, 4, generator=generator)}
    flat = big.view(torch.int32)
    stored = flat.ne(0).nonzero().reshape(-1)
    container = {
        "__aggregate__": torch.tensor(list(b"p2ptrain-aggregate/1"), dtype=torch.uint8),
        "big/counts": torch.bincount(stored // 65536, minlength=-(-big.numel() // 65536)).to(
            torch.int32
        ),
        "big/offsets": (stored % 65536 - 32768).to(torch.int16),
        "big/values": big[stored],
        "dense/dense": tensors["dense"],
    }
    expected = encode_state_dict(container)
    assert encode_aggregate(tensors) == expected
    spooled = encode_aggregate(tensors, FileSpool(tmp_path))
    assert not isinstance(spooled, bytes | bytearray)
    assert spooled.read(0, len(spooled)) == expected
    decoded = decode_aggregate(expected, schema_of(tensors), max_bytes=LIMIT)
    assert torch.equal(decoded["big"].view(torch.int32), big.view(torch.int32))


@pytest.mark.parametrize("precision", ["int8", "int4", "int2"])
def test_a_rounding_a_slab_at_a_time_gives_the_whole_tensors_parts(precision: str) -> None:
    """Rounded slab by slab (in place or not), a tensor of several slabs has the codes,
    scales and rounded values of the whole tensor rounded at once."""
    from p2ptrain.aggregate.aggregate_blob import _QUANTISERS  # the reference quantiser

    generator = torch.Generator().manual_seed(35)
    tensors = {"big": torch.randn(4_500_001, generator=generator), "small": torch.randn(3, 5)}
    quantiser = _QUANTISERS[precision]
    container = {"__aggregate__": torch.tensor(list(b"p2ptrain-aggregate/1"), dtype=torch.uint8)}
    expected_values = {}
    for name, tensor in tensors.items():
        spec = TensorSpec(name, tuple(tensor.shape), "float32")
        parts = quantiser.encoder(spec, 0)(tensor)
        expected_values[name] = quantiser.decode(spec, parts)
        container.update({f"{name}/{part}": value for part, value in parts.items()})
    rounded, blob = settle_aggregate(tensors, precision)
    assert blob == encode_state_dict(container)
    own = {name: tensor.clone() for name, tensor in tensors.items()}
    in_place, again = settle_aggregate(own, precision, in_place=True)
    assert again == blob
    for name, value in expected_values.items():
        assert torch.equal(rounded[name], value) and torch.equal(in_place[name], value), name
        assert torch.equal(own[name], value), name  # overwritten where it lay


def test_a_bf16_aggregate_rounds_to_nearest_even_and_stays_sparse() -> None:
    generator = torch.Generator().manual_seed(20261206)
    big = torch.zeros(300_000)
    big[::50] = torch.randn(6000, generator=generator)  # 2% sent: a sparse codec's union
    big[7] = -0.0
    tensors = {"w": big.reshape(600, 500), "b": torch.randn(10, generator=generator)}
    applied, blob = settle_aggregate(tensors, "bf16")
    for name, tensor in tensors.items():
        assert torch.equal(applied[name], tensor.to(torch.bfloat16).to(torch.float32))
    back = decode_aggregate(bytes(blob), schema_of(tensors), max_bytes=LIMIT, precision="bf16")
    assert all(_same_bits(applied[n], back[n]) for n in tensors)
    parts = decode_state_dict(bytes(blob), max_bytes=LIMIT)
    assert parts["w/values"].dtype == torch.bfloat16
    assert parts["w/values"].numel() == 6001  # -0.0 is stored
    assert parts["b/dense"].dtype == torch.bfloat16
    # 4 bytes a stored value against the fp32 form's 6
    assert len(blob) < 0.7 * len(encode_aggregate(tensors))


def test_a_bf16_aggregate_refuses_float32_values_and_the_reverse() -> None:
    tensors = {"w": _sparse(4096, [1, 2, 3]), "b": torch.randn(10)}
    schema = schema_of(tensors)
    _, half = settle_aggregate(tensors, "bf16")
    full = encode_aggregate(tensors)
    with pytest.raises(ProtocolViolation, match=r"wrong dtypes|is not"):
        decode_aggregate(bytes(full), schema, max_bytes=LIMIT, precision="bf16")
    with pytest.raises(ProtocolViolation, match=r"wrong dtypes|is not"):
        decode_aggregate(bytes(half), schema, max_bytes=LIMIT, precision="fp32")


@pytest.mark.parametrize(("precision", "levels"), [("int8", 127), ("int4", 7)])
def test_a_sparse_aggregate_rounds_only_its_stored_values(precision: str, levels: int) -> None:
    """A sparse codec's aggregate at a rounded precision keeps the sparse positions and
    quantises the stored values alone, in blocks of 256 stored values: fewer bytes than
    bf16's, and the decoder gives back exactly what the outer step applied."""
    from p2ptrain.aggregate.aggregate_blob import _QUANTISERS  # the reference quantiser

    generator = torch.Generator().manual_seed(20261207)
    big = torch.zeros(300_000)
    big[::13] = torch.randn(-(-300_000 // 13), generator=generator)  # ~8%: a 2% union
    big[7] = -0.0  # stored, as in the bf16 form
    tensors = {"w": big.reshape(600, 500), "b": torch.randn(10, generator=generator)}
    applied, blob = settle_aggregate(tensors, precision)
    parts = decode_state_dict(bytes(blob), max_bytes=LIMIT)
    stored = big.view(torch.int32).ne(0).nonzero().reshape(-1)
    assert torch.equal(parts["w/offsets"], (stored % 65536 - 32768).to(torch.int16))
    assert int(parts["w/counts"].sum()) == stored.numel()
    spec = TensorSpec("w", (stored.numel(),), "float32")
    values = _QUANTISERS[precision].encoder(spec, 0)(big[stored])
    for part, value in values.items():
        assert torch.equal(parts[f"w/{part}"], value), part
    first = big[stored][:256]  # by hand: the first block of stored values
    codes = (first / _block_scale(first, levels)).round().clamp(-levels, levels)
    assert torch.equal(applied["w"].reshape(-1)[stored[:256]], codes * _block_scale(first, levels))
    untouched = torch.ones(300_000, dtype=torch.bool)
    untouched[stored] = False
    assert bool(applied["w"].reshape(-1)[untouched].eq(0).all())
    assert "b/counts" not in parts  # dense: every value stored
    back = decode_aggregate(bytes(blob), schema_of(tensors), max_bytes=LIMIT, precision=precision)
    assert all(_same_bits(applied[n], back[n]) for n in tensors)
    assert len(blob) < {"int8": 0.8, "int4": 0.7}[precision] * len(
        settle_aggregate(tensors, "bf16")[1]
    )
    assert settle_aggregate({n: t.clone() for n, t in tensors.items()}, precision)[1] == blob


def test_a_rounded_aggregate_refuses_a_sparse_form_where_dense_is_canonical() -> None:
    tensors = {"w": _sparse(4096, list(range(0, 4096, 13)))}
    schema = schema_of(tensors)
    parts = decode_state_dict(bytes(settle_aggregate(tensors, "int8")[1]), max_bytes=LIMIT)
    half = {n: v for n, v in parts.items() if n != "w/counts"}
    with pytest.raises(ProtocolViolation, match="half sparse"):
        decode_aggregate(bytes(encode_state_dict(half)), schema, max_bytes=LIMIT, precision="int8")
    dense = settle_aggregate({"w": torch.randn(4096)}, "int8")[1]
    everything = decode_state_dict(bytes(dense), max_bytes=LIMIT)
    stored = torch.arange(4096)
    everything["w/counts"] = torch.tensor([4096], dtype=torch.int32)
    everything["w/offsets"] = (stored - 32768).to(torch.int16)
    with pytest.raises(ProtocolViolation, match="sparse where dense is canonical"):
        decode_aggregate(
            bytes(encode_state_dict(everything)), schema, max_bytes=LIMIT, precision="int8"
        )

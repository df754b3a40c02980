"""State dicts to safetensors bytes and back: exact round trips, compatibility with the
official safetensors library, schema hashes, and a decoder that only raises
ProtocolViolation."""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from p2ptrain.bench.tensor_codec import make_state_dict, measure_tensor_codec
from p2ptrain.core.tensors import (
    MAX_HEADER_BYTES,
    SCHEMA_METADATA_KEY,
    SUPPORTED_DTYPES,
    TensorSpec,
    decode_state_dict,
    encode_state_dict,
    schema_hash,
    schema_of,
)
from p2ptrain.errors import LocalError, ProtocolViolation

EXAMPLES = settings(max_examples=1000, deadline=None)

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
ALL_DTYPES = [*FLOATS, *INTS, torch.bool]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Seeded values covering the dtype's range, with NaN, infinities and -0.0 for floats."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype in INTS:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 1e3
    flat = values.view(-1)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0]
    flat[: len(specials)] = torch.tensor(specials[: flat.numel()], dtype=torch.float64)
    return values.to(dtype)


def assert_bit_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, same shape, same bytes (so NaN payloads and -0.0 count)."""
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
    assert torch.equal(as_bytes[0], as_bytes[1])


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_bit_identical(got[name], tensor)


def round_trip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return decode_state_dict(encode_state_dict(state), expected_schema=schema_of(state))


def mixed_state() -> dict[str, torch.Tensor]:
    return {
        f"t.{str(dtype).removeprefix('torch.')}": random_tensor(dtype, (3, 5), seed)
        for seed, dtype in enumerate(ALL_DTYPES)
    }


def build_blob(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    """A safetensors file from a header (dict, or raw bytes to lie with) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def header_of(blob: bytes) -> tuple[dict[str, Any], bytes]:
    length = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def tampered(blob: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    header, data = header_of(blob)
    change(header)
    return build_blob(header, data)


# -------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(dtype: torch.dtype) -> None:
    state = {"matrix": random_tensor(dtype, (17, 9)), "vector": random_tensor(dtype, (5,), 1)}
    got = round_trip(state)
    assert_same_state(got, state)
    if dtype not in FLOATS:
        assert all(torch.equal(got[name], state[name]) for name in state)


def test_supported_dtypes_are_the_tested_ones() -> None:
    assert set(ALL_DTYPES) == SUPPORTED_DTYPES


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_empty_tensors_and_scalars_round_trip(dtype: torch.dtype) -> None:
    state = {
        "empty": torch.empty(0, dtype=dtype),
        "empty_matrix": torch.empty(4, 0, 3, dtype=dtype),
        "scalar": random_tensor(dtype, ()),
        "one": random_tensor(dtype, (1, 1), 2),
    }
    got = round_trip(state)
    assert_same_state(got, state)
    assert got["scalar"].dim() == 0


def test_empty_state_dict_round_trips() -> None:
    assert round_trip({}) == {}


def test_non_contiguous_views_round_trip() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "offset_slice": base.view(-1)[7:19],
        "permuted": torch.arange(24, dtype=torch.int16).reshape(2, 3, 4).permute(2, 0, 1),
    }
    assert not state["transposed"].is_contiguous()
    assert_same_state(round_trip(state), state)


def test_tensors_sharing_storage_round_trip() -> None:
    shared = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    state = {
        "whole": shared,
        "tied": shared,  # the same tensor twice, as tied weights appear in a state dict
        "top": shared[:4],
        "row": shared[5],
        "as_bytes": shared.view(torch.uint8),
    }
    assert_same_state(round_trip(state), state)


def test_module_state_dict_with_parameters_needing_grad() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5))
    state = model.state_dict(keep_vars=True)  # Parameters with requires_grad
    got = round_trip(state)
    assert_same_state(got, {name: value.detach() for name, value in state.items()})
    fresh = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5))
    fresh.load_state_dict(got)
    assert_same_state(fresh.state_dict(), got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_other_devices_are_moved_to_cpu() -> None:
    state = {"gpu": torch.arange(12.0, device="cuda").reshape(3, 4).t()}
    got = round_trip(state)
    assert got["gpu"].device.type == "cpu"
    assert torch.equal(got["gpu"], state["gpu"].cpu())


def test_encoding_is_deterministic_and_ignores_insertion_order() -> None:
    state = mixed_state()
    reversed_state = dict(reversed(list(state.items())))
    assert encode_state_dict(state) == encode_state_dict(reversed_state)
    assert encode_state_dict(state) == encode_state_dict(mixed_state())


def test_decoded_tensors_are_writable_and_independent_of_the_input() -> None:
    state = {"a": torch.ones(64), "b": torch.full((8, 8), 2.0), "c": torch.zeros(3)}
    buffer = bytearray(encode_state_dict(state))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable buffer" warning either
        got = decode_state_dict(buffer)
        got_from_view = decode_state_dict(memoryview(buffer))
        got_from_bytes = decode_state_dict(bytes(buffer))
    buffer[-300:] = bytes(300)  # scribbling on the input changes nothing decoded
    assert_same_state(got, state)
    got["a"].add_(1.0)  # in-place math works and touches nothing else
    got["b"].mul_(3.0)
    assert torch.equal(got["a"], torch.full((64,), 2.0))
    assert_same_state(got_from_view, state)
    assert_same_state(got_from_bytes, state)
    pointers = {tensor.untyped_storage().data_ptr() for tensor in got.values()}
    assert len(pointers) == len(got)  # each tensor owns its storage


def test_blobs_are_copies_that_neither_side_can_change() -> None:
    state = {"w": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.int64)}
    blob = encode_state_dict(state)
    snapshot = bytes(bytearray(blob))
    state["w"].mul_(2.0)  # training goes on after the blob was made
    got = decode_state_dict(blob)
    got["w"].add_(1.0)  # aggregation works in place on what it decoded
    got["b"].zero_()
    assert blob == snapshot
    assert encode_state_dict(state) != blob


def test_decoded_tensors_are_aligned_and_contiguous() -> None:
    got = round_trip(mixed_state())
    for tensor in got.values():
        assert tensor.is_contiguous()
        assert tensor.data_ptr() % 8 == 0


def test_decode_returns_names_in_sorted_order() -> None:
    got = round_trip(
        {"z": torch.ones(1), "a": torch.ones(2, dtype=torch.int64), "m": torch.ones(3)}
    )
    assert list(got) == ["a", "m", "z"]


# ------------------------------------------------------------ official safetensors library


def test_bytes_are_identical_to_the_official_writer() -> None:
    state = mixed_state() | {"scalar": torch.tensor(1.5), "empty": torch.empty(0, 2)}
    official = safetensors.torch.save(
        {name: tensor.contiguous() for name, tensor in state.items()},
        metadata={SCHEMA_METADATA_KEY: schema_hash(state)},
    )
    assert encode_state_dict(state) == official


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(
        st.text(st.characters(exclude_categories=["Cs"]), max_size=12).filter(
            lambda name: name != "__metadata__"
        ),
        max_size=6,
        unique=True,
    ),
    dtypes=st.lists(st.sampled_from(ALL_DTYPES), min_size=6, max_size=6),
)
def test_any_names_give_the_official_bytes(names: list[str], dtypes: list[torch.dtype]) -> None:
    state = {
        name: random_tensor(dtype, (index % 3 + 1,) * (index % 3), index)
        for index, (name, dtype) in enumerate(zip(names, dtypes, strict=False))
    }
    ours = encode_state_dict(state)
    assert ours == safetensors.torch.save(state, metadata={SCHEMA_METADATA_KEY: schema_hash(state)})
    assert_same_state(decode_state_dict(ours, expected_schema=schema_hash(state)), state)


def test_official_reader_reads_our_bytes() -> None:
    state = mixed_state() | {"view": torch.arange(12.0).reshape(3, 4).t()}
    blob = encode_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its tensors alias a read-only buffer and say so
        assert_same_state(safetensors.torch.load(bytes(blob)), state)


def test_we_read_the_official_writers_bytes(tmp_path: Any) -> None:
    state = mixed_state() | {"scalar": torch.tensor(7, dtype=torch.int64)}
    path = tmp_path / "official.safetensors"
    safetensors.torch.save_file(state, path, metadata={SCHEMA_METADATA_KEY: schema_hash(state)})
    assert_same_state(decode_state_dict(path.read_bytes()), state)


def test_official_bytes_without_our_metadata_are_refused() -> None:
    blob = safetensors.torch.save({"w": torch.ones(2)})
    with pytest.raises(ProtocolViolation, match=r"no 'p2ptrain\.schema' metadata"):
        decode_state_dict(blob)


# ------------------------------------------------------------------------------ schema

GOLDEN_SCHEMA_HASH = "42ae4156acf6a3c6abdaa64dc3eae5407323d15c276c04eb24793a082a5ac237"


def test_golden_schema_hash() -> None:
    state = {"fc.weight": torch.zeros(10, 64), "fc.bias": torch.zeros(10)}
    # msgpack by hand: an array of {name, shape, dtype} maps, sorted by name.
    canonical = (
        b"\x92"
        + b"\x83\xa4name\xa7fc.bias\xa5shape\x91\x0a\xa5dtype\xa7float32"
        + b"\x83\xa4name\xa9fc.weight\xa5shape\x92\x0a\x40\xa5dtype\xa7float32"
    )
    assert hashlib.sha256(canonical).hexdigest() == GOLDEN_SCHEMA_HASH
    assert schema_hash(state) == GOLDEN_SCHEMA_HASH
    assert schema_hash(schema_of(state)) == GOLDEN_SCHEMA_HASH
    assert schema_hash(reversed(schema_of(state))) == GOLDEN_SCHEMA_HASH


def test_schema_lists_names_shapes_and_dtypes_sorted() -> None:
    state = {"b": torch.zeros(2, 3, dtype=torch.bfloat16), "a": torch.tensor(True)}
    assert schema_of(state) == (
        TensorSpec("a", (), "bool"),
        TensorSpec("b", (2, 3), "bfloat16"),
    )


def test_schema_hash_depends_on_every_field() -> None:
    base = schema_hash({"w": torch.zeros(2, 3)})
    assert base != schema_hash({"v": torch.zeros(2, 3)})
    assert base != schema_hash({"w": torch.zeros(3, 2)})
    assert base != schema_hash({"w": torch.zeros(2, 3, dtype=torch.float16)})
    assert base == schema_hash({"w": torch.ones(2, 3)})  # values are not part of it


def test_schema_with_duplicate_names_is_refused() -> None:
    spec = TensorSpec("w", (1,), "float32")
    with pytest.raises(LocalError, match="twice"):
        schema_hash([spec, spec])
    with pytest.raises(LocalError, match="TensorSpec"):
        schema_hash(["w"])  # type: ignore[list-item]


# ------------------------------------------------------------------- schema mismatches


def test_expected_schema_hash_mismatch_names_both_hashes() -> None:
    blob = encode_state_dict({"fc.weight": torch.zeros(10, 32)})
    expected = schema_hash({"fc.weight": torch.zeros(10, 64)})
    with pytest.raises(ProtocolViolation) as caught:
        decode_state_dict(blob, expected_schema=expected)
    message = str(caught.value)
    assert expected in message
    assert schema_hash({"fc.weight": torch.zeros(10, 32)}) in message


@pytest.mark.parametrize(
    ("sent", "detail"),
    [
        (
            {"fc.weight": torch.zeros(10, 32), "fc.bias": torch.zeros(10)},
            "parameter 'fc.weight': expected shape (10, 64) float32, got (10, 32) float32",
        ),
        (
            {"fc.weight": torch.zeros(10, 64, dtype=torch.float16), "fc.bias": torch.zeros(10)},
            "parameter 'fc.weight': expected shape (10, 64) float32, got (10, 64) float16",
        ),
        ({"fc.weight": torch.zeros(10, 64)}, "parameter 'fc.bias' is missing"),
        (
            {"fc.weight": torch.zeros(10, 64), "fc.bias": torch.zeros(10), "x": torch.zeros(1)},
            "unexpected parameter 'x' ((1,) float32)",
        ),
    ],
)
def test_expected_schema_mismatch_names_the_first_differing_parameter(
    sent: dict[str, torch.Tensor], detail: str
) -> None:
    expected = schema_of({"fc.weight": torch.zeros(10, 64), "fc.bias": torch.zeros(10)})
    with pytest.raises(ProtocolViolation) as caught:
        decode_state_dict(encode_state_dict(sent), expected_schema=expected)
    assert detail in str(caught.value)
    assert schema_hash(expected) in str(caught.value)


def test_malformed_expected_schema_is_our_error() -> None:
    for blob in (encode_state_dict({"w": torch.zeros(1)}), b"peer garbage"):
        with pytest.raises(LocalError, match="SHA-256"):  # before the bytes are even parsed
            decode_state_dict(blob, expected_schema="not-a-hash")


def test_tampered_metadata_is_detected() -> None:
    blob = encode_state_dict({"w": torch.zeros(4)})
    other = schema_hash({"w": torch.zeros(2, 2)})

    def lie(header: dict[str, Any]) -> None:
        header["__metadata__"][SCHEMA_METADATA_KEY] = other

    with pytest.raises(ProtocolViolation, match="tampered"):
        decode_state_dict(tampered(blob, lie))


def test_header_shape_lie_is_caught_by_the_metadata_hash() -> None:
    blob = encode_state_dict({"w": torch.zeros(4)})

    def reshape(header: dict[str, Any]) -> None:
        header["w"]["shape"] = [2, 2]  # same byte count, different schema

    with pytest.raises(ProtocolViolation, match="tampered"):
        decode_state_dict(tampered(blob, reshape))


def test_missing_metadata_is_refused() -> None:
    blob = encode_state_dict({"w": torch.zeros(4)})
    with pytest.raises(ProtocolViolation, match="metadata"):
        decode_state_dict(tampered(blob, lambda header: header.pop("__metadata__")))


# ----------------------------------------------------------------------- malformed bytes

_F32_META = {"__metadata__": {SCHEMA_METADATA_KEY: schema_hash({"a": torch.zeros(2)})}}


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        (b"", "too short"),
        (b"\x01\x00", "too short"),
        ((1 << 63).to_bytes(8, "little"), "header claims"),
        ((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}", "header claims"),
        (build_blob(b"{}")[:-1], "header claims"),
        (build_blob(b"not json"), "malformed"),
        (build_blob(b"[1, 2]"), "malformed"),
        (
            build_blob(b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}'),
            "malformed",
        ),
        (build_blob({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}), "malformed"),
        (build_blob({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), "malformed"),
        (build_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), "do not fit"),
        (build_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}), "malformed"),
        (build_blob({"a": {"dtype": "F32", "shape": [2]}}), "malformed"),
        (
            build_blob({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}),
            "malformed",
        ),
        (build_blob({"a": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}), "dtype"),
        (build_blob({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), "do not fit"),
        (
            build_blob({"a": {"dtype": "F32", "shape": [2**40] * 3, "data_offsets": [0, 8]}}),
            "absurd",
        ),
        (
            build_blob({"a": {"dtype": "F32", "shape": [1] * 33, "data_offsets": [0, 4]}}),
            "malformed",
        ),
        (build_blob({"a": "F32"}), "malformed"),
        (build_blob({"__metadata__": {"k": 1}}), "malformed"),
        (
            build_blob(
                _F32_META | {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)
            ),
            "cover",
        ),
        (
            build_blob(
                _F32_META | {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12)
            ),
            "cover",
        ),
        (
            build_blob(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                bytes(12),
            ),
            "overlaps",
        ),
        (
            build_blob(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
                },
                bytes(12),
            ),
            "gap",
        ),
        (
            # a duplicated name: the last entry wins and the first one's bytes become a gap
            build_blob(
                b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
                b' "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
                bytes(8),
            ),
            "gap",
        ),
    ],
)
def test_malformed_blobs_are_protocol_violations(blob: bytes, problem: str) -> None:
    with pytest.raises(ProtocolViolation, match=problem):
        decode_state_dict(blob)


def test_bool_bytes_other_than_zero_and_one_are_refused() -> None:
    blob = bytearray(encode_state_dict({"mask": torch.tensor([True, False, True])}))
    blob[-2] = 2
    with pytest.raises(ProtocolViolation, match="bool"):
        decode_state_dict(bytes(blob))


def test_blob_over_max_bytes_is_refused() -> None:
    blob = encode_state_dict({"w": torch.zeros(100)})
    assert decode_state_dict(blob, max_bytes=len(blob))
    with pytest.raises(ProtocolViolation, match="over the limit"):
        decode_state_dict(blob, max_bytes=len(blob) - 1)


def test_padding_and_extra_metadata_from_other_writers_are_accepted() -> None:
    state = {"w": torch.arange(4.0)}
    header: dict[str, Any] = {
        "__metadata__": {SCHEMA_METADATA_KEY: schema_hash(state), "format": "pt"},
        "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    }
    raw = json.dumps(header, indent=2).encode() + b"   "
    assert_same_state(decode_state_dict(build_blob(raw, state["w"].numpy().tobytes())), state)


def test_wrong_argument_types_are_our_error() -> None:
    with pytest.raises(LocalError, match="takes bytes or a contiguous buffer"):
        decode_state_dict("not bytes")  # type: ignore[arg-type]


# -------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(2, dtype=torch.complex64),
        torch.zeros(2, dtype=torch.uint16),
        torch.zeros(2, dtype=torch.float8_e4m3fn),
    ],
    ids=str,
)
def test_unsupported_dtypes_are_refused_with_a_way_out(tensor: torch.Tensor) -> None:
    with pytest.raises(LocalError, match=r"convert it .*float32"):
        encode_state_dict({"w": tensor})


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({1: torch.zeros(1)}, "keys must be str"),
        ({"w": [1.0, 2.0]}, "not a torch.Tensor"),
        ({"w": torch.zeros(3, 3).to_sparse()}, "to_dense"),
        ({"w": torch.zeros(3, device="meta")}, "meta device"),
        ({"__metadata__": torch.zeros(1)}, "reserved"),
        ({"bad\ud800name": torch.zeros(1)}, "not valid text"),
    ],
)
def test_unencodable_state_dicts_are_our_error(state: dict[Any, Any], problem: str) -> None:
    with pytest.raises(LocalError, match=problem):
        encode_state_dict(state)


# ----------------------------------------------------------------------- property tests


def _decodes_or_violates(blob: bytes) -> None:
    """The decoder's one invariant: valid tensors out, or ProtocolViolation; nothing else."""
    try:
        got = decode_state_dict(blob)
    except ProtocolViolation as violation:
        event(
            f"refused: {' '.join(str(violation).split()[:3])}"
        )  # coverage in --hypothesis-show-statistics
        return
    event("decoded")
    assert all(isinstance(tensor, torch.Tensor) for tensor in got.values())
    assert_same_state(decode_state_dict(encode_state_dict(got)), got)


@EXAMPLES
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_protocol_violation(blob: bytes) -> None:
    _decodes_or_violates(blob)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "BOOL", "U8", "C64", "f32", ""]),
        "shape": st.lists(st.integers(-1, 4), max_size=3),
        "data_offsets": st.lists(st.integers(-1, 20), min_size=1, max_size=3),
    }
)


_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64"}
_DTYPE_NAMES |= {"BOOL": "bool", "U8": "uint8"}


def _claim_schema(header: dict[str, Any]) -> None:
    """Put the right schema hash into the metadata, so decoding gets past that check."""
    specs = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPE_NAMES:
            return
        if any(dim < 0 for dim in entry["shape"]):
            return
        specs.append(TensorSpec(name, tuple(entry["shape"]), _DTYPE_NAMES[entry["dtype"]]))
    header["__metadata__"] = {SCHEMA_METADATA_KEY: schema_hash(specs)}


@EXAMPLES
@given(
    header=st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), _ENTRY | _JSON, max_size=3),
    data=st.binary(max_size=64),
    claim_schema=st.booleans(),
)
def test_plausible_headers_only_raise_protocol_violation(
    header: dict[str, Any], data: bytes, claim_schema: bool
) -> None:
    if claim_schema:
        header.pop("__metadata__", None)
        _claim_schema(header)
    _decodes_or_violates(build_blob(json.dumps(header).encode(), data))


_VALID = encode_state_dict(
    {
        "w": torch.arange(6.0).reshape(2, 3),
        "b": torch.tensor([1, 2], dtype=torch.int8),
        "m": torch.tensor([True, False]),
        "s": torch.tensor(3.0, dtype=torch.bfloat16),
    }
)


@EXAMPLES
@given(
    flips=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(1, 255)), max_size=4),
    cut=st.none() | st.integers(0, len(_VALID) - 1),
    insert_at=st.integers(0, len(_VALID)),
    inserted=st.binary(max_size=8),
)
def test_mutated_encodings_decode_or_raise_protocol_violation(
    flips: list[tuple[int, int]], cut: int | None, insert_at: int, inserted: bytes
) -> None:
    blob = bytearray(_VALID)
    for position, mask in flips:
        blob[position] ^= mask
    blob[insert_at:insert_at] = inserted
    _decodes_or_violates(bytes(blob if cut is None else blob[:cut]))


# ---------------------------------------------------------------------------- benchmark


def test_benchmark_reports_every_figure(tmp_path: Any) -> None:
    figures = measure_tensor_codec(size_bytes=1 << 20, repeats=1, workdir=str(tmp_path))
    assert set(figures) >= {
        "safetensors_encode_ratio",
        "safetensors_decode_ratio",
        "safetensors_encode_mb_s",
        "safetensors_decode_mb_s",
        "safetensors_plain_write_mb_s",
        "safetensors_plain_read_mb_s",
    }
    assert all(value > 0 and math.isfinite(value) for value in figures.values())
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself


def test_benchmark_state_dict_is_seeded_and_realistic() -> None:
    state = make_state_dict(4 << 20)
    assert_same_state(make_state_dict(4 << 20), state)
    assert 4 << 20 <= sum(tensor.nbytes for tensor in state.values()) < 6 << 20
    assert 20 <= len(state) <= 80
    assert {tensor.dim() for tensor in state.values()} == {1, 2}

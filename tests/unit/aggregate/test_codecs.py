"""Update codecs: round trips, error bounds, error feedback, bit-exact decoding on any thread
count, and a decoder that only raises ProtocolViolation on hostile bytes."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from p2ptrain.aggregate.codec_lowrank import reconstruct
from p2ptrain.aggregate.codecs import (
    HEADER_TENSOR,
    MAX_ABS_VALUE,
    codec_for,
    decode_update,
    make_encoder,
    max_update_bytes,
)
from p2ptrain.aggregate.exact import flatten
from p2ptrain.aggregate.update_reader import UpdateVector
from p2ptrain.bench.codecs import measure_codecs
from p2ptrain.core.manifests import UPDATE_CODECS, CodecSpec
from p2ptrain.core.tensors import (
    TensorSpec,
    decode_state_dict,
    encode_state_dict,
    schema_hash,
    schema_of,
)
from p2ptrain.errors import LocalError, ProtocolViolation

Tensors = dict[str, torch.Tensor]

SEED = 20240611
TINY = 2.0**-149  # the smallest positive float32 (a subnormal)


def model_delta(seed: int = SEED, scale: float = 1e-2) -> Tensors:
    """A seeded pseudo-gradient of a small CNN+MLP: matrices, biases, a 4-D conv weight, a
    0-d and a 1-element tensor, and sizes that are not multiples of 256."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "conv.weight": (8, 3, 3, 3),
        "conv.bias": (8,),
        "fc1.weight": (40, 72),
        "fc1.bias": (40,),
        "fc2.weight": (10, 40),
        "fc2.bias": (10,),
        "embed.weight": (37, 11),
        "temperature": (),
        "gain": (1,),
    }
    return {
        name: torch.randn(shape, generator=generator).mul_(scale) for name, shape in shapes.items()
    }


def spec_of(name: str, **config: int | float) -> CodecSpec:
    return CodecSpec(name=name, config=dict(config))


def round_trip(spec: CodecSpec, delta: Tensors, seed: int = SEED) -> tuple[bytes, Tensors]:
    schema = schema_of(delta)
    blob = make_encoder(spec, schema, seed=seed).encode(delta)
    return blob, decode_update(blob, spec, schema, max_bytes=max_update_bytes(spec, schema))


def digest(tensors: Tensors) -> str:
    """SHA-256 over the names and bytes of the tensors, in name order."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        sha.update(name.encode())
        sha.update(tensors[name].contiguous().numpy().tobytes())
    return sha.hexdigest()


def tamper(blob: bytes, change: Callable[[Tensors], None]) -> bytes:
    """A blob whose container tensors were edited by ``change`` (a well-formed container)."""
    tensors = decode_state_dict(blob)
    change(tensors)
    return bytes(encode_state_dict(tensors))


def header_tensor(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


# ------------------------------------------------------------------------ round trips


def test_every_manifest_codec_is_implemented() -> None:
    for name in UPDATE_CODECS:
        assert codec_for(CodecSpec(name=name)).name == name


LOSS = {
    "fp32": 0.0,
    "fp16": 1e-3,
    "bf16": 1e-2,
    "int8": 2e-2,
    "int4": 0.3,
}  # relative L2 error bounds


@pytest.mark.parametrize("name", UPDATE_CODECS)
def test_round_trip_gives_fresh_float32_tensors_of_the_schema(name: str) -> None:
    delta = model_delta()
    spec = spec_of(name)
    blob, decoded = round_trip(spec, delta)
    assert list(decoded) == sorted(delta)
    for key, value in decoded.items():
        assert value.dtype == torch.float32 and value.shape == delta[key].shape, key
        assert bool(torch.isfinite(value).all()), key
    buffer = bytearray(blob)
    again = decode_update(buffer, spec, schema_of(delta), max_bytes=len(blob))
    buffer[:] = bytes(len(buffer))  # scribbling on the input changes nothing decoded
    assert digest(again) == digest(decoded)
    pointers = {value.untyped_storage().data_ptr() for value in again.values()}
    assert len(pointers) == len(again)
    for value in again.values():
        value.add_(1.0)  # writable
    if name in LOSS:  # codecs without error feedback are close in one round
        error = math.sqrt(sum(float((decoded[k] - delta[k]).square().sum()) for k in delta))
        norm = math.sqrt(sum(float(delta[k].square().sum()) for k in delta))
        assert error <= LOSS[name] * norm, (name, error / norm)


def test_fp32_is_lossless() -> None:
    delta = model_delta()
    _, decoded = round_trip(spec_of("fp32"), delta)
    assert all(torch.equal(decoded[name], delta[name]) for name in delta)


@pytest.mark.parametrize(
    ("name", "relative", "absolute"), [("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 2.0**-134)]
)
@settings(max_examples=50)
@given(data=st.data())
def test_half_precision_relative_error(
    name: str, relative: float, absolute: float, data: st.DataObject
) -> None:
    bound = 65000.0 if name == "fp16" else MAX_ABS_VALUE
    values = data.draw(
        st.lists(st.floats(-bound, bound, width=32), min_size=1, max_size=300), label="values"
    )
    delta = {"x": torch.tensor(values, dtype=torch.float32)}
    _, decoded = round_trip(spec_of(name), delta)
    x, got = delta["x"].double(), decoded["x"].double()
    assert bool(((got - x).abs() <= x.abs() * relative + absolute).all())


def test_int8_hand_computed() -> None:
    delta = {"w": torch.tensor([1.0, -2.0, 0.5, 127.0, 0.0, 0.0, 0.0, 0.0, 3.0, -1.5])}
    _, decoded = round_trip(spec_of("int8", block_size=4), delta)
    # block 1: scale 1 -> codes 1, -2, round(0.5) = 0 (half to even), 127; block 2 is zero.
    # block 3: absmax 3; 3/127 rounds down in float32, so the scale is the next float32 up
    # (keeping 3/scale <= 127), which puts -1.5/scale just above -63.5: codes 127 and -63.
    nearest = torch.tensor(3.0) / 127
    assert float(nearest) * 127 < 3.0
    scale = torch.nextafter(nearest, torch.tensor(1.0))
    tail = [float(torch.tensor(127.0) * scale), float(torch.tensor(-63.0) * scale)]
    assert decoded["w"].tolist() == [1.0, -2.0, 0.0, 127.0, 0.0, 0.0, 0.0, 0.0, *tail]


def _scale(absmax: torch.Tensor, levels: int) -> torch.Tensor:
    """absmax / levels in float32, one ulp up where that fell below absmax / levels."""
    scale = absmax / levels
    if float(scale.double() * levels) < float(absmax.double()):
        scale = torch.nextafter(scale, torch.tensor(math.inf))
    return scale


def test_int4_and_int2_hand_computed() -> None:
    delta = {"w": torch.tensor([7.0, -3.5, 2.0, -7.0, 0.0, 0.0, 0.4, -0.6, 0.2])}
    schema = schema_of(delta)
    blob, decoded = round_trip(spec_of("int4", block_size=4), delta)
    # block 1: scale 1 -> codes 7, round(-3.5) = -4 (half to even), 2, -7; block 2: absmax
    # 0.6, scale 0.6/7 -> 0, 0, round(4.67) = 5, -7; block 3: 0.2/7 -> code 7
    s2, s3 = _scale(torch.tensor(0.6), 7), _scale(torch.tensor(0.2), 7)
    expected = [7.0, -4.0, 2.0, -7.0, 0.0, 0.0, float(5 * s2), float(-7 * s2), float(7 * s3)]
    assert decoded["w"].tolist() == expected
    parts = decode_state_dict(blob, max_bytes=len(blob))
    # q + 7 packed two a byte, low nibble first: (14, 3), (9, 0), (7, 7), (12, 0), (14, pad 0)
    assert parts["w/codes"].tolist() == [14 | 3 << 4, 9 | 0 << 4, 7 | 7 << 4, 12 | 0, 14]
    _, ternary = round_trip(spec_of("int2", block_size=4), delta)
    # scale = absmax: codes round(x / absmax) in {-1, 0, 1}; -3.5 / 7 = -0.5 rounds to 0
    s2, s3 = torch.tensor(0.6), torch.tensor(0.2)
    assert ternary["w"].tolist() == [
        7.0,
        0.0,
        0.0,
        -7.0,
        0.0,
        0.0,
        float(s2),
        -float(s2),
        float(s3),
    ]
    spec = spec_of("int2", block_size=4)
    good = make_encoder(spec, schema, seed=SEED).encode(delta)
    tampered = decode_state_dict(good, max_bytes=len(good))
    tampered["w/codes"] = tampered["w/codes"].clone()
    tampered["w/codes"][0] |= 3  # code 3 is beyond ±1
    with pytest.raises(ProtocolViolation, match="beyond ±1"):
        decode_update(bytes(encode_state_dict(tampered)), spec, schema, max_bytes=len(good))


@settings(max_examples=300)
@given(
    values=st.lists(st.floats(-MAX_ABS_VALUE, MAX_ABS_VALUE, width=32), min_size=1, max_size=700),
    block_size=st.sampled_from([1, 3, 64, 256, 1000]),
    magnitude=st.sampled_from([1.0, 1e-20, 1e-40, 1e20]),
)
def test_int8_error_is_within_block_absmax_over_127(
    values: list[float], block_size: int, magnitude: float
) -> None:
    x = (
        torch.tensor(values, dtype=torch.float32)
        .mul(magnitude)
        .clamp(-MAX_ABS_VALUE, MAX_ABS_VALUE)
    )
    _, decoded = round_trip(spec_of("int8", block_size=block_size), {"x": x})
    blocks = -(-x.numel() // block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float64)
    padded[: x.numel()] = x.double()
    absmax = padded.view(blocks, block_size).abs().amax(dim=1)
    bound = absmax.repeat_interleave(block_size)[: x.numel()] / 127 + TINY
    error = (decoded["x"].double() - x.double()).abs()
    assert bool((error <= bound).all()), (block_size, magnitude)
    assert bool(decoded["x"][x == 0].eq(0).all())  # zeros (and zero blocks) stay exact


# ---------------------------------------------------------------------- error feedback


def test_topk_hand_computed_with_error_feedback() -> None:
    spec = spec_of("topk", fraction=0.4)
    delta = {"v": torch.tensor([0.1, -3.0, 2.0, 0.5, -0.2])}
    schema = schema_of(delta)
    encoder = make_encoder(spec, schema)
    first = decode_update(encoder.encode(delta), spec, schema, max_bytes=10_000)
    assert first["v"].tolist() == [0.0, -3.0, 2.0, 0.0, 0.0]
    assert encoder.residuals()["v"].tolist() == pytest.approx([0.1, 0.0, 0.0, 0.5, -0.2])
    second = decode_update(encoder.encode({"v": torch.zeros(5)}), spec, schema, max_bytes=10_000)
    assert second["v"].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5, -0.2])
    assert encoder.residuals()["v"].tolist() == pytest.approx([0.1, 0.0, 0.0, 0.0, 0.0])


@settings(max_examples=100)
@given(
    seed=st.integers(0, 2**31),
    rounds=st.integers(1, 5),
    fraction=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
)
def test_topk_decoded_plus_residual_is_exactly_the_input(
    seed: int, rounds: int, fraction: float
) -> None:
    spec = spec_of("topk", fraction=fraction)
    schema = schema_of(model_delta())
    encoder = make_encoder(spec, schema)
    residual: Tensors = {}
    for round_ in range(rounds):
        delta = model_delta(seed + round_, scale=10.0 ** -(round_ % 3))
        acc = {name: value + residual[name] if residual else value for name, value in delta.items()}
        decoded = decode_update(encoder.encode(delta), spec, schema, max_bytes=10**6)
        residual = encoder.residuals()
        for name, value in acc.items():
            assert torch.equal(decoded[name] + residual[name], value), (seed, round_, name)
            kept = decoded[name].ne(0)
            k = max(1, math.ceil(fraction * value.numel()))
            assert int(kept.sum()) <= k, (seed, name)
            if bool(kept.any()) and not bool(kept.all()):  # the largest magnitudes are sent
                smallest_sent = value[kept].abs().min()
                assert bool((value[~kept].abs() <= smallest_sent).all()), (seed, name)


def test_lowrank_error_feedback_and_convergence() -> None:
    generator = torch.Generator().manual_seed(SEED)
    base = torch.randn(64, 48, generator=generator)
    spec = spec_of("lowrank", rank=4)
    schema = schema_of({"w": base, "b": base[0]})
    encoder = make_encoder(spec, schema, seed=SEED)
    sent = torch.zeros_like(base)
    given_ = torch.zeros_like(base)
    errors = {}
    residual = torch.zeros_like(base)
    for round_ in range(1, 81):
        delta = {"w": base + 0.3 * torch.randn(64, 48, generator=generator), "b": base[round_ % 3]}
        decoded = decode_update(encoder.encode(delta), spec, schema, max_bytes=10**6)
        acc = delta["w"] + residual
        residual = encoder.residuals()["w"]
        assert torch.allclose(decoded["w"] + residual, acc, rtol=0, atol=1e-5), (SEED, round_)
        assert torch.equal(decoded["b"], delta["b"])  # vectors travel raw
        sent += decoded["w"]
        given_ += delta["w"]
        errors[round_] = float((given_ - sent).norm() / given_.norm())
    assert errors[1] > 0.5  # one rank-4 round loses most of a full-rank matrix...
    assert errors[80] < 0.15 and errors[80] < errors[20] / 2, (SEED, errors)  # ...feedback not


def test_lowrank_recovers_a_low_rank_matrix_in_one_round() -> None:
    generator = torch.Generator().manual_seed(SEED)
    matrix = torch.randn(50, 3, generator=generator) @ torch.randn(3, 30, generator=generator)
    _, decoded = round_trip(spec_of("lowrank", rank=4), {"w": matrix.reshape(50, 5, 6)})
    assert torch.allclose(decoded["w"].reshape(50, 30), matrix, atol=1e-4), SEED


def test_lowrank_reconstruction_is_the_ordered_sum_of_outer_products() -> None:
    generator = torch.Generator().manual_seed(SEED)
    p, q = torch.randn(33, 5, generator=generator), torch.randn(17, 5, generator=generator)
    expected = p[:, 0:1] * q[:, 0]
    for k in range(1, 5):
        expected = expected + p[:, k : k + 1] * q[:, k]
    assert torch.equal(reconstruct(p, q), expected)
    assert torch.allclose(reconstruct(p, q), p @ q.t(), atol=1e-5)


def test_lowrank_survives_zero_updates() -> None:
    spec = spec_of("lowrank")
    delta = model_delta()
    schema = schema_of(delta)
    encoder = make_encoder(spec, schema)
    zeros = {name: torch.zeros_like(value) for name, value in delta.items()}
    for _ in range(2):
        decoded = decode_update(encoder.encode(zeros), spec, schema, max_bytes=10**6)
        assert all(not bool(value.any()) for value in decoded.values())
    decoded = decode_update(encoder.encode(delta), spec, schema, max_bytes=10**6)
    assert float(decoded["fc1.weight"].norm()) > 0.1 * float(delta["fc1.weight"].norm())


@pytest.mark.parametrize("name", ["topk", "sparseloco", "lowrank"])
def test_encoding_is_deterministic_for_a_seed(name: str) -> None:
    spec = spec_of(name)
    schema = schema_of(model_delta())
    first, second = make_encoder(spec, schema, seed=1), make_encoder(spec, schema, seed=1)
    for round_ in range(3):
        delta = model_delta(SEED + round_)
        assert first.encode(delta) == second.encode(delta), (SEED, round_)
    first.reset()
    assert first.residuals() == {}


# -------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", UPDATE_CODECS)
def test_decoding_gives_the_same_bytes_on_any_thread_count(name: str) -> None:
    delta = model_delta() | {"big.weight": torch.randn(384, 520) * 1e-3, "big.bias": torch.ones(9)}
    spec = spec_of(name)
    schema = schema_of(delta)
    blob = make_encoder(spec, schema).encode(delta)
    threads = torch.get_num_threads()
    digests = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            digests.append(digest(decode_update(blob, spec, schema, max_bytes=len(blob))))
    finally:
        torch.set_num_threads(threads)
    assert digests[0] == digests[1]


GOLDEN_SCHEMA = {"b": (24,), "c": (6, 4, 5), "w": (24, 40)}


def golden_delta() -> Tensors:
    return {name: torch.zeros(shape) for name, shape in GOLDEN_SCHEMA.items()}


def golden_blob(spec: CodecSpec, parts: Tensors) -> bytes:
    """A blob for GOLDEN_SCHEMA whose parts are replaced by machine-independent values."""
    blob = make_encoder(spec, schema_of(golden_delta())).encode(golden_delta())
    return tamper(blob, lambda tensors: tensors.update(parts))


def fractions(count: int, modulus: int, divisor: float) -> torch.Tensor:
    """Seeded-free, machine-independent float32 values: (7 i mod m - m/2) / divisor."""
    return (torch.arange(count) * 7 % modulus - modulus // 2).float() / divisor


@pytest.mark.parametrize(
    ("spec", "parts", "blob_sha", "decoded_sha"),
    [
        (
            spec_of("int8", block_size=64),
            {
                "b/q": (torch.arange(24) * 37 % 255 - 127).to(torch.int8),
                "b/scale": fractions(1, 5, 3.0).abs(),
                "c/q": (torch.arange(120) * 11 % 255 - 127).to(torch.int8).reshape(6, 4, 5),
                "c/scale": fractions(2, 9, 7.0).abs(),
                "w/q": (torch.arange(960) * 53 % 255 - 127).to(torch.int8).reshape(24, 40),
                "w/scale": fractions(15, 13, 3.0).abs(),
            },
            "2ad7cf0ac86ea90ef3b84e8fcc41979dd5d11b2350c6151e791e13ed07cd8371",
            "74f1d499a0c3254242b198b68f6e8067816ad4f76a0f62f2f18b619e54e780c9",
        ),
        (
            spec_of("lowrank", rank=4),
            {
                "b/values": fractions(24, 17, 3.0),
                "c/p": fractions(24, 19, 3.0).reshape(6, 4),
                "c/q": fractions(80, 23, 7.0).reshape(20, 4),
                "w/p": fractions(96, 29, 3.0).reshape(24, 4),
                "w/q": fractions(160, 31, 11.0).reshape(40, 4),
            },
            "12de9ce1dc4a734071e344d44a029c21d19ce0c84adff43963525fbb7f923a18",
            "3a661b16237ddbd75294493c5b01f26657da39dec2859688ca5e8cf172cc2dd9",
        ),
        (
            # whole-tensor top-k, the vector b sparse too: k: b 2, c 6, w 48
            spec_of("sparseloco", fraction=0.05, chunk=0, dense_vectors=0),
            {
                "b/counts": torch.tensor([2], dtype=torch.int32),
                "b/offsets": (torch.tensor([3, 17]) - 32768).to(torch.int16),
                "b/codes": torch.tensor([0b1101], dtype=torch.uint8),
                "b/scale": torch.tensor([0.375]),
                "c/counts": torch.tensor([6], dtype=torch.int32),
                "c/offsets": (torch.arange(6) * 19 + 5 - 32768).to(torch.int16),
                "c/codes": torch.tensor([0xB4, 0x0E], dtype=torch.uint8),
                "c/scale": fractions(1, 9, 7.0).abs(),
                "w/counts": torch.tensor([48], dtype=torch.int32),
                "w/offsets": (torch.arange(48) * 20 + 7 - 32768).to(torch.int16),
                "w/codes": (torch.arange(12) * 37 % 256).to(torch.uint8),
                "w/scale": torch.tensor([1.0]) / 3,
            },
            "0c37952c44534ada0761e5fb8b9cd539a8d9b826257fe8700868b1471868ff5a",
            "c391fa1ee9cf328ed9c8b3320a1a9e24261cb8097ab2e502d85928b91f2f58f2",
        ),
    ],
    ids=["int8", "lowrank", "sparseloco"],
)
def test_golden_decoding(spec: CodecSpec, parts: Tensors, blob_sha: str, decoded_sha: str) -> None:
    """Pins the wire format and the decoding arithmetic: any change breaks old blobs."""
    blob = golden_blob(spec, parts)
    decoded = decode_update(blob, spec, schema_hash(golden_delta()), max_bytes=10**6)
    assert hashlib.sha256(blob).hexdigest() == blob_sha
    assert digest(decoded) == decoded_sha


# ----------------------------------------------------------------------- hostile input

HOSTILE = settings(max_examples=1000)

SMALL = {"a.weight": (12, 16), "a.bias": (12,), "k": (8, 3, 4), "s": ()}
SMALL_SETTINGS: dict[str, dict[str, int | float]] = {
    "topk": {"fraction": 0.1},
    "sparseloco": {"fraction": 0.1, "chunk": 0, "dense_vectors": 0},
}


def small_delta() -> Tensors:
    generator = torch.Generator().manual_seed(SEED)
    return {name: torch.randn(shape, generator=generator) for name, shape in SMALL.items()}


def small_spec(name: str) -> CodecSpec:
    return spec_of(name, **SMALL_SETTINGS.get(name, {}))


VALID = {name: round_trip(small_spec(name), small_delta())[0] for name in UPDATE_CODECS}


def read_streamed(
    blob: bytes | bytearray, spec: CodecSpec, expected: object, span: int = 37
) -> torch.Tensor:
    """The update read span by span (as a reduction reads it: every value once, finite
    checked), flat; ProtocolViolation where the reader refuses it."""
    vector = UpdateVector(blob, spec, expected, max_bytes=1 << 20)  # type: ignore[arg-type]
    parts = []
    for start in range(0, vector.numel(), span):
        values = vector[start : start + span].clone()
        if not bool(torch.isfinite(values).all()):
            raise ProtocolViolation("not finite")
        parts.append(values)
    return torch.cat(parts) if parts else torch.empty(0)


def decodes_or_violates(blob: bytes | bytearray, name: str, by_hash: bool = False) -> None:
    """The decoder's contract: a valid float32 update of the schema, or ProtocolViolation;
    the streamed reader (:class:`UpdateVector`) reaches the same verdict and bits."""
    schema = schema_of(small_delta())
    expected = schema_hash(schema) if by_hash else schema
    try:
        streamed: torch.Tensor | None = read_streamed(blob, small_spec(name), expected)
    except ProtocolViolation:
        streamed = None
    try:
        decoded = decode_update(blob, small_spec(name), expected, max_bytes=1 << 20)
    except ProtocolViolation as exc:
        event(f"violation: {' '.join(str(exc).split()[:3])}")
        assert streamed is None, "the streamed reader took a blob decode_update refuses"
        return
    event("decoded")
    assert streamed is not None, "the streamed reader refused a blob decode_update takes"
    assert torch.equal(flatten(decoded).view(torch.int32), streamed.view(torch.int32))
    assert list(decoded) == sorted(SMALL)
    for key, value in decoded.items():
        assert value.dtype == torch.float32 and tuple(value.shape) == SMALL[key]
        assert bool(torch.isfinite(value).all())


@HOSTILE
@given(data=st.binary(max_size=600), name=st.sampled_from(UPDATE_CODECS))
def test_random_bytes_only_violate(data: bytes, name: str) -> None:
    decodes_or_violates(data, name)


@st.composite
def mutated_blobs(draw: st.DrawFn) -> tuple[str, bytes]:
    name = draw(st.sampled_from(UPDATE_CODECS))
    blob = bytearray(VALID[name])
    # Half the edits land in the last 500 bytes: the codec header lies at the end.
    low = draw(st.sampled_from([0, max(0, len(blob) - 500)]))
    at = draw(st.integers(low, len(blob) - 1))
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]))
    if kind == "flip":
        blob[at] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        del blob[at:]
    elif kind == "insert":
        blob[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif kind == "delete":
        del blob[at : at + draw(st.integers(1, 16))]
    else:
        chunk = draw(st.binary(min_size=1, max_size=16))
        blob[at : at + len(chunk)] = chunk
    return name, bytes(blob)


@HOSTILE
@given(case=mutated_blobs(), by_hash=st.booleans())
def test_mutated_encodings_only_violate(case: tuple[str, bytes], by_hash: bool) -> None:
    name, blob = case
    decodes_or_violates(blob, name, by_hash)


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]
DTYPES += [torch.int16, torch.int8, torch.uint8]
EXTRA_NAMES = ["x/values", "a.bias/q", "a.weight/p2", "s/indices", "k", HEADER_TENSOR + "/values"]


@st.composite
def tampered_containers(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid blob whose container stays well-formed but one tensor is changed: bytes
    overwritten, dtype or shape changed, tensor dropped, or a tensor added."""
    name = draw(st.sampled_from(UPDATE_CODECS))
    tensors = decode_state_dict(VALID[name])
    target = draw(st.sampled_from(sorted(tensors)))
    tensor = tensors[target]
    kind = draw(st.sampled_from(["bytes", "bytes", "retype", "reshape", "drop", "add"]))
    if kind == "bytes" and tensor.numel():
        raw = tensor.reshape(-1).view(torch.uint8)
        for _ in range(draw(st.integers(1, 8))):
            raw[draw(st.integers(0, raw.numel() - 1))] = draw(st.integers(0, 255))
    elif kind == "retype":
        tensors[target] = tensor.to(draw(st.sampled_from(DTYPES)))
    elif kind == "reshape":
        flat = tensor.reshape(-1)
        tensors[target] = draw(st.sampled_from([flat, flat[1:], flat.unsqueeze(0), flat[:0]]))
    elif kind == "drop":
        del tensors[target]
    else:
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=2)))
        tensors[draw(st.sampled_from(EXTRA_NAMES))] = torch.zeros(shape)
    return name, bytes(encode_state_dict(tensors))


@HOSTILE
@given(case=tampered_containers(), by_hash=st.booleans())
def test_tampered_parts_only_violate(case: tuple[str, bytes], by_hash: bool) -> None:
    name, blob = case
    decodes_or_violates(blob, name, by_hash)


Change = Callable[[Tensors], None]


def replace(parts: dict[str, torch.Tensor]) -> Change:
    return lambda tensors: tensors.update(parts)


def edit(name: str, change: Callable[[torch.Tensor], object]) -> Change:
    """Change a container tensor in place, through a flat view."""

    def apply(tensors: Tensors) -> None:
        change(tensors[name].view(-1))

    return apply


def drop(*names: str) -> Change:
    def apply(tensors: Tensors) -> None:
        for name in names:
            del tensors[name]

    return apply


def header_edit(old: str, new: str) -> Change:
    def apply(tensors: Tensors) -> None:
        text = tensors[HEADER_TENSOR].numpy().tobytes().decode()
        assert old in text, (old, text)
        tensors[HEADER_TENSOR] = header_tensor(text.replace(old, new, 1).encode())

    return apply


def set_at(index: int, value: float) -> Callable[[torch.Tensor], object]:
    return lambda flat: flat.__setitem__(index, value)


def swap_first_two(flat: torch.Tensor) -> None:
    flat[[0, 1]] = flat[[1, 0]]


def repeat_first(flat: torch.Tensor) -> None:
    flat[1] = flat[0]


I32 = torch.int32
# (codec, what, change, the message it must raise): k holds 96 values (topk and sparseloco
# keep 10 of them), a.weight 192 (20 kept), a.bias 12 (2 kept), s 1 (1 kept); lowrank
# factorises a.weight and k. sparseloco's 2-bit codes leave 4 spare bits in the last byte of
# k and a.bias and 6 in s's only byte.
U8, I16 = torch.uint8, torch.int16
MALICIOUS: list[tuple[str, str, Change, str]] = [
    ("topk", "index out of range", edit("a.weight/indices", set_at(-1, 192)), "outside"),
    ("topk", "negative index", edit("a.weight/indices", set_at(0, -1)), "outside"),
    ("topk", "huge index", edit("k/indices", set_at(-1, 2**31 - 1)), "outside"),
    ("topk", "unsorted indices", edit("k/indices", swap_first_two), "strictly increasing"),
    ("topk", "duplicate index", edit("k/indices", set_at(1, 0)), "strictly increasing"),
    ("topk", "int64 indices", replace({"k/indices": torch.arange(10)}), "expected"),
    ("topk", "NaN value", edit("k/values", set_at(0, math.nan)), "NaN or infinity"),
    ("topk", "infinite value", edit("s/values", set_at(0, -math.inf)), "NaN or infinity"),
    ("topk", "more values than k", replace({"k/values": torch.ones(11)}), "expected"),
    ("sparseloco", "negative count", edit("k/counts", set_at(0, -1)), "between 0 and"),
    ("sparseloco", "count over the chunk", edit("a.bias/counts", set_at(0, 13)), "between 0"),
    ("sparseloco", "huge count", edit("k/counts", set_at(0, 2**31 - 1)), "between 0 and"),
    ("sparseloco", "counts short of k", edit("k/counts", set_at(0, 9)), "sum to 9, not k = 10"),
    ("sparseloco", "offset past the end", edit("a.weight/offsets", set_at(-1, 192 - 2**15)), "out"),
    ("sparseloco", "largest offset", edit("k/offsets", set_at(-1, 2**15 - 1)), "outside their"),
    ("sparseloco", "unsorted offsets", edit("k/offsets", swap_first_two), "strictly increasing"),
    ("sparseloco", "repeated offset", edit("k/offsets", repeat_first), "strictly increasing"),
    ("sparseloco", "padding bits", edit("s/codes", set_at(0, 0xFF)), "padding bits"),
    ("sparseloco", "last byte's padding", edit("k/codes", set_at(-1, 0xF0)), "padding bits"),
    ("sparseloco", "NaN scale", edit("a.weight/scale", set_at(0, math.nan)), "finite and >= 0"),
    ("sparseloco", "infinite scale", edit("k/scale", set_at(0, math.inf)), "finite and >= 0"),
    ("sparseloco", "negative scale", edit("k/scale", set_at(0, -1.0)), "finite and >= 0"),
    ("sparseloco", "scale -0.0", edit("a.bias/scale", set_at(0, -0.0)), "finite and >= 0"),
    (
        "sparseloco",
        "scale that overflows",
        replace({"s/codes": torch.tensor([1], dtype=U8), "s/scale": torch.tensor([3e38])}),
        "NaN or infinity",
    ),
    ("sparseloco", "int32 offsets", replace({"k/offsets": torch.zeros(10, dtype=I32)}), "exp"),
    ("sparseloco", "a code byte more", replace({"k/codes": torch.zeros(4, dtype=U8)}), "expected"),
    ("sparseloco", "two chunks", replace({"a.weight/counts": torch.zeros(2, dtype=I32)}), "exp"),
    ("sparseloco", "0-d scale", replace({"s/scale": torch.zeros(())}), "expected"),
    ("sparseloco", "int16 codes", replace({"s/codes": torch.zeros(1, dtype=I16)}), "expected"),
    ("sparseloco", "topk parts", replace({"k/indices": torch.arange(10, dtype=I32)}), "unexp"),
    ("sparseloco", "no scale", drop("a.bias/scale"), "missing"),
    ("int8", "NaN scale", edit("a.weight/scale", set_at(0, math.nan)), "finite and >= 0"),
    ("int8", "infinite scale", edit("k/scale", set_at(0, math.inf)), "finite and >= 0"),
    ("int8", "negative scale", edit("k/scale", set_at(0, -1.0)), "finite and >= 0"),
    ("int8", "scale that overflows", edit("k/scale", set_at(0, 3e38)), "NaN or infinity"),
    ("int8", "code -128", edit("k/q", set_at(0, -128)), "-128"),
    ("int8", "int16 codes", replace({"s/q": torch.tensor(1, dtype=torch.int16)}), "expected"),
    ("int8", "float64 scale", replace({"s/scale": torch.ones(1).double()}), "expected"),
    ("int8", "an extra block", replace({"a.weight/scale": torch.ones(2)}), "expected"),
    ("fp32", "infinite value", edit("a.bias/values", set_at(2, math.inf)), "NaN or infinity"),
    ("fp32", "NaN value", edit("s/values", set_at(0, math.nan)), "NaN or infinity"),
    ("fp32", "float64 values", replace({"s/values": torch.tensor(1.0).double()}), "expected"),
    ("fp32", "transposed matrix", replace({"a.weight/values": torch.zeros(16, 12)}), "expected"),
    ("fp16", "infinite value", edit("k/values", set_at(5, math.inf)), "NaN or infinity"),
    ("fp16", "float32 values", replace({"k/values": torch.zeros(8, 3, 4)}), "expected"),
    ("bf16", "NaN value", edit("a.bias/values", set_at(0, math.nan)), "NaN or infinity"),
    ("lowrank", "NaN factor", edit("a.weight/p", set_at(3, math.nan)), "NaN or infinity"),
    (
        "lowrank",
        "overflowing factors",
        replace({"k/p": torch.full((8, 4), 1e20), "k/q": torch.full((12, 4), 1e20)}),
        "NaN or infinity",
    ),
    (
        "lowrank",
        "rank above the matrix",
        replace({"k/p": torch.zeros(8, 9), "k/q": torch.zeros(12, 9)}),
        "expected",
    ),
    ("lowrank", "rank 5 factors", replace({"a.weight/p": torch.zeros(12, 5)}), "expected"),
    ("lowrank", "a factorised vector", replace({"a.bias/p": torch.zeros(12, 1)}), "unexpected"),
    ("lowrank", "a raw matrix", replace({"k/values": torch.zeros(8, 3, 4)}), "unexpected"),
    ("fp32", "extra tensor", replace({"extra/values": torch.zeros(3)}), "unexpected"),
    ("fp32", "extra part", replace({"a.bias/scale": torch.zeros(1)}), "unexpected"),
    ("int8", "missing tensor", drop("a.bias/q"), "missing"),
    ("topk", "missing parameter", drop("s/indices", "s/values"), "missing"),
    ("fp32", "no codec header", drop(HEADER_TENSOR), "codec header"),
    (
        "fp32",
        "int8 header",
        replace({HEADER_TENSOR: torch.zeros(4, dtype=torch.int8)}),
        "codec header",
    ),
    ("fp32", "garbage header", replace({HEADER_TENSOR: header_tensor(b"\xff{")}), "malformed"),
    ("int8", "other codec", header_edit('"int8"', '"fp16"'), "encoded with codec"),
    ("int8", "other block size", header_edit("256", "128"), "encoded with codec"),
    ("int8", "block size as float", header_edit("256", "256.0"), "canonical"),
    ("topk", "other fraction", header_edit("0.1", "0.2"), "encoded with codec"),
    ("lowrank", "higher rank", header_edit('"rank":4', '"rank":9'), "encoded with codec"),
    ("sparseloco", "4-bit header", header_edit('"bits":2', '"bits":4'), "encoded with codec"),
    ("sparseloco", "other fraction", header_edit('"fraction":0.1', '"fraction":0.2'), "encoded"),
    ("sparseloco", "topk header", header_edit('"sparseloco"', '"topk"'), "encoded with codec"),
    ("fp32", "other format", header_edit("update/1", "update/2"), "format"),
    ("fp32", "unknown field", header_edit('{"format"', '{"x":1,"format"'), "malformed"),
    ("fp32", "spaces in header", header_edit(",", ", "), "canonical"),
    ("fp32", "other schema", header_edit("[12,16]", "[16,12]"), "schema"),
    ("fp32", "renamed parameter", header_edit('"s"', '"t"'), "schema"),
    ("fp32", "parameter twice", header_edit('"a.bias"', '"a.weight"'), "schema|twice"),
    ("fp32", "float64 in schema", header_edit("float32", "float64"), "schema"),
    ("fp32", "huge dimension", header_edit("[12,16]", "[123456789012345678901234567,16]"), "malf"),
    ("fp32", "negative dimension", header_edit("[12,16]", "[-12,-16]"), "malformed"),
]


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [(name, change, message) for name, _, change, message in MALICIOUS],
    ids=[f"{name}-{what}" for name, what, _, _ in MALICIOUS],
)
@pytest.mark.parametrize("by_hash", [False, True], ids=["schema", "hash"])
def test_malicious_encodings_are_violations(
    name: str, change: Change, message: str, by_hash: bool
) -> None:
    blob = tamper(VALID[name], change)
    schema = schema_of(small_delta())
    expected = schema_hash(schema) if by_hash else schema
    with pytest.raises(ProtocolViolation, match=message):
        decode_update(blob, small_spec(name), expected, max_bytes=1 << 20)
    with pytest.raises(ProtocolViolation):
        read_streamed(blob, small_spec(name), expected)


def test_blobs_for_another_codec_setting_or_model_are_violations() -> None:
    schema = schema_of(small_delta())
    blob = VALID["int8"]
    for spec in (spec_of("fp16"), spec_of("int8", block_size=128), spec_of("topk")):
        with pytest.raises(ProtocolViolation, match="encoded with codec"):
            decode_update(blob, spec, schema, max_bytes=1 << 20)
    other = schema_of(model_delta())
    with pytest.raises(ProtocolViolation, match="schema"):
        decode_update(blob, spec_of("int8"), other, max_bytes=1 << 20)
    with pytest.raises(ProtocolViolation, match="schema"):
        decode_update(blob, spec_of("int8"), schema_hash(other), max_bytes=1 << 20)


@pytest.mark.parametrize("name", UPDATE_CODECS)
def test_size_limit(name: str) -> None:
    spec, schema = small_spec(name), schema_of(small_delta())
    blob = VALID[name]
    assert len(blob) <= max_update_bytes(spec, schema) <= len(blob) + 4096
    decode_update(blob, spec, schema, max_bytes=len(blob))
    with pytest.raises(ProtocolViolation, match="over the limit"):
        decode_update(blob, spec, schema, max_bytes=len(blob) - 1)


# ------------------------------------------------------------ honest inputs always decode


@settings(max_examples=200)
@given(
    name=st.sampled_from(UPDATE_CODECS),
    values=st.lists(st.floats(-MAX_ABS_VALUE, MAX_ABS_VALUE, width=32), min_size=60, max_size=60),
    rounds=st.integers(1, 3),
)
def test_honest_updates_of_extreme_values_decode(
    name: str, values: list[float], rounds: int
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    if name == "fp16":
        x = x.clamp(-65504, 65504)
    delta = {"m": x.reshape(6, 10), "v": x[:7], "z": x[0]}
    sparse = name in ("topk", "sparseloco")
    spec, schema = spec_of(name, **({"fraction": 0.2} if sparse else {})), schema_of(delta)
    encoder = make_encoder(spec, schema)
    for _ in range(rounds):
        decoded = decode_update(encoder.encode(delta), spec, schema, max_bytes=1 << 20)
        assert all(bool(torch.isfinite(value).all()) for value in decoded.values())


# ------------------------------------------------------------------ compression ratios


@pytest.mark.parametrize(
    ("name", "config", "low", "high"),
    [
        ("fp16", {}, 1.99, 2.0),
        ("bf16", {}, 1.99, 2.0),
        ("int8", {}, 3.9, 4 / (1 + 4 / 256)),  # one float32 scale per 256 int8 codes
        ("int8", {"block_size": 64}, 3.7, 4 / (1 + 4 / 64)),
        ("topk", {}, 45.0, 50.0),  # 1% kept, 8 bytes each (int32 index, float32 value)
        ("topk", {"fraction": 0.1}, 4.9, 5.0),
        # k = 5248 (82 of each 4096) 16-bit offsets and 2-bit codes, counts, a scale: 11828 B
        ("sparseloco", {}, 84.0, 2**20 / 11828),
        # k = 2624: 41 in each of 64 chunks of 4096
        ("sparseloco", {"fraction": 0.01}, 158.0, 2**20 / 5924),
        ("sparseloco", {"bits": 4}, 76.0, 2**20 / 13140),  # 4-bit codes
        ("lowrank", {}, 60.0, 64.0),  # (512 + 512) * 4 values instead of 512 * 512
    ],
)
def test_compression_ratio(
    name: str, config: dict[str, int | float], low: float, high: float
) -> None:
    delta = {"w": torch.randn(512, 512, generator=torch.Generator().manual_seed(SEED))}
    spec = spec_of(name, **config)
    encoder = make_encoder(spec, schema_of(delta))
    encoder.encode(delta)
    ratio = encoder.statistics().compression_ratio
    assert low <= ratio <= high, (name, config, ratio)


# --------------------------------------------------------------------- local misuse


@pytest.mark.parametrize(
    ("name", "config", "key"),
    [
        ("fp16", {"block_size": 8}, "codec.config.block_size"),
        ("int8", {"block": 8}, "codec.config.block"),
        ("int8", {"block_size": 0}, "codec.config.block_size"),
        ("int8", {"block_size": "256"}, "codec.config.block_size"),
        ("int8", {"block_size": 2.5}, "codec.config.block_size"),
        ("int8", {"block_size": True}, "codec.config.block_size"),
        ("topk", {"fraction": 0.0}, "codec.config.fraction"),
        ("topk", {"fraction": 1.5}, "codec.config.fraction"),
        ("lowrank", {"rank": 0}, "codec.config.rank"),
        ("lowrank", {"rank": 4.0}, "codec.config.rank"),
        ("sparseloco", {"fraction": 0.0}, "codec.config.fraction"),
        ("sparseloco", {"fraction": 2}, "codec.config.fraction"),
        ("sparseloco", {"bits": 3}, "codec.config.bits"),
        ("sparseloco", {"bits": 8}, "codec.config.bits"),
        ("sparseloco", {"bits": 2.0}, "codec.config.bits"),
        ("sparseloco", {"rank": 4}, "codec.config.rank"),
    ],
)
def test_bad_settings_name_the_key(
    name: str, config: dict[str, int | float | str], key: str
) -> None:
    with pytest.raises(LocalError, match=key.replace(".", r"\.")):
        make_encoder(CodecSpec(name=name, config=config), schema_of(small_delta()))


def test_schemas_must_be_float32_and_hashes_well_formed() -> None:
    with pytest.raises(LocalError, match="float32"):
        make_encoder(spec_of("int8"), [TensorSpec("step", (), "int64")])
    with pytest.raises(LocalError, match="schema_hash"):
        decode_update(VALID["int8"], spec_of("int8"), "not-a-hash", max_bytes=1 << 20)
    with pytest.raises(LocalError, match="max_bytes"):
        decode_update(VALID["int8"], spec_of("int8"), schema_of(small_delta()), max_bytes=-1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("s"), "missing"),
        (lambda d: d.__setitem__("extra", torch.zeros(1)), "unexpected"),
        (lambda d: d.__setitem__("a.bias", torch.zeros(7)), "shape"),
        (lambda d: d.__setitem__("a.bias", torch.zeros(6, dtype=torch.float64)), "float32"),
        (lambda d: d["k"].view(-1).__setitem__(3, math.nan), "diverged"),
        (lambda d: d["k"].view(-1).__setitem__(3, 1e31), "diverged"),
    ],
)
def test_bad_deltas_are_local_errors_that_change_nothing(
    change: Callable[[Tensors], None], message: str
) -> None:
    spec = spec_of("topk", fraction=0.1)
    schema = schema_of(small_delta())
    encoder = make_encoder(spec, schema)
    encoder.encode(small_delta())
    before, stats = encoder.residuals(), encoder.statistics()
    delta = small_delta()
    change(delta)
    with pytest.raises(LocalError, match=message):
        encoder.encode(delta)
    assert encoder.statistics() == stats
    assert all(torch.equal(encoder.residuals()[k], before[k]) for k in before)


def test_fp16_overflow_is_a_local_error() -> None:
    delta = small_delta()
    delta["k"][0, 0, 0] = 70000.0
    with pytest.raises(LocalError, match="overflows fp16"):
        make_encoder(spec_of("fp16"), schema_of(delta)).encode(delta)


def test_statistics_count_updates_and_bytes() -> None:
    delta = small_delta()
    encoder = make_encoder(spec_of("topk", fraction=0.1), schema_of(delta))
    assert encoder.statistics().compression_ratio == 0.0
    blobs = [encoder.encode(delta) for _ in range(3)]
    stats = encoder.statistics()
    raw = sum(value.nbytes for value in delta.values())
    assert (stats.codec, stats.updates, stats.bytes_in) == ("topk", 3, 3 * raw)
    assert (stats.bytes_out, stats.last_bytes_out) == (sum(map(len, blobs)), len(blobs[-1]))
    assert stats.compression_ratio == pytest.approx(3 * raw / stats.bytes_out)
    residual = encoder.residuals()
    assert stats.residual_norm == pytest.approx(
        math.sqrt(sum(float(r.double().square().sum()) for r in residual.values()))
    )


def test_measure_codecs_reports_every_codec() -> None:
    results = measure_codecs(values=20_000, repeats=1)
    assert sorted(results) == sorted(UPDATE_CODECS)
    for name, figures in results.items():
        assert sorted(figures) == ["compression_ratio", "decode_mb_s", "encode_mb_s"], name
        assert all(value > 0 for value in figures.values()), name
    assert results["fp32"]["compression_ratio"] < 1.0 < results["int8"]["compression_ratio"]

"""The ``sparseloco`` codec: hand-computed parts, blob sizes, error feedback, a decoder that
agrees with a plain-Python reference of docs/protocol.md's rules (and raises nothing but
ProtocolViolation), and the encoder's saved residuals and requeued updates."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from p2ptrain.aggregate.codec_sparseloco import CHUNK_SIZE
from p2ptrain.aggregate.codecs import (
    MAX_ABS_VALUE,
    WARMUP_CODEC,
    UpdateEncoder,
    WindowEncoders,
    codec_at,
    decode_update,
    make_encoder,
    max_update_bytes,
    max_update_bytes_any,
    precision_at,
)
from p2ptrain.core.manifests import CodecSpec
from p2ptrain.core.tensors import decode_state_dict, encode_state_dict, schema_of
from p2ptrain.errors import LocalError, ProtocolViolation

Tensors = dict[str, torch.Tensor]
Parts = dict[str, list[int] | list[float]]

SEED = 20250307
BIAS = 2**15  # offsets are sent as (position within the chunk) - 32768


#: The wire-format tests below take top-k over whole tensors, sparse vectors too, and
#: undecayed error feedback; the published mechanics (chunks, dense vectors, decay) have
#: their own tests at the end.
WHOLE = {"chunk": 0, "dense_vectors": 0, "error_decay": 1.0}


def spec_of(**config: int | float) -> CodecSpec:
    return CodecSpec(name="sparseloco", config={**WHOLE, **config})


def decode(blob: bytes, spec: CodecSpec, delta: Tensors) -> Tensors:
    schema = schema_of(delta)
    return decode_update(blob, spec, schema, max_bytes=max_update_bytes(spec, schema))


def parts_of(blob: bytes, name: str) -> Tensors:
    tensors = decode_state_dict(blob)
    return {
        key.split("/")[1]: value for key, value in tensors.items() if key.startswith(name + "/")
    }


def seeded_delta(seed: int) -> Tensors:
    """Matrices, vectors, a scalar and an empty tensor, as a model's pseudo-gradient."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"w": (64, 48), "emb": (37, 11), "b": (48,), "g": (1,), "t": (), "e": (0, 3)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


# ------------------------------------------------------------------------ hand-computed


def test_two_bit_parts_hand_computed() -> None:
    spec = spec_of(fraction=0.5)
    delta = {"v": torch.tensor([0.1, -3.0, 2.0, 0.5, -0.2, 4.0, 0.0, -1.0])}
    encoder = make_encoder(spec, schema_of(delta))
    blob = encoder.encode(delta)
    # k = 4: positions 1, 2, 5, 7 (magnitudes 3, 2, 4, 1). Levels are 1 or 2 scales. Start at
    # 4 / 2 = 2: levels round(1.5) = 2, 1, 2, round(0.5) = 0 -> 1; least squares gives
    # (3*2 + 2*1 + 4*2 + 1*1) / (4 + 1 + 4 + 1) = 1.7, which keeps the same levels.
    # Codes (sign << 1 | level - 1): 3, 0, 1, 2 -> 3 | 0 << 2 | 1 << 4 | 2 << 6 = 147.
    parts = parts_of(blob, "v")
    assert parts["counts"].tolist() == [4]
    assert (parts["offsets"].long() + BIAS).tolist() == [1, 2, 5, 7]
    assert parts["codes"].tolist() == [147]
    scale = torch.tensor(1.7, dtype=torch.float32)
    assert torch.equal(parts["scale"], scale.reshape(1))
    decoded = decode(blob, spec, delta)["v"]
    s, s2 = float(scale), float(2 * scale)
    assert decoded.tolist() == [0.0, -s2, s, 0.0, 0.0, s2, 0.0, -s]
    assert torch.equal(encoder.residuals()["v"], delta["v"] - decoded)


def test_four_bit_values_on_the_grid_are_exact() -> None:
    spec = spec_of(fraction=1.0, bits=4)
    delta = {"v": torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0]) / 4}
    blob = make_encoder(spec, schema_of(delta)).encode(delta)
    parts = parts_of(blob, "v")
    # scale 8/4/8 = 0.25 fits exactly; codes (sign << 3 | level - 1) 0, 9, 2, 11, 4, 13, 6, 15,
    # two to a byte, the first in the low half.
    assert parts["scale"].tolist() == [0.25]
    assert parts["codes"].tolist() == [0 | 9 << 4, 2 | 11 << 4, 4 | 13 << 4, 6 | 15 << 4]
    assert torch.equal(decode(blob, spec, delta)["v"], delta["v"])


def test_positions_are_sent_per_chunk() -> None:
    numel = 2 * CHUNK_SIZE + 100
    planted = [0, 65535, 65536, 65537, 131071, numel - 1]
    value = torch.zeros(numel)
    value[planted] = torch.tensor([1.0, -2.0, 2.0, 1.0, -1.0, 2.0])
    spec = spec_of(fraction=4e-5)  # k = ceil(5.25) = 6
    delta = {"x": value}
    blob = make_encoder(spec, schema_of(delta)).encode(delta)
    parts = parts_of(blob, "x")
    assert parts["counts"].tolist() == [2, 3, 1]
    assert (parts["offsets"].long() + BIAS).tolist() == [0, 65535, 0, 1, 65535, 99]
    assert parts["scale"].tolist() == [1.0]
    assert torch.equal(decode(blob, spec, delta)["x"], value)


# ------------------------------------------------------------------------ size and density


def test_a_million_values_take_about_one_percent_of_their_float32_bytes() -> None:
    delta = {"w": torch.randn(1000, 1000, generator=torch.Generator().manual_seed(SEED))}
    spec = spec_of(fraction=0.02, bits=2)
    blob = make_encoder(spec, schema_of(delta)).encode(delta)
    decoded = decode(blob, spec, delta)["w"]
    assert int(decoded.ne(0).sum()) == 20_000, SEED
    # 20000 two-byte offsets, 5000 bytes of 2-bit codes, 16 counts and a scale: 45068 bytes,
    # plus the container's framing and codec header.
    payload = 2 * 20_000 + 20_000 * 2 // 8 + 16 * 4 + 4
    assert payload < len(blob) <= payload + 700, len(blob)
    assert len(blob) / delta["w"].nbytes < 0.0115  # measured 45665 bytes, 1.142%
    assert len(blob) <= max_update_bytes(spec, schema_of(delta)) <= len(blob) + 4096


@pytest.mark.parametrize(("fraction", "bits"), [(0.02, 2), (0.01, 2), (0.02, 4), (1.0, 4)])
def test_blob_size_is_fixed_by_the_settings_and_the_schema(fraction: float, bits: int) -> None:
    spec = spec_of(fraction=fraction, bits=bits)
    sizes = set()
    for seed in range(3):
        delta = seeded_delta(SEED + seed)
        if seed == 2:
            delta = {name: torch.zeros_like(value) for name, value in delta.items()}
        sizes.add(len(make_encoder(spec, schema_of(delta)).encode(delta)))
    assert len(sizes) == 1, sizes


def test_first_round_sends_the_largest_values_at_their_nearest_level() -> None:
    delta = seeded_delta(SEED)
    for bits in (2, 4):
        spec = spec_of(fraction=0.05, bits=bits)
        blob = make_encoder(spec, schema_of(delta)).encode(delta)
        decoded = decode(blob, spec, delta)
        for name, value in delta.items():
            flat, got = value.reshape(-1), decoded[name].reshape(-1)
            k = max(1, math.ceil(0.05 * flat.numel())) if flat.numel() else 0
            kept = got.ne(0)
            assert int(kept.sum()) == k, (SEED, name)
            if not k:
                continue
            if k < flat.numel():
                assert float(flat[~kept].abs().max()) <= float(flat[kept].abs().min()), SEED
            assert torch.equal(got[kept].sign(), flat[kept].sign()), (SEED, name)
            scale = float(parts_of(blob, name)["scale"])
            levels = (flat[kept].abs().double() / scale).round().clamp(1, 2 ** (bits - 1))
            assert torch.equal(got[kept].abs(), (levels.float() * scale)), (SEED, name, bits)


# ------------------------------------------------------------------------ error feedback


def test_what_is_not_sent_now_is_sent_later() -> None:
    generator = torch.Generator().manual_seed(SEED)
    delta = {
        "w": torch.randn(80, 60, generator=generator),
        "b": torch.randn(60, generator=generator),
    }
    spec = spec_of(fraction=0.05)
    encoder = make_encoder(spec, schema_of(delta))
    sent = {name: torch.zeros_like(value, dtype=torch.float64) for name, value in delta.items()}
    errors = {}
    for rounds in range(1, 201):
        decoded = decode(encoder.encode(delta), spec, delta)
        residual = encoder.residuals()
        total = 0.0
        for name, value in delta.items():
            sent[name] += decoded[name].double()
            # Everything given so far is either sent or held in the residual.
            held = sent[name] + residual[name].double()
            assert torch.allclose(held, rounds * value.double(), atol=1e-4 * rounds), SEED
            total += float((sent[name] / rounds - value.double()).square().sum())
        norm = math.sqrt(sum(float(value.double().square().sum()) for value in delta.values()))
        errors[rounds] = math.sqrt(total) / norm
    # Measured: 0.848 after one round, 0.167 after 50, 0.043 after 200: the error of the
    # mean falls as 1 / rounds, as a bounded residual makes it.
    assert errors[1] > 0.8  # one round sends 5% of the values...
    assert errors[200] < 0.06 and errors[200] < errors[50] / 3, (SEED, errors[50], errors[200])


def test_a_zero_update_sends_what_was_held_back() -> None:
    spec = spec_of(fraction=0.5, bits=4)
    delta = {"v": torch.tensor([8.0, 4.0, -2.0, 1.0])}
    encoder = make_encoder(spec, schema_of(delta))
    first = decode(encoder.encode(delta), spec, delta)["v"]
    assert first.tolist() == [8.0, 4.0, 0.0, 0.0]  # scale 1, levels 8 and 4: exact
    second = decode(encoder.encode({"v": torch.zeros(4)}), spec, delta)["v"]
    assert second.tolist() == [0.0, 0.0, -2.0, 1.0]
    assert not bool(encoder.residuals()["v"].any())


# ------------------------------------------------------------ restarts and requeued updates


def save_and_load(encoder: UpdateEncoder) -> Tensors:
    """The residuals as a file would keep them: through a safetensors container."""
    return decode_state_dict(encode_state_dict(encoder.residuals()))


@pytest.mark.parametrize("name", ["sparseloco", "topk"])
def test_a_restarted_encoder_continues_bit_for_bit(name: str) -> None:
    spec = CodecSpec(name=name, config={"fraction": 0.05})
    schema = schema_of(seeded_delta(SEED))
    running = make_encoder(spec, schema, seed=1)
    for round_ in range(3):
        running.encode(seeded_delta(SEED + round_))
    restarted = make_encoder(spec, schema, seed=1)
    restarted.load_residuals(save_and_load(running))
    for round_ in range(3, 7):
        delta = seeded_delta(SEED + round_)
        assert running.encode(delta) == restarted.encode(delta), (SEED, round_)
    fresh = make_encoder(spec, schema, seed=1)
    assert fresh.encode(seeded_delta(SEED)) != running.encode(seeded_delta(SEED))


def test_loading_copies_and_an_empty_mapping_means_none() -> None:
    spec = spec_of(fraction=0.05)
    delta = seeded_delta(SEED)
    encoder = make_encoder(spec, schema_of(delta))
    encoder.encode(delta)
    saved = encoder.residuals()
    other = make_encoder(spec, schema_of(delta))
    other.load_residuals(saved)
    saved["w"].add_(1.0)  # the caller's tensors are not kept
    assert torch.equal(other.residuals()["w"], encoder.residuals()["w"])
    other.load_residuals({})
    assert other.residuals() == {}
    assert other.encode(delta) == make_encoder(spec, schema_of(delta)).encode(delta)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("b"), r"missing \['b'\]"),
        (lambda r: r.__setitem__("other.weight", torch.zeros(2)), "unexpected.*other.weight"),
        (lambda r: r.__setitem__("w", torch.zeros(48, 64)), "'w' has shape"),
        (lambda r: r.__setitem__("b", torch.zeros(48).double()), "'b' must be a float32 tensor"),
        (lambda r: r.__setitem__("t", torch.tensor(math.nan)), "'t' holds NaN"),
        (lambda r: r["w"].view(-1).__setitem__(7, -math.inf), "'w' holds NaN"),
        (lambda r: r["w"].view(-1).__setitem__(7, 1e31), "'w' holds NaN"),
        (lambda r: r.__setitem__("b", [0.0] * 48), "'b' must be a float32 tensor"),
    ],
)
def test_bad_saved_residuals_are_local_errors_that_change_nothing(
    change: Callable[[Tensors], object], message: str
) -> None:
    delta = seeded_delta(SEED)
    encoder = make_encoder(spec_of(fraction=0.05), schema_of(delta))
    encoder.encode(delta)
    before = encoder.residuals()
    saved = encoder.residuals()
    change(saved)
    with pytest.raises(LocalError, match=message) as caught:
        encoder.load_residuals(saved)
    assert "delete the saved residuals" in str(caught.value)
    after = encoder.residuals()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_a_codec_without_feedback_takes_no_residuals() -> None:
    delta = seeded_delta(SEED)
    encoder = make_encoder(CodecSpec(name="int8"), schema_of(delta))
    encoder.load_residuals({})
    with pytest.raises(LocalError, match="codec int8 keeps no error-feedback residuals"):
        encoder.load_residuals({"w": torch.zeros(64, 48)})


@pytest.mark.parametrize("name", ["sparseloco", "topk", "lowrank"])
def test_requeueing_adds_back_exactly_what_was_sent(name: str) -> None:
    spec = CodecSpec(name=name)
    schema = schema_of(seeded_delta(SEED))
    encoder = make_encoder(spec, schema, seed=SEED)
    encoder.encode(seeded_delta(SEED))
    blob = encoder.encode(seeded_delta(SEED + 1))
    before = encoder.residuals()
    sent = decode_update(blob, spec, schema, max_bytes=len(blob))
    encoder.requeue_unaccepted(blob)
    after = encoder.residuals()
    assert all(torch.equal(after[key], before[key] + sent[key]) for key in sent), (SEED, name)
    if name == "topk":  # topk's residual is exact: requeueing restores the accumulated input
        fresh = make_encoder(spec, schema)
        fresh.encode(seeded_delta(SEED))
        acc = {key: seeded_delta(SEED + 1)[key] + value for key, value in fresh.residuals().items()}
        assert all(torch.equal(after[key], acc[key]) for key in acc), SEED


def test_a_requeued_update_is_sent_again() -> None:
    """A window lost: the trainer's two updates minus the accepted one, plus the residual,
    are all of its deltas; zero updates then drain the requeued one."""
    spec = spec_of(fraction=0.1)
    first, second = seeded_delta(SEED), seeded_delta(SEED + 1)
    encoder = make_encoder(spec, schema_of(first))
    lost = encoder.encode(first)
    accepted = decode(encoder.encode(second), spec, first)
    encoder.requeue_unaccepted(lost)
    zeros = {name: torch.zeros_like(value) for name, value in first.items()}
    drained = {name: value.double() for name, value in accepted.items()}
    for _ in range(60):
        for name, value in decode(encoder.encode(zeros), spec, first).items():
            drained[name] += value.double()
    for name in first:
        given_ = first[name].double() + second[name].double()
        left = encoder.residuals()[name].double()
        assert torch.allclose(drained[name] + left, given_, atol=1e-5), (SEED, name)
        error = float((drained[name] - given_).norm())
        assert error <= 0.05 * float(given_.norm()) + 1e-6, (SEED, name, error)


def test_requeueing_without_feedback_does_nothing() -> None:
    delta = seeded_delta(SEED)
    encoder = make_encoder(CodecSpec(name="int8"), schema_of(delta))
    encoder.requeue_unaccepted(encoder.encode(delta))
    encoder.requeue_unaccepted(b"not even a blob")
    assert encoder.residuals() == {}


def foreign_blobs() -> dict[str, bytes]:
    delta = seeded_delta(SEED)
    schema = schema_of(delta)
    mine = make_encoder(spec_of(fraction=0.05), schema).encode(delta)
    smaller = {name: value for name, value in delta.items() if name != "b"}
    return {
        "other bits": make_encoder(spec_of(fraction=0.05, bits=4), schema).encode(delta),
        "other codec": make_encoder(CodecSpec(name="topk"), schema).encode(delta),
        "other model": make_encoder(spec_of(fraction=0.05), schema_of(smaller)).encode(smaller),
        "truncated": mine[:-10],
        "garbage": b"\x00" * 64,
    }


@pytest.mark.parametrize("what", sorted(foreign_blobs()))
def test_requeueing_a_foreign_blob_is_a_local_error_that_changes_nothing(what: str) -> None:
    delta = seeded_delta(SEED)
    encoder = make_encoder(spec_of(fraction=0.05), schema_of(delta))
    encoder.encode(delta)
    before = encoder.residuals()
    with pytest.raises(LocalError, match="not one of this encoder's"):
        encoder.requeue_unaccepted(foreign_blobs()[what])
    after = encoder.residuals()
    assert all(torch.equal(after[name], before[name]) for name in before)


# ------------------------------------------------------------ decoding against a reference

# (numel, fraction): empty, single elements, one short chunk, exactly one chunk, a chunk and
# one element, and three chunks; k = 0, 1, 4, 30, 7, 7 and 14.
SHAPES = [(0, 0.5), (1, 0.5), (7, 0.5), (300, 0.1), (65536, 1e-4), (65537, 1e-4), (140_000, 1e-4)]
GOOD_SCALES = [0.0, 0.5, 1.5, 2.0**-149, 1e38, 3e38]  # the last two may overflow
BAD_SCALES = [-0.0, math.nan, math.inf, -math.inf, -1.0, -(2.0**-149)]


def kept(numel: int, fraction: float) -> int:
    return min(numel, max(1, math.ceil(fraction * numel))) if numel else 0


def chunk_lengths(numel: int) -> list[int]:
    return [min(CHUNK_SIZE, numel - start) for start in range(0, numel, CHUNK_SIZE)]


def reference_decode(numel: int, k: int, bits: int, parts: Parts) -> np.ndarray | None:
    """docs/protocol.md's sparseloco rules in plain Python; None for a non-canonical encoding.
    The only float arithmetic is numpy's float32 product (m + 1) * scale."""
    counts, offsets, codes = parts["counts"], parts["offsets"], parts["codes"]
    scale = np.float32(parts["scale"][0])
    lengths = chunk_lengths(numel)
    if not math.isfinite(scale) or math.copysign(1.0, scale) < 0:
        return None
    if any(not 0 <= count <= length for count, length in zip(counts, lengths, strict=True)):
        return None
    if sum(counts) != k:
        return None
    positions, at = [], 0
    for chunk, count in enumerate(counts):
        previous = -1
        for _ in range(int(count)):
            within = int(offsets[at]) + BIAS
            at += 1
            if within >= lengths[chunk] or within <= previous:
                return None
            previous = within
            positions.append(chunk * CHUNK_SIZE + within)
    per_byte, mask = 8 // bits, (1 << bits) - 1
    unpacked = [int(byte) >> (bits * j) & mask for byte in codes for j in range(per_byte)]
    if any(unpacked[k:]):
        return None
    dense = np.zeros(numel, dtype=np.float32)
    top = 1 << (bits - 1)
    with np.errstate(over="ignore"):
        for position, code in zip(positions, unpacked, strict=False):
            magnitude = np.float32(code % top + 1) * scale
            dense[position] = -magnitude if code >= top else magnitude
    return dense if bool(np.isfinite(dense).all()) else None


@functools.cache
def honest_blob(numel: int, fraction: float, bits: int) -> bytes:
    delta = {"x": torch.zeros(numel)}
    return make_encoder(spec_of(fraction=fraction, bits=bits), schema_of(delta)).encode(delta)


@st.composite
def near_canonical_parts(
    draw: st.DrawFn,
) -> tuple[int, float, int, Parts]:
    """Parts of the right shapes and dtypes, often canonical and often a little off."""
    numel, fraction = draw(st.sampled_from(SHAPES))
    bits = draw(st.sampled_from([2, 4]))
    k, lengths = kept(numel, fraction), chunk_lengths(numel)
    counts = []
    if draw(st.booleans()):  # a valid split of k over the chunks
        left = k
        for index, length in enumerate(lengths):
            room = sum(lengths[index + 1 :])
            counts.append(draw(st.integers(max(0, left - room), min(length, left))))
            left -= counts[-1]
    else:
        counts = draw(
            st.lists(st.integers(-2, CHUNK_SIZE + 2), min_size=len(lengths), max_size=len(lengths))
        )
    offsets: list[int] = []
    if sum(counts) == k and all(
        0 <= c <= length for c, length in zip(counts, lengths, strict=True)
    ):
        for count, length in zip(counts, lengths, strict=True):
            chosen = draw(
                st.lists(st.integers(0, length - 1), min_size=count, max_size=count, unique=True)
            )
            offsets += [offset - BIAS for offset in sorted(chosen)]
    else:
        offsets = draw(st.lists(st.integers(-BIAS, BIAS - 1), min_size=k, max_size=k))
    if k >= 2:
        at = draw(st.integers(0, k - 2))
        kind = draw(st.sampled_from(["none", "none", "swap", "repeat", "set"]))
        if kind == "swap":
            offsets[at], offsets[at + 1] = offsets[at + 1], offsets[at]
        elif kind == "repeat":
            offsets[at + 1] = offsets[at]
        elif kind == "set":
            offsets[at] = draw(st.integers(-BIAS, BIAS - 1))
    size = -(-k * bits // 8)
    codes = list(draw(st.binary(min_size=size, max_size=size)))
    if codes and draw(st.booleans()):  # clear the spare bits
        used = k * bits - (size - 1) * 8
        codes[-1] &= (1 << used) - 1
    good = st.sampled_from(GOOD_SCALES) | st.floats(0.0, 2.0**100, width=32)
    bad = st.sampled_from(BAD_SCALES) | st.floats(width=32)
    scale = draw(st.one_of(good, good, good, bad))
    return (
        numel,
        fraction,
        bits,
        {"counts": counts, "offsets": offsets, "codes": codes, "scale": [scale]},
    )


def as_tensors(parts: Parts) -> Tensors:
    return {
        "x/counts": torch.tensor(parts["counts"], dtype=torch.int32),
        "x/offsets": torch.tensor(parts["offsets"], dtype=torch.int16),
        "x/codes": torch.tensor(parts["codes"], dtype=torch.uint8),
        "x/scale": torch.tensor(parts["scale"], dtype=torch.float32),
    }


@settings(max_examples=400)
@given(case=near_canonical_parts())
def test_the_decoder_agrees_with_the_reference(
    case: tuple[int, float, int, Parts],
) -> None:
    numel, fraction, bits, parts = case
    tensors = decode_state_dict(honest_blob(numel, fraction, bits))
    tensors.update(as_tensors(parts))
    blob = bytes(encode_state_dict(tensors))
    spec = spec_of(fraction=fraction, bits=bits)
    schema = schema_of({"x": torch.zeros(numel)})
    expected = reference_decode(numel, kept(numel, fraction), bits, parts)
    try:
        decoded = decode_update(blob, spec, schema, max_bytes=1 << 22)["x"]
    except ProtocolViolation as exc:
        event(f"violation: {' '.join(str(exc).split()[:3])}")
        assert expected is None, str(exc)
        return
    event("decoded")
    assert expected is not None
    assert decoded.numpy().view(np.int32).tolist() == expected.view(np.int32).tolist()


# ------------------------------------------------------------------- honest encodings


@settings(max_examples=200)
@given(
    values=st.lists(st.floats(-MAX_ABS_VALUE, MAX_ABS_VALUE, width=32), min_size=1, max_size=300),
    magnitude=st.sampled_from([1.0, 1e-30, 1e-42, 1e25]),
    fraction=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
    bits=st.sampled_from([2, 4]),
    rounds=st.integers(1, 3),
)
def test_honest_encodings_decode_and_never_lose_more_than_sending_nothing(
    values: list[float], magnitude: float, fraction: float, bits: int, rounds: int
) -> None:
    x = torch.tensor(values).mul(magnitude).clamp(-MAX_ABS_VALUE, MAX_ABS_VALUE)
    delta = {"x": x, "y": x.flip(0)[:5].reshape(-1, 1)}
    spec = spec_of(fraction=fraction, bits=bits)
    encoder = make_encoder(spec, schema_of(delta))
    residual: Tensors = {}
    for _ in range(rounds):
        acc = {name: value + residual[name] if residual else value for name, value in delta.items()}
        decoded = decode(encoder.encode(delta), spec, delta)
        residual = encoder.residuals()
        for name, value in acc.items():
            got = decoded[name]
            assert torch.equal(residual[name], value - got)
            flat, sent = value.reshape(-1).double(), got.reshape(-1).double()
            sending = sent.ne(0)
            assert int(sending.sum()) <= kept(flat.numel(), fraction)
            if bool(sending.any()) and not bool(sending.all()):
                assert float(flat[~sending].abs().max()) <= float(flat[sending].abs().min())
            signed = sending & flat.ne(0)  # a kept zero goes out as +scale
            assert bool((sent[signed].sign() == flat[signed].sign()).all())
            lost = float((flat - sent).square().sum())
            assert lost <= float(flat.square().sum()) * (1 + 1e-6)


# ------------------------------------------------------------ the published mechanics


def published(**config: int | float) -> CodecSpec:
    """The codec with its defaults: chunked top-k, dense vectors, decayed feedback."""
    return CodecSpec(name="sparseloco", config=dict(config))


def test_top_k_is_taken_inside_each_chunk() -> None:
    # the second chunk's values are a hundred times larger: whole-tensor top-k would spend
    # every kept value there, the chunked one keeps 82 (2% of 4096) in each chunk and 2 of
    # the 100-value tail
    generator = torch.Generator().manual_seed(SEED)
    value = torch.randn(8292, generator=generator).reshape(2, 4146)
    value.view(-1)[4096:8192] *= 100
    delta = {"w": value}
    spec = published()
    blob = make_encoder(spec, schema_of(delta)).encode(delta)
    positions = decode(blob, spec, delta)["w"].reshape(-1).ne(0).nonzero().reshape(-1)
    assert torch.bincount(positions // 4096, minlength=3).tolist() == [82, 82, 2]
    first = value.reshape(-1)[:4096].abs()
    assert set(positions[:82].tolist()) == set(torch.topk(first, 82).indices.tolist())


def test_a_blob_that_moves_a_value_to_another_chunk_is_refused() -> None:
    generator = torch.Generator().manual_seed(SEED)
    delta = {"w": torch.randn(4, 2048, generator=generator)}  # two selection chunks
    spec = published(fraction=0.01)  # 41 of each 4096
    blob = make_encoder(spec, schema_of(delta)).encode(delta)
    tensors = decode_state_dict(blob)
    offsets = tensors["w/offsets"].clone()
    # the first chunk's last position moves into the second chunk: still increasing, the
    # counts still sum to k, but the first chunk now keeps 40 and the second 42
    offsets[40] = 4096 + int(offsets[40] + BIAS) % 2 - BIAS
    assert int(offsets[40]) < int(offsets[41])
    tensors["w/offsets"] = offsets
    with pytest.raises(ProtocolViolation, match="41 values in each chunk of 4096"):
        decode(bytes(encode_state_dict(tensors)), spec, delta)


def test_vectors_are_sent_dense_as_int8() -> None:
    delta = seeded_delta(SEED)
    spec = published()
    blob = make_encoder(spec, schema_of(delta)).encode(delta)
    for name in ("b", "g", "t"):
        assert set(parts_of(blob, name)) == {"q", "scale"}, name
    assert set(parts_of(blob, "w")) == {"counts", "offsets", "codes", "scale"}
    decoded = decode(blob, spec, delta)
    # int8: every element sent, within half a step of 1/127 of the block's largest magnitude
    step = float(delta["b"].abs().max()) / 127
    assert float((decoded["b"] - delta["b"]).abs().max()) <= step / 2 + 1e-6


def test_the_residual_decays_by_error_decay() -> None:
    generator = torch.Generator().manual_seed(SEED)
    delta = {"w": torch.randn(64, 64, generator=generator)}
    spec = published(error_decay=0.5)
    encoder = make_encoder(spec, schema_of(delta))
    encoder.encode(delta)
    held = encoder.residuals()["w"]
    zero = {"w": torch.zeros(64, 64)}
    blob = encoder.encode(zero)
    # what the second round compresses is half what the first held back
    sent = decode(blob, spec, delta)["w"]
    assert torch.equal(encoder.residuals()["w"], held * 0.5 - sent)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"chunk": 1000}, "codec.config.chunk"),
        ({"chunk": 1 << 17}, "codec.config.chunk"),
        ({"dense_vectors": 2}, "codec.config.dense_vectors"),
        ({"error_decay": 0.0}, "codec.config.error_decay"),
        ({"error_decay": 1.5}, "codec.config.error_decay"),
        ({"dense_windows": -1}, "codec.config.dense_windows"),
        ({"dense_windows": 1.5}, "codec.config.dense_windows"),
    ],
)
def test_bad_mechanics_settings_name_their_key(config: dict[str, int | float], key: str) -> None:
    with pytest.raises(LocalError, match=key):
        make_encoder(published(**config), schema_of(seeded_delta(SEED)))


# ------------------------------------------------------------------ the dense warm-up


def test_the_warm_up_windows_use_dense_int4() -> None:
    spec = published(dense_windows=3)
    assert [codec_at(spec, w).name for w in (1, 2, 3, 4, 50)] == [
        "int4",
        "int4",
        "int4",
        "sparseloco",
        "sparseloco",
    ]
    assert codec_at(published(), 1) == published()
    assert codec_at(CodecSpec(name="int8"), 1) == CodecSpec(name="int8")
    schema = schema_of(seeded_delta(SEED))
    assert max_update_bytes_any(spec, schema) == max(
        max_update_bytes(spec, schema), max_update_bytes(WARMUP_CODEC, schema)
    )


def test_the_warm_up_aggregates_are_rounded_to_int4() -> None:
    spec = published(dense_windows=2)
    assert [precision_at(spec, "bf16", w) for w in (1, 2, 3)] == ["int4", "int4", "bf16"]
    assert precision_at(published(), "bf16", 1) == "bf16"  # no warm-up
    assert precision_at(CodecSpec(name="int4"), "fp32", 1) == "fp32"  # not a sparse codec


def test_a_trainer_switches_encoders_after_the_warm_up() -> None:
    delta = seeded_delta(SEED)
    spec = published(dense_windows=2)
    encoders = WindowEncoders(spec, schema_of(delta), seed=3)
    assert encoders.at(1) is encoders.at(2)
    assert not encoders.feeds_back(2)
    warm = encoders.at(2).encode(delta)
    schema = schema_of(delta)
    decode_update(warm, WARMUP_CODEC, schema, max_bytes=max_update_bytes(WARMUP_CODEC, schema))
    with pytest.raises(ProtocolViolation):
        decode(warm, spec, delta)  # a warm-up blob is not a sparse one
    sparse = encoders.at(3)
    assert encoders.feeds_back(3)
    assert sparse.codec.name == "sparseloco"
    assert sparse.residuals() == {}  # the warm-up left nothing to feed back
    decode(sparse.encode(delta), spec, delta)

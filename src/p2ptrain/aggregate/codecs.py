"""Update codecs: pseudo-gradients to compact bytes and back (DESIGN §4, steps 3-4).

A trainer encodes its pseudo-gradient ``delta = theta_base - theta_local`` (a dict of float32
tensors, one per parameter of the model schema) with the experiment's :class:`CodecSpec` into
an update blob; reducers and validators decode blobs from untrusted peers.

Wire format
-----------
An update blob is a safetensors container written by
:func:`p2ptrain.core.tensors.encode_state_dict` (no pickle; its ``__metadata__`` carries the
schema hash of the container's own tensors). It holds:

``__codec__``        uint8, 1-D: the *codec header*, UTF-8 JSON in canonical form (these
                     fields in this order, settings keys sorted, no spaces)::

                         {"format":"p2ptrain-update/1","codec":"int8",
                          "config":{"block_size":256},
                          "schema":[{"name":"fc.bias","shape":[10],"dtype":"float32"},
                                    ...]}

                     ``config`` is the codec's complete settings, defaults filled in;
                     ``schema`` is the model schema (sorted by name, all float32), so
                     ``schema_hash(schema)`` is the manifest's model schema hash.
``<param>/<part>``   the parts of each parameter, for every parameter of the schema:

=========== ===================== ============================================== ===========
codec       part                  shape                                          dtype
=========== ===================== ============================================== ===========
fp32        ``values``            the parameter's                                float32
fp16        ``values``            the parameter's                                float16
bf16        ``values``            the parameter's                                bfloat16
int8        ``q``                 the parameter's                                int8
int8        ``scale``             ``(ceil(numel / block_size),)``                float32
int4, int2  ``codes``             ``(ceil(numel * bits / 8),)``, bits 4 or 2     uint8
int4, int2  ``scale``             ``(ceil(numel / block_size),)``                float32
topk        ``indices``           ``(k,)``, ``k = max(1, ceil(fraction*numel))`` int32 [#]_
topk        ``values``            ``(k,)``                                       float32
lowrank     ``p``, ``q``          ``(rows, r)``, ``(cols, r)`` [#]_              float32
lowrank     ``values`` (raw)      the parameter's                                float32
sparseloco  ``counts``            ``(ceil(numel / 65536),)``                     int32
sparseloco  ``offsets``           ``(k,)``, ``k`` summed over chunks [#]_        int16
sparseloco  ``codes``             ``(ceil(k * bits / 8),)``                      uint8
sparseloco  ``scale``             ``(1,)``                                       float32
=========== ===================== ============================================== ===========

.. [#] int64 for tensors of ``2**31`` elements or more; ``k = 0`` for empty tensors.
.. [#] ``rows = shape[0]``, ``cols = prod(shape[1:])``, ``r = min(rank, rows, cols)``, for
   tensors with ``ndim >= 2`` whose factors are smaller than the matrix; others go raw.
.. [#] ``max(1, ceil(fraction * m))`` of each selection chunk of ``m = chunk`` elements (the
   last may be shorter); positions within 65536-element chunks, minus 32768; ``counts`` says
   how many fall in each chunk; ``codes`` packs a ``bits``-bit code (sign, level) per kept
   value. Tensors with fewer than two dimensions go as ``int8`` (``dense_vectors = 1``), and
   the windows of the dense warm-up (``dense_windows``) as ``int4`` (:func:`codec_at`),
   their aggregate rounded to ``int4`` too (:func:`precision_at`).

The codec and the schema fix every part's name, shape and dtype, so an honest blob's layout
is fully determined and a decoder checks it exactly. The part values are specified in
:mod:`~p2ptrain.aggregate.codec_dense`, :mod:`~p2ptrain.aggregate.codec_sparse`,
:mod:`~p2ptrain.aggregate.codec_lowrank` and :mod:`~p2ptrain.aggregate.codec_sparseloco`.

Decoding
--------
:func:`decode_update` accepts a blob only if the header is byte-for-byte the canonical header
of the expected codec settings and model schema, the container holds exactly the expected
parts, and every value is valid (int8 codes in ±127, int4/int2 codes in ±7/±1 with zero
padding bits, scales finite and >= 0, top-k indices
strictly increasing and in range; sparseloco counts within their chunks and summing to k,
offsets inside their chunk and strictly increasing within it, code padding bits zero; every
decoded value finite). Anything else raises :class:`ProtocolViolation`, and nothing else.
Decoding uses only elementwise float32 ops, so every machine gets the same bits. Encoding
(:class:`UpdateEncoder`) is deterministic for a given seed on a given machine; ``topk``,
``sparseloco`` and ``lowrank`` keep an error-feedback residual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Final, Protocol

import msgspec
import torch

from p2ptrain.aggregate.codec_dense import CastCodec, Int8Codec, PackedQuantCodec
from p2ptrain.aggregate.codec_encoder import MAX_ABS_VALUE, EncoderStatistics, UpdateEncoder
from p2ptrain.aggregate.codec_lowrank import LowRankCodec
from p2ptrain.aggregate.codec_sparse import TopKCodec
from p2ptrain.aggregate.codec_sparseloco import SELECTION_CHUNK, SparseLoCoCodec
from p2ptrain.aggregate.exact import all_finite
from p2ptrain.core.manifests import CodecSpec, ConfigValue
from p2ptrain.core.tensors import MAX_NDIM, Schema, TensorSpec, decode_state_dict, schema_hash
from p2ptrain.errors import LocalError, ProtocolViolation

__all__ = [
    "HEADER_TENSOR",
    "MAX_ABS_VALUE",
    "WARMUP_CODEC",
    "WARMUP_PRECISION",
    "WIRE_FORMAT",
    "EncoderStatistics",
    "ParameterCodec",
    "UpdateEncoder",
    "WindowEncoders",
    "codec_at",
    "codec_for",
    "decode_update",
    "make_encoder",
    "max_update_bytes",
    "max_update_bytes_any",
    "precision_at",
]

HEADER_TENSOR: Final = "__codec__"
"""Name of the codec header tensor; parameter parts always contain a '/'."""

WIRE_FORMAT: Final = "p2ptrain-update/1"
"""Version tag of this wire format, inside the codec header."""

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class ParameterCodec(Protocol):
    """How one codec encodes and decodes a single parameter (see the codec_* modules)."""

    @property
    def name(self) -> str: ...

    @property
    def error_feedback(self) -> bool:
        """True when the encoder must keep a residual of what it did not send."""
        ...

    def settings(self) -> dict[str, int | float]:
        """The codec's complete settings, as the header carries them."""
        ...

    def layout(self, spec: TensorSpec) -> Layout:
        """Part suffix -> (shape, dtype) of an honest encoding of a parameter."""
        ...

    def encoder(
        self, spec: TensorSpec, seed: int
    ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """A (possibly stateful) function from the parameter's float32 value to its parts."""
        ...

    def decode(self, spec: TensorSpec, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 value from parts matching :meth:`layout`; checks values, bit-exact."""
        ...


# --------------------------------------------------------------------------------- registry


def _setting(spec: CodecSpec, key: str, kind: type[int] | type[float], default: float) -> float:
    value: ConfigValue = spec.config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        wanted = "a number" if kind is float else "an integer"
        raise LocalError(f"codec.config.{key} must be {wanted}, got {value!r}")
    return value


def _cast(spec: CodecSpec) -> ParameterCodec:
    return CastCodec(spec.name)


def _int8(spec: CodecSpec) -> ParameterCodec:
    return Int8Codec(block_size=int(_setting(spec, "block_size", int, 256)))


def _packed(spec: CodecSpec) -> ParameterCodec:
    return PackedQuantCodec(spec.name, block_size=int(_setting(spec, "block_size", int, 256)))


def _topk(spec: CodecSpec) -> ParameterCodec:
    return TopKCodec(fraction=float(_setting(spec, "fraction", float, 0.01)))


def _sparseloco(spec: CodecSpec) -> ParameterCodec:
    return SparseLoCoCodec(
        fraction=float(_setting(spec, "fraction", float, 0.02)),
        bits=int(_setting(spec, "bits", int, 2)),
        chunk=int(_setting(spec, "chunk", int, SELECTION_CHUNK)),
        dense_vectors=int(_setting(spec, "dense_vectors", int, 1)),
        error_decay=float(_setting(spec, "error_decay", float, 0.95)),
        dense_windows=int(_setting(spec, "dense_windows", int, 0)),
    )


def _lowrank(spec: CodecSpec) -> ParameterCodec:
    return LowRankCodec(rank=int(_setting(spec, "rank", int, 4)))


_REGISTRY: Final[dict[str, tuple[tuple[str, ...], Callable[[CodecSpec], ParameterCodec]]]] = {
    "fp32": ((), _cast),
    "fp16": ((), _cast),
    "bf16": ((), _cast),
    "int8": (("block_size",), _int8),
    "int4": (("block_size",), _packed),
    "int2": (("block_size",), _packed),
    "topk": (("fraction",), _topk),
    "lowrank": (("rank",), _lowrank),
    "sparseloco": (
        ("bits", "chunk", "dense_vectors", "dense_windows", "error_decay", "fraction"),
        _sparseloco,
    ),
}


def codec_for(spec: CodecSpec) -> ParameterCodec:
    """The codec a manifest names, with its settings checked (:class:`LocalError` naming
    ``codec.config.<key>`` for an unknown key or a bad value)."""
    keys, build = _REGISTRY[spec.name]
    for key in sorted(spec.config):
        if key not in keys:
            known = ", ".join(keys) if keys else "none"
            raise LocalError(
                f"codec.config.{key} is not a setting of codec {spec.name!r} (settings: {known})"
            )
    return build(spec)


WARMUP_CODEC: Final = CodecSpec(name="int4")
"""The codec of a ``sparseloco`` experiment's dense warm-up windows."""

WARMUP_PRECISION: Final = "int4"
"""The ``aggregation.precision`` of a ``sparseloco`` experiment's dense warm-up windows."""


def codec_at(spec: CodecSpec, window: int) -> CodecSpec:
    """The codec updates of ``window`` use: ``spec``, except in the dense warm-up of a
    ``sparseloco`` codec (windows ``1 .. dense_windows``: :data:`WARMUP_CODEC`)."""
    codec = codec_for(spec)
    if isinstance(codec, SparseLoCoCodec) and window <= codec.dense_windows:
        return WARMUP_CODEC
    return spec


def precision_at(spec: CodecSpec, precision: str, window: int) -> str:
    """The precision ``window``'s aggregate is rounded to and stored at: ``precision``
    (``aggregation.precision``), except in the dense warm-up of a ``sparseloco`` codec,
    which is the dense recipe's: int4 updates make a dense aggregate, rounded to
    :data:`WARMUP_PRECISION` (a quarter of a dense bf16 aggregate's bytes)."""
    if codec_at(spec, window) is WARMUP_CODEC and codec_for(spec).name != WARMUP_CODEC.name:
        return WARMUP_PRECISION
    return precision


def max_update_bytes_any(spec: CodecSpec, schema: Iterable[TensorSpec]) -> int:
    """:func:`max_update_bytes` of the largest codec any window of ``spec`` uses."""
    limit = max_update_bytes(spec, schema)
    codec = codec_for(spec)
    if isinstance(codec, SparseLoCoCodec) and codec.dense_windows:
        limit = max(limit, max_update_bytes(WARMUP_CODEC, schema))
    return limit


# ------------------------------------------------------------------------ format


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The codec header: format tag, codec, its complete settings and the model schema."""

    format: str
    codec: str
    config: dict[str, int | float]
    schema: tuple[TensorSpec, ...]


_Dim = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


class _PeerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A schema entry as a peer sent it: same JSON as TensorSpec, with bounded fields."""

    name: str
    shape: Annotated[tuple[_Dim, ...], msgspec.Meta(max_length=MAX_NDIM)]
    dtype: str


class _PeerHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A codec header as a peer sent it."""

    format: str
    codec: str
    config: dict[str, int | float]
    schema: tuple[_PeerSpec, ...]


_HEADER_ENCODER: Final = msgspec.json.Encoder(order="deterministic")
_HEADER_DECODER: Final = msgspec.json.Decoder(_PeerHeader)


def header_bytes(codec: ParameterCodec, schema: Schema) -> bytes:
    """The canonical codec header of ``codec`` over ``schema`` (sorted by name)."""
    return _HEADER_ENCODER.encode(_Header(WIRE_FORMAT, codec.name, codec.settings(), schema))


def model_schema(schema: Iterable[TensorSpec]) -> Schema:
    """``schema`` sorted by name; :class:`LocalError` unless its entries are uniquely named
    float32 TensorSpecs (pseudo-gradients are float32)."""
    specs = tuple(schema)
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise LocalError(f"a schema holds TensorSpec records, not {type(spec).__name__}")
        if spec.dtype != "float32":
            raise LocalError(
                f"parameter {spec.name!r} is {spec.dtype}; codecs carry float32 "
                "pseudo-gradients, so leave other entries out of the schema"
            )
    schema_hash(specs)  # LocalError on a repeated name
    return tuple(sorted(specs, key=lambda spec: spec.name))


def part_layout(codec: ParameterCodec, schema: Schema) -> Layout:
    """Every parameter part of an honest blob: container name -> (shape, dtype)."""
    layout: Layout = {}
    for spec in schema:
        for part, shape_dtype in codec.layout(spec).items():
            layout[f"{spec.name}/{part}"] = shape_dtype
    return layout


def max_update_bytes(spec: CodecSpec, schema: Iterable[TensorSpec]) -> int:
    """A safe ``max_bytes`` for :func:`decode_update`: the exact tensor bytes of an honest
    blob plus an upper bound on its safetensors header."""
    codec, model = codec_for(spec), model_schema(schema)
    layout = part_layout(codec, model)
    layout[HEADER_TENSOR] = ((len(header_bytes(codec, model)),), torch.uint8)
    data = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())
    # Per entry: the name JSON-escaped (at most 6 bytes a character), dtype, shape, offsets.
    entries = sum(6 * len(name) + 128 + 24 * len(shape) for name, (shape, _) in layout.items())
    return 8 + 256 + entries + data


def make_encoder(spec: CodecSpec, schema: Iterable[TensorSpec], *, seed: int = 0) -> UpdateEncoder:
    """An encoder for the manifest's codec over the model schema (float32 entries only).

    ``seed`` fixes the encoder's randomness (the ``lowrank`` warm start). Raises
    :class:`LocalError` for bad settings or schemas.
    """
    codec, model = codec_for(spec), model_schema(schema)
    limit = max_update_bytes(spec, model)
    return UpdateEncoder(
        codec,
        model,
        header_name=HEADER_TENSOR,
        header=header_bytes(codec, model),
        seed=seed,
        error_decay=codec.error_decay if isinstance(codec, SparseLoCoCodec) else 1.0,
        decode=lambda blob: decode_update(blob, spec, model, max_bytes=limit),
    )


# ----------------------------------------------------------------------------- decoder


def decode_update(
    data: bytes | bytearray | memoryview,
    codec: CodecSpec,
    schema: Iterable[TensorSpec] | str,
    *,
    max_bytes: int,
) -> dict[str, torch.Tensor]:
    """Decode an update blob from a peer into float32 tensors, keyed and sorted by name.

    ``schema`` is the model schema (float32 entries), or its hash as the manifest carries it
    (the blob's header then supplies the schema, checked against the hash). Raises
    :class:`ProtocolViolation`, and nothing else, for any bad blob (see the module docstring);
    :class:`LocalError` for bad arguments. Every tensor is fresh, writable CPU memory.
    """
    param_codec = codec_for(codec)
    expected = expected_schema(schema)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise LocalError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
    tensors = decode_state_dict(data, max_bytes=max_bytes)
    raw = tensors.pop(HEADER_TENSOR, None)
    if raw is None or raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ProtocolViolation(f"update has no 1-D uint8 {HEADER_TENSOR!r} codec header")
    model = read_codec_header(raw.numpy().tobytes(), param_codec, expected)
    found = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    check_parts(found, part_layout(param_codec, model), param_codec.name)
    decoded = {}
    for spec in model:
        parts = {part: tensors[f"{spec.name}/{part}"] for part in param_codec.layout(spec)}
        value = param_codec.decode(spec, parts)
        if not all_finite(value):
            raise ProtocolViolation(
                f"update parameter {spec.name!r} decodes to NaN or infinity "
                f"({param_codec.name} parts that are non-finite or overflow float32)"
            )
        decoded[spec.name] = value
    return decoded


def expected_schema(schema: Iterable[TensorSpec] | str) -> Schema | str:
    if not isinstance(schema, str):
        return model_schema(schema)
    if len(schema) != 64 or schema.strip("0123456789abcdef"):
        raise LocalError(f"schema {schema!r:.80} is neither a schema nor a schema_hash(...)")
    return schema


def read_codec_header(text: bytes, codec: ParameterCodec, expected: Schema | str) -> Schema:
    """The model schema from a peer's codec header (the ``__codec__`` tensor's bytes), after
    checking the header is exactly the canonical one for ``codec`` and the expected schema
    (or schema hash)."""
    try:
        header = _HEADER_DECODER.decode(text)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolViolation(f"malformed update codec header: {exc}") from None
    if header.format != WIRE_FORMAT:
        raise ProtocolViolation(
            f"update format {header.format!r:.80} is not {WIRE_FORMAT!r}; upgrade p2ptrain"
        )
    if header.codec != codec.name or header.config != codec.settings():
        raise ProtocolViolation(
            f"update was encoded with codec {header.codec!r:.40} {header.config!r:.80}; "
            f"the experiment uses {codec.name!r} {codec.settings()!r}"
        )
    claimed = tuple(TensorSpec(spec.name, spec.shape, spec.dtype) for spec in header.schema)
    schema = _check_schema(claimed, expected)
    if text != header_bytes(codec, schema):
        raise ProtocolViolation("update codec header is not in canonical form")
    return schema


def _check_schema(claimed: Schema, expected: Schema | str) -> Schema:
    if isinstance(expected, str):
        names = [spec.name for spec in claimed]
        if len(set(names)) != len(names):
            raise ProtocolViolation("update codec header names a parameter twice")
        if schema_hash(claimed) != expected:
            raise ProtocolViolation(
                f"update is for model schema {schema_hash(claimed)}, not {expected}: the "
                "sender trains a different model or revision"
            )
        for spec in claimed:  # the hash matched: a schema the experiment signed
            if spec.dtype != "float32":
                raise ProtocolViolation(f"parameter {spec.name!r:.80} is not a float32 tensor")
        return tuple(sorted(claimed, key=lambda spec: spec.name))
    if claimed != expected:
        raise ProtocolViolation(f"update model schema differs: {_difference(expected, claimed)}")
    return expected


def _difference(expected: Schema, claimed: Schema) -> str:
    """Names the first parameter where two schemas disagree."""
    want = {spec.name: spec for spec in expected}
    have = {spec.name: spec for spec in claimed}
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            return f"parameter {name!r:.80} is missing"
        if name not in want:
            return f"unexpected parameter {name!r:.80}"
        if want[name] != have[name]:
            return f"{name!r:.80}: expected {want[name].describe()}, got {have[name].describe()}"
    return "parameters are out of order or repeated"


def check_parts(found: Layout, layout: Layout, codec: str) -> None:
    """The container (its parts' shapes and dtypes, ``found``) must hold exactly the parts
    of ``layout``, with their shapes and dtypes."""
    missing = sorted(layout.keys() - found.keys())
    extra = sorted(found.keys() - layout.keys())
    if missing or extra:
        raise ProtocolViolation(
            f"{codec} update parts do not match the schema: missing {_names(missing)}, "
            f"unexpected {_names(extra)}"
        )
    for name, (shape, dtype) in layout.items():
        found_shape, found_dtype = found[name]
        if found_dtype != dtype or tuple(found_shape) != shape:
            raise ProtocolViolation(
                f"{codec} update part {name!r:.80} is {tuple(found_shape)} {found_dtype}; "
                f"expected {shape} {dtype}"
            )


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(name)[:60] for name in names[:3])
    return f"[{shown}{', ...' if len(names) > 3 else ''}]"


class WindowEncoders:
    """The encoder of each window's codec (:func:`codec_at`) for one trainer: one
    :class:`UpdateEncoder`, built again (with empty residuals) when the codec changes, at
    the end of a dense warm-up."""

    def __init__(self, spec: CodecSpec, schema: Iterable[TensorSpec], *, seed: int = 0) -> None:
        self._spec, self._schema, self._seed = spec, model_schema(schema), seed
        self._at: CodecSpec | None = None
        self._encoder: UpdateEncoder | None = None

    def at(self, window: int) -> UpdateEncoder:
        """The encoder of ``window``'s updates."""
        spec = codec_at(self._spec, window)
        if self._encoder is None or spec != self._at:
            self._encoder = make_encoder(spec, self._schema, seed=self._seed)
            self._at = spec
        return self._encoder

    def feeds_back(self, window: int) -> bool:
        """Whether ``window``'s codec keeps error-feedback residuals."""
        return codec_for(codec_at(self._spec, window)).error_feedback

"""The trainer side of the update codecs: :class:`UpdateEncoder`, which turns successive
pseudo-gradients into update blobs and keeps error-feedback residuals and warm starts.

Build one with :func:`p2ptrain.aggregate.codecs.make_encoder`; the wire format is described
in :mod:`p2ptrain.aggregate.codecs`.

Error feedback (``topk``, ``sparseloco``, ``lowrank``): the encoder compresses
``acc = delta + decay * residual`` (``decay`` is ``sparseloco``'s ``error_decay``, 1 for the
others) and keeps ``residual = acc - decoded``, where ``decoded`` is exactly
what every decoder will get from the blob. What is not sent in one round is sent in a later
one; for ``topk`` the identity ``decoded + residual == acc`` holds bit for bit.

The rules the trainer follows, so that nothing it computed is lost
------------------------------------------------------------------
The residual is meant to hold every delta computed so far minus what the certified chain
accepted of them. Two events break that, and each has its call:

* **An update the head did not accept.** When the trainer learns that the certified head of a
  window does not include its update (it missed the window, or the update was rejected or
  screened out), it calls :meth:`UpdateEncoder.requeue_unaccepted` with that update's blob,
  exactly once: the blob is decoded with this encoder's codec and schema and added back into
  the residuals, so what it carried is sent again later rather than lost. Never for an update
  the head accepted (it would be applied twice), and only for a blob whose encoding the
  residuals remember: one encoded since the last :meth:`UpdateEncoder.reset`, by this
  encoder or by the one whose saved residuals it loaded. Codecs without error feedback
  ignore it: their unaccepted updates are lost, as they always were.
* **A restart.** The trainer saves :meth:`UpdateEncoder.residuals` with its other state (and
  the blobs of its updates whose fate it has not learned yet) and gives them to
  :meth:`UpdateEncoder.load_residuals` of the new encoder (same codec, schema and seed), which
  then continues bit for bit where the old one stopped (``topk`` and ``sparseloco``;
  ``lowrank`` restarts its warm start from the seed). When training restarts from a
  different head, :meth:`UpdateEncoder.reset` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import torch

from p2ptrain.core.tensors import Schema, encode_state_dict
from p2ptrain.errors import LocalError, ProtocolViolation

if TYPE_CHECKING:
    from p2ptrain.aggregate.codecs import ParameterCodec

__all__ = ["MAX_ABS_VALUE", "EncoderStatistics", "UpdateEncoder"]

MAX_ABS_VALUE: Final = 2.0**100
"""Largest pseudo-gradient magnitude an encoder accepts (about 1.3e30, exact in float32);
beyond it training has diverged, and codecs could overflow float32 while decoding."""


@dataclass(frozen=True, slots=True)
class EncoderStatistics:
    """What an :class:`UpdateEncoder` has done so far.

    ``bytes_in`` counts the float32 bytes of the deltas encoded, ``bytes_out`` the blob bytes
    produced; ``compression_ratio`` is their quotient (0 before the first update).
    ``residual_norm`` is the L2 norm of the error-feedback residual (0 without feedback).
    """

    codec: str
    updates: int
    bytes_in: int
    bytes_out: int
    last_bytes_out: int
    compression_ratio: float
    residual_norm: float


class UpdateEncoder:
    """Encodes one trainer's successive pseudo-gradients with one codec.

    ``header`` is the canonical codec header tensor of ``codec`` over ``schema`` (sorted by
    name) and ``header_name`` its name in the container; ``seed`` fixes the codec's
    randomness; ``decode`` is the peers' decoder of this codec and schema (raising
    :class:`ProtocolViolation`); ``error_decay`` scales the residual before it is added to
    the next delta (``sparseloco``'s setting; 1 keeps it whole). Use
    :func:`p2ptrain.aggregate.codecs.make_encoder` rather than this.
    """

    def __init__(
        self,
        codec: ParameterCodec,
        schema: Schema,
        *,
        header_name: str,
        header: bytes,
        seed: int,
        decode: Callable[[bytes], dict[str, torch.Tensor]],
        error_decay: float = 1.0,
    ) -> None:
        self._codec = codec
        self._decay = error_decay
        self._decode = decode
        self._schema = schema
        self._header_name = header_name
        self._header = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._encoders = {spec.name: codec.encoder(spec, seed) for spec in schema}
        self._residuals: dict[str, torch.Tensor] = {}
        self._updates = self._bytes_in = self._bytes_out = self._last_bytes_out = 0

    @property
    def codec(self) -> ParameterCodec:
        return self._codec

    @property
    def schema(self) -> Schema:
        return self._schema

    def encode(self, delta: Mapping[str, torch.Tensor]) -> bytes:
        """The update blob of ``delta`` (one float32 tensor per schema entry, any device).

        Raises :class:`LocalError`, changing no state, for missing or extra names, wrong
        shapes or dtypes, and NaN, infinities or magnitudes over :data:`MAX_ABS_VALUE`.
        """
        values = self._checked(delta)
        container = {self._header_name: self._header}
        residuals: dict[str, torch.Tensor] = {}
        for spec in self._schema:
            value = values[spec.name]
            if self._codec.error_feedback and spec.name in self._residuals:
                held = self._residuals[spec.name]
                value = value + (held if self._decay == 1.0 else held * self._decay)
            parts = self._encoders[spec.name](value)
            if self._codec.error_feedback:
                residuals[spec.name] = value - self._codec.decode(spec, parts)
            for part, tensor in parts.items():
                container[f"{spec.name}/{part}"] = tensor
        blob = bytes(encode_state_dict(container))
        self._residuals.update(residuals)
        self._updates += 1
        self._bytes_in += sum(value.nbytes for value in values.values())
        self._bytes_out += len(blob)
        self._last_bytes_out = len(blob)
        return blob

    def _checked(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The delta's tensors on the CPU, after checking them against the schema."""
        return self._schema_tensors(
            delta,
            "delta",
            mismatch="pass one tensor per schema parameter",
            fix="",
            beyond="local training diverged; lower the inner learning rate or restart from "
            "the head",
        )

    def _schema_tensors(
        self,
        tensors: Mapping[str, torch.Tensor],
        what: str,
        *,
        mismatch: str,
        fix: str,
        beyond: str,
    ) -> dict[str, torch.Tensor]:
        """Fresh CPU copies of ``tensors``, one finite float32 tensor of the schema's shape
        per schema parameter, or :class:`LocalError` naming the first that is not (``what``:
        the tensors' name in the message; ``fix``: what to do, after every message)."""
        expected = {spec.name for spec in self._schema}
        missing, extra = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
        if missing or extra:
            raise LocalError(
                f"{what} does not match the model schema: missing {missing[:5]}, "
                f"unexpected {extra[:5]}; {mismatch}{fix}"
            )
        values = {}
        for spec in self._schema:
            value = tensors[spec.name]
            if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                raise LocalError(f"{what} {spec.name!r} must be a float32 tensor{fix}")
            if tuple(value.shape) != spec.shape:
                raise LocalError(
                    f"{what} {spec.name!r} has shape {tuple(value.shape)}; "
                    f"the schema says {spec.shape}{fix}"
                )
            value = value.detach().to("cpu", copy=True)
            if not bool(value.abs().le(MAX_ABS_VALUE).all()):
                raise LocalError(
                    f"{what} {spec.name!r} holds NaN, infinity or values beyond "
                    f"±{MAX_ABS_VALUE:g}: {beyond}{fix}"
                )
            values[spec.name] = value
        return values

    def residuals(self) -> dict[str, torch.Tensor]:
        """Copies of the error-feedback residuals: what was computed but not yet sent.
        Empty before the first update and for codecs without feedback."""
        return {name: residual.clone() for name, residual in self._residuals.items()}

    def reset(self) -> None:
        """Forget the residuals, e.g. when training restarts from a different head."""
        self._residuals.clear()

    def load_residuals(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore residuals saved from :meth:`residuals` (of an encoder with the same codec and
        schema), replacing the current ones; an empty mapping means none, as before the first
        update. The tensors are copied.

        Raises :class:`LocalError`, changing nothing, unless ``tensors`` is empty or holds
        exactly one finite float32 tensor of the schema's shape per schema parameter (within
        ±:data:`MAX_ABS_VALUE`), or when the codec keeps no residuals.
        """
        if not tensors:
            self._residuals.clear()
            return
        where = "delete the saved residuals to restart error feedback from zero"
        if not self._codec.error_feedback:
            raise LocalError(
                f"codec {self._codec.name} keeps no error-feedback residuals, yet "
                f"{len(tensors)} were given: they were saved under another codec; {where}"
            )
        loaded = self._schema_tensors(
            tensors,
            "saved residual",
            mismatch="they belong to another model or revision",
            fix=f"; {where}",
            beyond="the file is damaged",
        )
        self._residuals = loaded

    def requeue_unaccepted(self, blob: bytes) -> None:
        """Add what ``blob`` carried back into the residuals: ``blob`` is an update this
        encoder produced that the certified head did not accept (see the module docstring
        for when to call this), decoded as every peer decodes it. Does nothing for codecs
        without error feedback.

        Raises :class:`LocalError`, changing nothing, when ``blob`` is not a valid update of
        this encoder's codec and schema.
        """
        if not self._codec.error_feedback:
            return
        try:
            decoded = self._decode(blob)
        except ProtocolViolation as exc:
            raise LocalError(
                f"cannot requeue an update that is not one of this encoder's ({exc}); pass "
                "the bytes encode() returned"
            ) from None
        for name, sent in decoded.items():
            held = self._residuals.get(name)
            self._residuals[name] = sent if held is None else held + sent

    def statistics(self) -> EncoderStatistics:
        """Counters so far, and the current residual norm."""
        norms = [torch.linalg.vector_norm(r, dtype=torch.float64) for r in self._residuals.values()]
        squares = sum(float(norm) ** 2 for norm in norms)
        return EncoderStatistics(
            codec=self._codec.name,
            updates=self._updates,
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            last_bytes_out=self._last_bytes_out,
            compression_ratio=self._bytes_in / self._bytes_out if self._bytes_out else 0.0,
            residual_norm=math.sqrt(squares),
        )

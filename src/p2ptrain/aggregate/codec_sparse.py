"""The ``topk`` update codec: per parameter, the k largest magnitudes and their positions.

For a parameter with ``n`` elements the encoder keeps ``k = max(1, ceil(fraction * n))``
values (``k = 0`` for an empty tensor; ``ceil`` of the IEEE double product, the same on every
machine) and sends two parts:

``indices``  shape ``(k,)``, int32 when ``n < 2**31`` else int64: positions in the flattened
             (row-major) tensor, strictly increasing.
``values``   shape ``(k,)``, float32: the values at those positions.

Decoding scatters the values into zeros; a decoder rejects indices that are out of range,
unsorted or repeated. The encoder selects from ``delta + residual`` (error feedback, kept by
:class:`p2ptrain.aggregate.codecs.UpdateEncoder`), so what is not sent now is sent later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from p2ptrain.core.tensors import TensorSpec
from p2ptrain.errors import LocalError, ProtocolViolation

__all__ = ["TopKCodec"]

_INT32_LIMIT = 2**31


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < _INT32_LIMIT else torch.int64


@dataclass(frozen=True, slots=True)
class TopKCodec:
    """Top-k sparsification with error feedback; ``fraction`` of each tensor is sent."""

    name = "topk"
    error_feedback = True

    fraction: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise LocalError(f"codec.config.fraction must be in (0, 1], got {self.fraction}")

    def settings(self) -> dict[str, int | float]:
        return {"fraction": self.fraction}

    def kept(self, numel: int) -> int:
        """How many values of an ``numel``-element tensor are sent."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def layout(self, spec: TensorSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        numel = math.prod(spec.shape)
        k = self.kept(numel)
        return {"indices": ((k,), _index_dtype(numel)), "values": ((k,), torch.float32)}

    def encoder(
        self, spec: TensorSpec, seed: int
    ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        """A function from one float32 tensor to its parts (stateless; ``seed`` unused)."""
        numel = math.prod(spec.shape)
        k = self.kept(numel)
        index_dtype = _index_dtype(numel)

        def encode(value: torch.Tensor) -> dict[str, torch.Tensor]:
            flat = value.reshape(-1)
            chosen = torch.topk(flat.abs(), k, sorted=False).indices
            chosen = torch.sort(chosen).values
            return {"indices": chosen.to(index_dtype), "values": flat[chosen]}

        return encode

    def decode(self, spec: TensorSpec, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The dense float32 tensor; ``parts`` already match :meth:`layout`."""
        numel = math.prod(spec.shape)
        indices = parts["indices"]
        _check_indices(spec.name, indices, numel)
        dense = torch.zeros(numel, dtype=torch.float32)
        if indices.numel():
            # Unique indices, so the scatter writes each position once: exact and ordered.
            dense.index_copy_(0, indices.to(torch.int64), parts["values"])
        return dense.reshape(spec.shape)


def _check_indices(name: str, indices: torch.Tensor, numel: int) -> None:
    """Indices must be strictly increasing and inside ``[0, numel)``."""
    if not indices.numel():
        return
    first, last = int(indices[0]), int(indices[-1])
    if first < 0 or last >= numel:
        raise ProtocolViolation(
            f"topk indices of {name!r} run from {first} to {last}, outside [0, {numel})"
        )
    if not bool(indices[1:].gt(indices[:-1]).all()):
        raise ProtocolViolation(
            f"topk indices of {name!r} are not strictly increasing (unsorted or repeated)"
        )

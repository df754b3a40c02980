"""How fast each update codec encodes and decodes, and how much it compresses.

The update is a seeded transformer-like pseudo-gradient (the state dict of
:func:`p2ptrain.bench.tensor_codec.make_state_dict`, scaled like a real delta): a few dozen
matrices and vectors, not one giant vector, so ``lowrank`` sees real matrices. For every
codec with its default settings, each repeat encodes the update with one encoder (so
``topk``, ``sparseloco`` and ``lowrank`` run with their error feedback and warm starts, as on
a trainer) and decodes the blob with full validation; the best time of the repeats counts
(after one untimed warm-up encode). Throughput is in MB (10^6 bytes) of float32 input per
second.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from p2ptrain.aggregate.codecs import decode_update, make_encoder, max_update_bytes
from p2ptrain.bench.tensor_codec import make_state_dict
from p2ptrain.core.manifests import UPDATE_CODECS, CodecSpec
from p2ptrain.core.tensors import schema_of
from p2ptrain.errors import LocalError

__all__ = ["measure_codecs"]

_MB = 1e6


def _best_seconds(action: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``action``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def _measure_codec(
    spec: CodecSpec, delta: dict[str, torch.Tensor], repeats: int, seed: int
) -> dict[str, float]:
    schema = schema_of(delta)
    raw_megabytes = sum(t.nbytes for t in delta.values()) / _MB
    encoder = make_encoder(spec, schema, seed=seed)
    blob = encoder.encode(delta)  # warm-up; the bytes the decoder is timed on
    encode_s = _best_seconds(lambda: encoder.encode(delta), repeats)
    limit = max_update_bytes(spec, schema)
    decode_s = _best_seconds(lambda: decode_update(blob, spec, schema, max_bytes=limit), repeats)
    return {
        "encode_mb_s": raw_megabytes / encode_s,
        "decode_mb_s": raw_megabytes / decode_s,
        "compression_ratio": raw_megabytes * _MB / len(blob),
    }


def measure_codecs(
    values: int = 25_000_000, repeats: int = 3, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Per codec: ``encode_mb_s``, ``decode_mb_s`` and ``compression_ratio`` (raw float32
    bytes over encoded bytes) on a seeded ~``values``-element update; best of ``repeats``."""
    if values < 1024 or repeats < 1:
        raise LocalError(f"values={values}, repeats={repeats}: use values >= 1024, repeats >= 1")
    delta = {name: t.mul_(1e-3) for name, t in make_state_dict(4 * values, seed).items()}
    with torch.no_grad():
        return {
            name: _measure_codec(CodecSpec(name=name), delta, repeats, seed)
            for name in UPDATE_CODECS
        }

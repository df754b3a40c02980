"""How fast state dicts become safetensors bytes and back, compared with plain file I/O.

A blob's life on a node is: encode the state dict, write the bytes to the blob store
(``write`` + ``fsync``), later read them back and decode. The codec is good enough when it
is not the slow step of that life, so it is measured against the file I/O it sits next to:

* **encode** is compared with a plain file write of the same bytes: ``open``, ``write``,
  ``fsync``, ``close`` of a new file in ``workdir``. That is what the blob store does with
  every blob, so ``safetensors_encode_ratio > 1`` means encoding is faster than storing.
* **decode** (with full validation and the expected schema) is compared with a plain read of
  the same file into a new ``bytes`` object from the page cache (the file was just written),
  the cheapest way a blob's bytes reach memory. ``safetensors_decode_ratio`` near 1 means
  decoding costs about one more read.

Each repeat measures all four operations back to back (interleaved, so drift on a shared
machine hits all of them alike) and the best time of the repeats counts. Every result stays
alive until the end, so each step writes into freshly allocated memory, as the plain read
does (otherwise the allocator would hand the codec pages a previous repeat already touched,
flattering it by up to 5x). Data is seeded.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from p2ptrain.core.tensors import decode_state_dict, encode_state_dict, schema_hash
from p2ptrain.errors import LocalError

__all__ = ["make_state_dict", "measure_tensor_codec"]

_MB = 1e6


def make_state_dict(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded float32 transformer-like state dict of about ``size_bytes`` bytes.

    Embedding, then blocks of attention and MLP matrices with their biases and layer norms:
    a few big matrices and many small vectors, a few dozen tensors for 100 MB.
    """
    if size_bytes < 1024:
        raise LocalError(f"size_bytes={size_bytes} is too small; use at least 1024")
    width = max(8, int(math.sqrt(size_bytes / 4 / 50)) // 8 * 8)
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    state: dict[str, torch.Tensor] = {"embed.weight": tensor(4 * width, width)}
    total = state["embed.weight"].nbytes
    layer = 0
    while total < size_bytes:
        block = {
            "attn.qkv.weight": tensor(3 * width, width),
            "attn.qkv.bias": tensor(3 * width),
            "attn.out.weight": tensor(width, width),
            "attn.out.bias": tensor(width),
            "norm1.weight": tensor(width),
            "norm1.bias": tensor(width),
            "mlp.up.weight": tensor(4 * width, width),
            "mlp.up.bias": tensor(4 * width),
            "mlp.down.weight": tensor(width, 4 * width),
            "mlp.down.bias": tensor(width),
            "norm2.weight": tensor(width),
            "norm2.bias": tensor(width),
        }
        for name, value in block.items():
            state[f"blocks.{layer}.{name}"] = value
            total += value.nbytes
        layer += 1
    state["norm.weight"] = tensor(width)
    return state


def _timed(action: Callable[[], object], keep_alive: list[object]) -> float:
    """Seconds ``action`` took; its result is kept so no later step reuses its memory."""
    start = time.perf_counter()
    keep_alive.append(action())
    return time.perf_counter() - start


def _write_synced(path: Path, data: bytes | bytearray) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def measure_tensor_codec(
    size_bytes: int = 100 * 1024 * 1024, repeats: int = 3, workdir: str | None = None
) -> dict[str, float]:
    """Encode/decode throughput of a ~``size_bytes`` state dict against plain file I/O.

    Returns ``safetensors_encode_ratio`` (encode MB/s over plain write+fsync MB/s),
    ``safetensors_decode_ratio`` (decode MB/s over page-cache read MB/s), the raw figures
    ``safetensors_encode_mb_s``, ``safetensors_decode_mb_s``,
    ``safetensors_plain_write_mb_s``, ``safetensors_plain_read_mb_s`` (MB = 10^6 bytes),
    and ``safetensors_bytes`` and ``safetensors_tensor_count``. The file goes to ``workdir``
    (default: a temporary directory), which should be on the disk that will hold the blob store.
    Needs memory for about ``3 * repeats + 2`` copies of the blob (see the module docstring).
    """
    if repeats < 1:
        raise LocalError(f"repeats={repeats}; use at least 1")
    state = make_state_dict(size_bytes)
    expected = schema_hash(state)
    blob = encode_state_dict(state)  # warm-up, and the bytes the file operations move
    seconds: dict[str, list[float]] = {"encode": [], "write": [], "read": [], "decode": []}
    keep_alive: list[object] = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = Path(tmp) / "blob.safetensors"
        for _ in range(repeats):
            seconds["encode"].append(_timed(lambda: encode_state_dict(state), keep_alive))
            seconds["write"].append(_timed(lambda: _write_synced(path, blob), keep_alive))
            seconds["read"].append(_timed(path.read_bytes, keep_alive))
            seconds["decode"].append(
                _timed(lambda: decode_state_dict(blob, expected_schema=expected), keep_alive)
            )
            path.unlink()
    keep_alive.clear()
    encode_s, write_s, read_s, decode_s = (min(seconds[step]) for step in seconds)
    megabytes = len(blob) / _MB
    return {
        "safetensors_encode_ratio": write_s / encode_s,
        "safetensors_decode_ratio": read_s / decode_s,
        "safetensors_encode_mb_s": megabytes / encode_s,
        "safetensors_decode_mb_s": megabytes / decode_s,
        "safetensors_plain_write_mb_s": megabytes / write_s,
        "safetensors_plain_read_mb_s": megabytes / read_s,
        "safetensors_bytes": float(len(blob)),
        "safetensors_tensor_count": float(len(state)),
    }

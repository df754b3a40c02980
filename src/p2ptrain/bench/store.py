"""``p2ptrain bench store``: storage and tensor codec throughput as ratios to plain file I/O."""

from __future__ import annotations

import platform

from p2ptrain import __version__
from p2ptrain.bench.blob_store import measure_blob_store
from p2ptrain.bench.tensor_codec import measure_tensor_codec


def run_store_bench(
    size_bytes: int = 100 * 1024 * 1024, repeats: int = 3, workdir: str | None = None
) -> dict[str, float | int | str]:
    """One JSON-ready object: ``blob_put_ratio``, ``blob_get_ratio``,
    ``safetensors_encode_ratio``, ``safetensors_decode_ratio`` and the raw figures."""
    result: dict[str, float | int | str] = {
        "p2ptrain_version": __version__,
        "size_bytes": size_bytes,
        "repeats": repeats,
        "machine": f"{platform.machine()} {platform.python_implementation()} "
        f"{platform.python_version()}",
    }
    result.update(measure_blob_store(size_bytes, repeats=repeats, workdir=workdir))
    result.update(measure_tensor_codec(size_bytes, repeats=repeats, workdir=workdir))
    return result

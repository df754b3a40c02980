"""Where a workload's model runs and in what precision.

* **Device.** :func:`resolve_device` turns ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"mps"``
  into a :class:`torch.device` that exists on this machine, or raises a
  :class:`~p2ptrain.errors.LocalError` naming the device and what to do.
* **Precision.** Peers exchange float32 weights. A model whose parameters are bfloat16 or
  float16 is converted to float32 *master weights* once (:func:`keep_master_weights`), and its
  forward runs under ``torch.autocast`` in the original dtype (:func:`autocast_context`).
  There is no loss scaling: float16 gradients that underflow are lost, so prefer bfloat16.
* **Randomness.** :func:`seeded_rng` runs a block with the global RNG seeded and restores it
  afterwards, so dropout masks in a window are a function of the window's seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from p2ptrain.errors import LocalError

__all__ = [
    "LOW_PRECISION",
    "autocast_context",
    "keep_master_weights",
    "resolve_device",
    "seeded_rng",
]

#: Parameter dtypes kept as float32 master weights, computed in under autocast.
LOW_PRECISION = (torch.bfloat16, torch.float16)

_CHOICES = "use device='cpu', 'cuda', 'cuda:<index>' or 'mps'"


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` as a :class:`torch.device` available here (``"cuda"`` gets its index)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise LocalError(
            f"device {device!r:.40} is not a PyTorch device ({error}); {_CHOICES}"
        ) from error
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise LocalError(
                f"device {str(device)!r} is not available: this PyTorch ({torch.__version__}) "
                "sees no CUDA GPU (a CPU-only build, or no GPU visible to the process); use "
                "device='cpu', or install a CUDA build of torch and check nvidia-smi and "
                "CUDA_VISIBLE_DEVICES"
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if parsed.index is None else parsed.index
        if index >= count:
            raise LocalError(
                f"device {str(device)!r} does not exist: this machine has {count} CUDA "
                f"device(s), cuda:0 to cuda:{count - 1}; pick one of those"
            )
        return torch.device("cuda", index)
    if parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise LocalError(
                f"device {str(device)!r} is not available: MPS needs an Apple-silicon Mac and "
                "a PyTorch built with MPS; use device='cpu'"
            )
        return parsed
    backend = getattr(torch, parsed.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and is_available():
        return parsed
    raise LocalError(f"device {str(device)!r} is not available on this machine; {_CHOICES}")


def keep_master_weights(model: nn.Module) -> torch.dtype | None:
    """Convert a bfloat16/float16 ``model`` to float32 in place (parameters keep their
    identity, so an optimizer built on them still holds them) and return the dtype its
    forward should autocast to; None for a float32 model, which is left untouched."""
    low = {param.dtype for param in model.parameters() if param.dtype in LOW_PRECISION}
    if not low:
        return None
    if len(low) > 1:
        raise LocalError(
            "the model mixes bfloat16 and float16 parameters; convert it to one of them "
            "(model.to(torch.bfloat16)) before building the workload"
        )
    model.float()
    return low.pop()


def autocast_context(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[object]:
    """``torch.autocast`` on ``device`` in ``dtype``, or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def seeded_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Run the block with the global RNG (CPU and ``device``) seeded with ``seed``; the
    previous RNG state is restored afterwards."""
    devices = [device.index] if device.type == "cuda" and device.index is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield

"""p2ptrain: train one PyTorch model together on many untrusted computers."""

from __future__ import annotations

__version__ = "0.1.0"

from p2ptrain.errors import (
    InvalidRecord,
    LocalError,
    P2PTrainError,
    ProtocolViolation,
    TransportError,
)

__all__ = [
    "InvalidRecord",
    "LocalError",
    "P2PTrainError",
    "ProtocolViolation",
    "TransportError",
    "__version__",
]

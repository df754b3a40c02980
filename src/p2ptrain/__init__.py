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
    "RoleFailed",
    "Trainer",
    "TransportError",
    "WindowOutcome",
    "__version__",
]


def __getattr__(name: str) -> object:
    """The Trainer API, imported when first asked for (it brings in torch and the node)."""
    if name in ("Trainer", "WindowOutcome"):
        from p2ptrain.node import trainer_api

        return getattr(trainer_api, name)
    if name == "RoleFailed":
        from p2ptrain.driver.failures import RoleFailed

        return RoleFailed
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")

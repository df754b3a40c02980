"""The roles a node can hold (a peer record names them), in a module of their own so that the
command line lists them without loading the records' signature code."""

from __future__ import annotations

__all__ = ["ROLES"]

ROLES = ("reducer", "seed", "trainer", "validator", "viewer")

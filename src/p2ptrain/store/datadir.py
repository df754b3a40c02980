"""A node's data directory: identity, blob store and state database together."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from p2ptrain.store.blobs import BlobStore
from p2ptrain.store.state import StateStore

BLOBS_DIR = "blobs"
STATE_DB = "node.db"


class DataDir:
    """Opens (creating if needed) the stores of one data directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.blobs = BlobStore(self.path / BLOBS_DIR)
        self.state = StateStore(self.path / STATE_DB)

    def close(self) -> None:
        self.state.close()
        self.blobs.close()

    def __enter__(self) -> DataDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

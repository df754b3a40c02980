"""The one error tree of p2ptrain.

Three families, after h11's split between our misuse and the peer's:

* :class:`ProtocolViolation` -- a peer (or a file from a peer) sent something invalid.
  Reject it, count it against the peer, keep running.
* :class:`LocalError` -- our own misuse or configuration. It carries a message that says
  what to do next; the CLI prints it and exits with :attr:`LocalError.exit_code`.
* :class:`TransportError` -- the network or the disk failed us; retry or skip.
"""

from __future__ import annotations


class P2PTrainError(Exception):
    """Base class of every error p2ptrain raises on purpose."""


class ProtocolViolation(P2PTrainError):
    """A peer sent bytes or a record that breaks the protocol.

    Every decoder raises this, and only this, on any bad input.
    """


class LocalError(P2PTrainError):
    """Our misuse or configuration; the message tells the user what to do."""

    exit_code: int = 2


class DataDirInUse(LocalError):
    """Another process holds the data directory (a node runs on it)."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path = path
        #: The holder's pid as it recorded it (None when it could not be read).
        self.pid = pid
        super().__init__(
            f"data directory {path} is in use by {self.holder} (another p2ptrain node); "
            "stop it or use another --dir"
        )

    @property
    def holder(self) -> str:
        return "another process" if self.pid is None else f"pid {self.pid}"


class TransportError(P2PTrainError):
    """A network or disk operation failed; the caller may retry or skip."""


class StorageFault(TransportError):
    """Local storage refused a write (the disk is full, read-only, or failing). The node
    reports it once, backs off and retries, and resumes by itself once writes succeed."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(
            f"cannot write {path}: {problem}; free disk space there (or make it writable): "
            "the node retries and resumes by itself"
        )
        self.path = path
        self.problem = problem


class InvalidRecord(P2PTrainError, ValueError):
    """A record field breaks its rule (raised while constructing a record).

    ``field`` names the offending field so configuration errors can point at it. While a
    record is decoded from peer bytes this surfaces as :class:`ProtocolViolation`.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class BlobCorrupted(TransportError):
    """A stored blob no longer matches its id; it was moved aside."""

    def __init__(self, blob_id: str, quarantined_to: str) -> None:
        super().__init__(
            f"blob {blob_id} is corrupted on disk (its bytes no longer hash to its id); "
            f"moved aside to {quarantined_to}. Fetch it again from a peer."
        )
        self.blob_id = blob_id
        self.quarantined_to = quarantined_to


class BlobNotFound(LocalError, KeyError):
    """The blob store has no blob with this id."""

    def __init__(self, blob_id: str) -> None:
        super().__init__(f"no blob {blob_id} in the store; fetch it from a peer first")
        self.blob_id = blob_id

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])

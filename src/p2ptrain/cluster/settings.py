"""A cluster member's settings: one frozen record, checked when it is built."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from p2ptrain.errors import LocalError

__all__ = [
    "AUTO_COMPRESS_BELOW",
    "BACKEND",
    "COMPRESSIONS",
    "ClusterSettings",
    "ConfigValue",
    "choose_compression",
    "compression_problem",
]

ConfigValue = str | int | float | bool
#: How DDP's gradients travel (torch's communication hooks); ``auto`` chooses per generation.
COMPRESSIONS = ("auto", "none", "fp16", "bf16", "powersgd")
#: ``auto`` compresses (PowerSGD) when a plain fp32 all-reduce among the generation's members
#: synchronises fewer bytes per second than this, and sends plain fp32 otherwise. Measured
#: with ``p2ptrain bench pods`` on 2 CPU cores: PowerSGD's own work caps it near 320 MB/s of
#: fp32 gradients and fp16's near 550 MB/s, while loopback moves 1.1-1.3 GB/s plain (so
#: compressing there only costs), and a 100 Mbit/s link 12 MB/s (PowerSGD: 27x, fp16: 2x).
AUTO_COMPRESS_BELOW = 250e6
#: The process group's backend: gloo runs on any machine and keeps its timeouts.
BACKEND = "gloo"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def choose_compression(fp32_bytes_per_s: float) -> str:
    """What ``auto`` uses on links where a plain fp32 all-reduce moves ``fp32_bytes_per_s``:
    ``powersgd`` (with error feedback) on slow links, ``none`` on fast ones."""
    return "powersgd" if fp32_bytes_per_s < AUTO_COMPRESS_BELOW else "none"


def compression_problem(compression: str, backend: str) -> str | None:
    """Why ``compression`` cannot run on ``backend`` (None: it can)."""
    if compression == "bf16" and backend != "nccl":
        return (
            f"--compression bf16: torch's bf16 hook needs the NCCL backend (CUDA 11+, NCCL "
            f"2.10+), and this cluster trains on {backend}: use auto (the default), fp16 or "
            "powersgd"
        )
    return None


def _ipv4(option: str, text: str) -> None:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        raise LocalError(
            f"{option} {text!r:.80}: give an IPv4 address of this machine (for example "
            "192.168.1.10)"
        ) from None


@dataclass(frozen=True)
class ClusterSettings:
    """What one member of a home cluster needs (each also a ``p2ptrain cluster`` flag)."""

    secret: bytes
    data_dir: Path
    workload: str
    config: Mapping[str, ConfigValue] = field(default_factory=dict)
    #: Clusters of other names on the same LAN are ignored.
    name: str = "home"
    #: The IPv4 address members reach this one at (control endpoint, store, gloo); None:
    #: the address of the interface that carries the LAN's multicast.
    host: str | None = None
    #: The control endpoint's port (0: a free one, announced over mDNS).
    port: int = 0
    mdns: bool = True
    #: IPv4 addresses of the interfaces mDNS uses (None: the host's when given, else all).
    mdns_interfaces: tuple[str, ...] | None = None
    #: ``HOST:PORT`` of members to ask directly (a LAN or VPN without multicast).
    peers: tuple[str, ...] = ()
    #: Stop after this many completed steps (None: until stopped).
    steps: int | None = None
    compression: str = "auto"
    collective_timeout_s: float = 30.0
    #: The first generation forms once this many members (this one included) are ready.
    wait_for: int = 1
    #: Seconds spent finding members on the LAN before the first generation forms.
    discovery_s: float = 3.0
    #: Seconds a leader waits for the members it knows to ask before forming without them.
    settle_s: float = 3.0
    #: Seeds the order of the training samples (every member must use the same).
    seed: int = 0
    threads: int = 1
    #: The interface gloo binds (None: the one holding ``host``).
    gloo_interface: str | None = None
    #: The p2ptrain experiment the cluster trains in as one pod trainer (None: the cluster
    #: trains on its own). Its generations are then pods: the leader runs the trainer node.
    experiment: str | None = None

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise LocalError("the cluster secret is shorter than 16 bytes; use 32 random bytes")
        if not _NAME.fullmatch(self.name):
            raise LocalError(f"--name {self.name!r:.80}: use 1-64 of A-Z a-z 0-9 . _ -")
        if self.host is not None:
            _ipv4("--host", self.host)
        for address in self.mdns_interfaces or ():
            _ipv4("--listen-interface", address)
        if self.mdns_interfaces is not None and not self.mdns_interfaces:
            raise LocalError("--listen-interface: give at least one address, or leave it out")
        if not 0 <= self.port <= 65535:
            raise LocalError(f"--port {self.port}: use 0 (a free port) or 1-65535")
        for peer in self.peers:
            host, sep, port = peer.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise LocalError(f"--peer {peer!r:.80}: use HOST:PORT of a member's endpoint")
        if self.steps is not None and self.steps < 1:
            raise LocalError(f"--steps {self.steps}: use a positive number of steps")
        if self.compression not in COMPRESSIONS:
            raise LocalError(
                f"--compression {self.compression!r}: choose from {', '.join(COMPRESSIONS)}"
            )
        if (problem := compression_problem(self.compression, BACKEND)) is not None:
            raise LocalError(problem)
        if not 0.5 <= self.collective_timeout_s <= 3600:
            raise LocalError(
                f"--collective-timeout-s {self.collective_timeout_s:g}: use 0.5 to 3600 seconds"
            )
        if self.wait_for < 1:
            raise LocalError(f"--wait-for {self.wait_for}: count this member too (at least 1)")
        for option, seconds in (("--discovery-s", self.discovery_s),
                                ("--settle-s", self.settle_s)):  # fmt: skip
            if not 0 <= seconds <= 600:
                raise LocalError(f"{option} {seconds:g}: use 0 to 600 seconds")
        if self.threads < 1:
            raise LocalError(f"--threads {self.threads}: use at least 1")
        if self.experiment is not None and self.steps is not None:
            raise LocalError(
                "--steps with --experiment: a cluster in a network trains the windows the "
                "network opens, until it is stopped; leave --steps out"
            )

    @property
    def cluster_id(self) -> str:
        """What the cluster announces on mDNS: derived from its name, never from the secret."""
        return hashlib.sha256(b"p2ptrain/v1/cluster\x00" + self.name.encode()).hexdigest()

    @property
    def fingerprint(self) -> str:
        """SHA-256 of what every member must train alike: the workload, its config, the
        sample order's seed and the gradients' compression, or the experiment the cluster
        joins as a pod trainer."""
        described: dict[str, object] = {
            "workload": self.workload,
            "config": dict(self.config),
            "seed": self.seed,
            "compression": self.compression,
        }
        if self.experiment is not None:
            described = {"experiment": self.experiment, "workload": self.workload}
        text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()

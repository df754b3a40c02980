"""Settings of the network layer: one frozen record, range-checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.errors import LocalError

__all__ = ["NetConfig"]


def _check(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise LocalError(f"network setting {name}={value} is out of range; use {low}..{high}")


@dataclass(frozen=True, slots=True)
class NetConfig:
    """How a node listens, connects and limits its peers. The defaults suit the internet."""

    #: Address to listen on; ``None`` runs no server (outbound-only trainers and viewers).
    host: str | None = "127.0.0.1"
    #: 0 lets the kernel pick a free port (tests, local networks).
    port: int = 0
    #: With ``port`` 0: a port to try first (the one a restarted node listened on before,
    #: so that its peers' bootstrap addresses stay right); a free one when it is taken.
    preferred_port: int = 0
    #: Addresses other peers should dial, when they differ from ``http://host:port``; one
    #: that names no port gets the port we listen on (useful with ``port=0``).
    advertise: tuple[str, ...] = ()
    #: Seeds to dial at start (``http://host:port``).
    bootstrap: tuple[str, ...] = ()
    #: Gossip connections we open, and the most we accept.
    max_outbound: int = 8
    max_inbound: int = 32
    #: One WebSocket frame (gossip message or relay chunk) at most this large.
    max_frame_bytes: int = 1 << 20
    #: Blobs pushed to us (POST /v1/blobs) at most this large.
    max_upload_bytes: int = 1 << 30
    #: Per-peer token buckets on the control plane: frames and bytes per second, and bursts.
    frames_per_s: float = 5_000.0
    frame_burst: int = 20_000
    bytes_per_s: float = 64e6
    byte_burst: int = 256 << 20
    #: Per-peer HTTP requests per second, and burst.
    requests_per_s: float = 500.0
    request_burst: int = 2_000
    #: A peer more than this many seconds' worth of frames or bytes over its bucket (after
    #: the burst) is flooding and is disconnected.
    flood_tolerance_s: float = 2.0
    #: Frames queued for one slow peer before it is dropped (it can catch up over HTTP).
    send_queue_frames: int = 16_384
    #: Seen-set for gossip dedup: entries kept and their age limit.
    seen_entries: int = 1_000_000
    seen_ttl_s: float = 600.0
    #: Gossip bodies kept to answer neighbours that ask for them (``Want``), in bytes, and
    #: how long a node waits for a body it asked for before it asks the next neighbour
    #: that announced it.
    body_cache_bytes: int = 64 << 20
    #: Kinds of gossip message this node has no use for: its neighbours send it neither
    #: their bodies nor their ids, and it relays none (a trainer skips the consensus
    #: traffic; it still publishes its own updates, to the neighbours that take them).
    gossip_skip: tuple[str, ...] = ()
    want_timeout_s: float = 2.0
    #: Strikes against a peer before it is banned, and for how long. Strikes count only
    #: proven misbehaviour (never a transport fault) and decay: one is forgiven every
    #: ``strike_decay_s`` seconds.
    strikes_to_ban: int = 3
    ban_s: float = 300.0
    strike_decay_s: float = 600.0
    #: Timeouts: connecting, one HTTP request, the WebSocket handshake.
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    handshake_timeout_s: float = 1.0
    #: A gossip socket with no PONG for this long is closed (a transport fault, no strike).
    heartbeat_s: float = 20.0
    #: How long a provider may take to say whether it holds a blob (HEAD), and the slowest
    #: rate (bytes/s) a blob provider may keep up: one below it is dropped from the fetch
    #: (the default passes a 1 Mbit/s home link with room to spare).
    probe_timeout_s: float = 3.0
    min_fetch_rate: float = 32_768.0  #: How often discovery looks for more peers to dial.
    discovery_interval_s: float = 2.0
    #: Advertise and browse on the LAN with mDNS (zeroconf).
    mdns: bool = False
    #: Serve over TLS with a self-signed certificate pinned in the peer record.
    tls: bool = False
    #: Where the TLS certificate and key are kept, so that a restarted node keeps its pin
    #: (and every address that names it); None: a new one each start.
    tls_dir: str | None = None
    #: Topics this node subscribes to besides its network's peer topic.
    topics: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _check("port", self.port, 0, 65535)
        _check("preferred_port", self.preferred_port, 0, 65535)
        _check("max_outbound", self.max_outbound, 0, 1024)
        _check("max_inbound", self.max_inbound, 0, 4096)
        _check("max_frame_bytes", self.max_frame_bytes, 4096, 1 << 30)
        _check("max_upload_bytes", self.max_upload_bytes, 0, 1 << 40)
        _check("frames_per_s", self.frames_per_s, 1, 1e9)
        _check("frame_burst", self.frame_burst, 1, 1 << 40)
        _check("bytes_per_s", self.bytes_per_s, 1024, 1e12)
        _check("byte_burst", self.byte_burst, self.max_frame_bytes, 1 << 40)
        _check("requests_per_s", self.requests_per_s, 1, 1e9)
        _check("request_burst", self.request_burst, 1, 1 << 40)
        _check("flood_tolerance_s", self.flood_tolerance_s, 0, 3600)
        _check("send_queue_frames", self.send_queue_frames, 16, 1 << 24)
        _check("seen_entries", self.seen_entries, 1024, 1 << 28)
        _check("seen_ttl_s", self.seen_ttl_s, 1, 86_400)
        _check("body_cache_bytes", self.body_cache_bytes, self.max_frame_bytes, 1 << 40)
        _check("want_timeout_s", self.want_timeout_s, 0.01, 600)
        _check("strikes_to_ban", self.strikes_to_ban, 1, 1_000_000)
        _check("ban_s", self.ban_s, 0, 86_400 * 365)
        _check("connect_timeout_s", self.connect_timeout_s, 0.01, 600)
        _check("request_timeout_s", self.request_timeout_s, 0.01, 3600)
        _check("handshake_timeout_s", self.handshake_timeout_s, 0.01, 60)
        _check("heartbeat_s", self.heartbeat_s, 0.1, 3600)
        _check("strike_decay_s", self.strike_decay_s, 0.01, 86_400 * 365)
        _check("probe_timeout_s", self.probe_timeout_s, 0.01, 600)
        _check("min_fetch_rate", self.min_fetch_rate, 0, 1e12)
        _check("discovery_interval_s", self.discovery_interval_s, 0.01, 3600)
        if self.host is None and self.tls:
            raise LocalError("a node with no server (host=None) cannot serve TLS; drop tls")

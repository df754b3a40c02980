"""A network node in a child process, driven by JSON lines on stdin.

argv[1] is a JSON object: ``seed`` (identity seed label), ``network`` (see
:func:`network_from`), ``data_dir``, and optional ``host`` (null: no server), ``bootstrap``,
``relay``, ``roles``, ``config`` (NetConfig overrides), ``secret`` (hex), ``admission_issuer``
(issuer seed label: sign ourselves an admission certificate with it).

The child prints ``{"event": "up", "address": ..., "peer_id": ...}`` once listening, then
answers each command line with one JSON line. It exits when stdin closes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import sys
from typing import Any

from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest, secret_check
from p2ptrain.core.records import AdmissionCertificate, Attestation
from p2ptrain.net.config import NetConfig
from p2ptrain.net.gossip import Delivered
from p2ptrain.net.node import NetNode
from p2ptrain.store.blobs import BlobStore
from tests.support.child_io import emit, stdin_lines

TOPIC_EXPERIMENT = hashlib.sha256(b"net-child-experiment").hexdigest()
TOPIC = f"exp/{TOPIC_EXPERIMENT}"


def identity(label: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"net-child/{label}".encode()).digest())


def network_from(spec: dict[str, Any]) -> NetworkManifest:
    """``{"authority": label, "secret": hex | null, "issuers": [label, ...]}``."""
    secret = spec.get("secret")
    issuers = tuple(sorted(identity(label).public_key for label in spec.get("issuers", [])))
    return NetworkManifest(
        name="test-net",
        authority=identity(spec.get("authority", "authority")).public_key,
        admission="certificate" if issuers else "open",
        issuer_keys=issuers,
        secret_check=None if secret is None else secret_check(bytes.fromhex(secret)),
    )


def admission_for(network: NetworkManifest, subject: Identity, issuer_label: str) -> Any:
    issuer = identity(issuer_label)
    return seal(
        issuer,
        AdmissionCertificate(
            network_id=network.id, subject=subject.public_key, issuer=issuer.public_key
        ),
    )


class Child:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.me = identity(spec["seed"])
        self.network = network_from(spec["network"])
        secret = spec.get("secret")
        admission: Signed[AdmissionCertificate] | None = None
        if spec.get("admission_issuer"):
            admission = admission_for(self.network, self.me, spec["admission_issuer"])
        config = NetConfig(
            host=spec.get("host", "127.0.0.1"),
            bootstrap=tuple(spec.get("bootstrap", ())),
            discovery_interval_s=0.2,
            **spec.get("config", {}),
        )
        self.blobs = BlobStore(spec["data_dir"])
        self.node = NetNode(
            identity=self.me,
            network=self.network,
            blobs=self.blobs,
            config=config,
            roles=spec.get("roles", ["seed"]),
            secret=None if secret is None else bytes.fromhex(secret),
            admission=admission,
            relay=spec.get("relay"),
        )
        self.delivered: dict[str, int] = {}
        self.ids: set[bytes] = set()
        self.repeats = 0
        self.node.gossip.subscribe(TOPIC, self.on_message)

    def on_message(self, message: Delivered) -> None:
        if not message.from_peer:
            return
        digest = hashlib.sha256(message.data).digest()
        if digest in self.ids:
            self.repeats += 1
        self.ids.add(digest)
        assert isinstance(message.record, Signed)
        origin = message.record.signer_id
        self.delivered[origin] = self.delivered.get(origin, 0) + 1

    async def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        name = cmd["cmd"]
        if name == "stats":
            return {
                "delivered": self.delivered,
                "repeats": self.repeats,
                "connections": sorted(self.node.gossip.connections),
                "opened": self.node.statistics().connections_opened,
                "gossip": self.node.gossip.statistics().__repr__(),
            }
        if name == "publish":
            for i in range(cmd["count"]):
                head = hashlib.sha256(f"{self.me.peer_id}/{cmd.get('tag', '')}/{i}".encode())
                signed = seal(
                    self.me,
                    Attestation(
                        experiment_id=TOPIC_EXPERIMENT,
                        height=1 + i,
                        head_id=head.hexdigest(),
                        validator=self.me.public_key,
                        round=0,
                        stage="commit",
                    ),
                )
                self.node.publish(TOPIC, "attestation", signed.envelope.encode())
                if i % 50 == 49:
                    await asyncio.sleep(0)  # let the writers drain between bursts
            return {"published": cmd["count"]}
        if name == "put_blob":
            data = random.Random(cmd["seed"]).randbytes(cmd["size"])
            return {"blob": self.blobs.put(data)}
        if name == "push":
            pushed = await self.node.client.push_blob(
                cmd["address"], cmd["blob"], self.blobs.path(cmd["blob"])
            )
            return {"pushed": pushed}
        if name == "fetch":
            address = cmd.get("address") or self.node.address_of(cmd["peer"])
            async with self.node.client.request(
                "GET", address, f"/v1/blobs/{cmd['blob']}"
            ) as response:
                body = await response.read()
            ok = hashlib.sha256(body).hexdigest() == cmd["blob"]
            if ok:
                self.blobs.put(body)
            return {"verified": ok, "bytes": len(body), "via": address}
        if name == "address_of":
            return {"address": self.node.address_of(cmd["peer"])}
        raise ValueError(f"unknown command {name!r}")


async def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    child = Child(json.loads(sys.argv[1]))
    async with child.node:
        emit("up", address=child.node.address, peer_id=child.node.peer_id)
        async for line in stdin_lines():
            try:
                emit("ok", **await child.command(json.loads(line)))
            except Exception as exc:
                emit("error", error=f"{type(exc).__name__}: {exc}")
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main())

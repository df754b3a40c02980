"""The certified head chain: genesis, adoption, and catch-up from untrusted peers.

A head is canonical only with a quorum certificate that verifies against the manifest and
names exactly that head. A node extends its chain one height at a time; a chain received
from a peer (catch-up) is accepted only if every link verifies -- parent ids, heights,
certificates -- and the final weights hash matches, so whoever answered need not be trusted.
Two different certified heads at one height is a safety violation: the chain keeps the
first and reports the second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from p2ptrain.core.certificate import QuorumCertificate, Verdict
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Head

__all__ = [
    "MAX_LINKS_PER_PAGE",
    "CertifiedHead",
    "ChainPage",
    "HeadChain",
    "genesis_head",
    "verify_link",
]

#: The most certified links one catch-up answer carries; a node further behind asks for
#: the next page after the last link it verified.
MAX_LINKS_PER_PAGE = 256
#: How many of its newest heads a provider checks when it says which states it holds.
HELD_HEADS_REPORTED = 64


def genesis_head(manifest: ExperimentManifest, experiment_id: str | None = None) -> Head:
    """Height 0: the manifest's genesis weights, no optimizer state, no updates."""
    return Head(
        experiment_id=manifest.id if experiment_id is None else experiment_id,
        height=0,
        parent=None,
        weights_blob=manifest.genesis_weights,
        optimizer_blob=None,
    )


@dataclass(frozen=True, slots=True)
class CertifiedHead:
    head: Head
    head_id: str
    certificate: QuorumCertificate | None  # None only for genesis


@dataclass(frozen=True, slots=True)
class ChainPage:
    """One catch-up answer: up to :data:`MAX_LINKS_PER_PAGE` certified links above the
    height asked for (unverified: the receiving chain checks each), the provider's own
    height (``tip``: more pages follow while the links end below it), the heights among
    its newest heads whose blobs it holds (``held``: a client asks for those states, never
    for collected ones), and the provider's public key (``sender``)."""

    links: tuple[tuple[Head, QuorumCertificate], ...]
    tip: int
    held: frozenset[int]
    sender: bytes


def verify_link(
    manifest: ExperimentManifest,
    parent: tuple[str, int],
    head: Head,
    certificate: QuorumCertificate,
    *,
    experiment_id: str,
) -> Verdict:
    """Whether ``head`` with ``certificate`` is a valid certified child of the parent
    ``(parent id, parent height)``."""
    parent_id, parent_height = parent
    head_id = head.id
    if head.experiment_id != experiment_id:
        return Verdict(False, "head is for another experiment")
    if head.parent != parent_id or head.height != parent_height + 1:
        return Verdict(
            False,
            f"head {head_id[:12]} at height {head.height} does not extend {parent_id[:12]} "
            f"at height {parent_height}",
        )
    if certificate.head_id != head_id or certificate.height != head.height:
        return Verdict(False, "certificate names another head or height")
    verdict = certificate.verify(manifest)
    if not verdict:
        return Verdict(False, f"certificate does not verify: {verdict.reason}")
    return Verdict(True, f"certified at height {head.height}: {verdict.reason}")


class HeadChain:
    """A node's view of the canonical chain (genesis first)."""

    def __init__(self, manifest: ExperimentManifest) -> None:
        self.manifest = manifest
        self.experiment_id = manifest.id
        genesis = genesis_head(manifest, self.experiment_id)
        self._links = [CertifiedHead(genesis, genesis.id, None)]
        self.conflicts: list[tuple[CertifiedHead, CertifiedHead]] = []
        #: Links whose certificate this chain verified (each costs q signature checks).
        self.certificate_checks = 0

    @property
    def tip(self) -> CertifiedHead:
        return self._links[-1]

    @property
    def height(self) -> int:
        return self.tip.head.height

    def at(self, height: int) -> CertifiedHead | None:
        return self._links[height] if 0 <= height < len(self._links) else None

    def links_after(self, height: int) -> list[tuple[Head, QuorumCertificate]]:
        """The certified heads above ``height``, for a peer catching up."""
        return [
            (link.head, link.certificate)
            for link in self._links[max(height, -1) + 1 :]
            if link.certificate is not None
        ]

    def extend(self, head: Head, certificate: QuorumCertificate) -> Verdict:
        """Adopt ``head`` if it is a certified child of the tip. A different certified head
        at a height already held is recorded in :attr:`conflicts`."""
        held = self.at(head.height)
        if held is not None:
            head_id = head.id
            if held.head_id == head_id:
                return Verdict(False, f"head at height {head.height} already adopted")
            parent = self.at(head.height - 1)
            if (
                parent is not None
                and held.certificate is not None
                and self._verify((parent.head_id, parent.head.height), head, certificate)
            ):
                self.conflicts.append((held, CertifiedHead(head, head_id, certificate)))
                return Verdict(False, f"SAFETY: a second certified head at height {head.height}")
            return Verdict(False, f"height {head.height} is already certified")
        tip = self.tip
        verdict = self._verify((tip.head_id, tip.head.height), head, certificate)
        if verdict:
            self._links.append(CertifiedHead(head, head.id, certificate))
        return verdict

    def catch_up(
        self,
        links: Sequence[tuple[Head, QuorumCertificate]],
        weights_ok: Callable[[Head], bool],
    ) -> Verdict:
        """Adopt a chain from an untrusted peer: every link must verify against our tip in
        order, and ``weights_ok(last head)`` must confirm the fetched weights hash; on any
        failure nothing is adopted."""
        checked = self._checked(links)
        if isinstance(checked, Verdict):
            return checked
        if not weights_ok(checked[-1].head):
            return Verdict(False, "catch-up rejected: the final weights do not match the head")
        self._links.extend(checked)
        return Verdict(True, f"caught up {len(checked)} heads to height {self.height}")

    def extend_links(self, links: Sequence[tuple[Head, QuorumCertificate]]) -> Verdict:
        """Adopt a page of certified links from an untrusted peer, without their states:
        every link must verify against our tip in order; on any failure nothing is
        adopted. (The node fetches a state it needs afterwards, checked by its hash.)"""
        checked = self._checked(links)
        if isinstance(checked, Verdict):
            return checked
        self._links.extend(checked)
        return Verdict(True, f"verified {len(checked)} certified heads to height {self.height}")

    def _checked(
        self, links: Sequence[tuple[Head, QuorumCertificate]]
    ) -> list[CertifiedHead] | Verdict:
        """The links above our tip, each verified against the one before (the first
        against our tip), or the verdict that rejects them."""
        if not links:
            return Verdict(False, "no heads to catch up with")
        parent_id, parent_height = self.tip.head_id, self.tip.head.height
        checked: list[CertifiedHead] = []
        for head, certificate in links:
            if head.height <= parent_height and not checked:
                continue  # heads we hold already
            verdict = self._verify((parent_id, parent_height), head, certificate)
            if not verdict:
                return Verdict(
                    False, f"catch-up rejected at height {head.height}: {verdict.reason}"
                )
            checked.append(CertifiedHead(head, head.id, certificate))
            parent_id, parent_height = checked[-1].head_id, head.height
        if not checked:
            return Verdict(False, "the peer's chain is not longer than ours")
        return checked

    def held_heights(self, holds: Callable[[Head], bool]) -> frozenset[int]:
        """The heights among our newest :data:`HELD_HEADS_REPORTED` heads whose blobs
        ``holds`` (what a provider tells a node catching up)."""
        newest = self._links[-HELD_HEADS_REPORTED:]
        return frozenset(link.head.height for link in newest if holds(link.head))

    def _verify(
        self, parent: tuple[str, int], head: Head, certificate: QuorumCertificate
    ) -> Verdict:
        self.certificate_checks += 1
        return verify_link(
            self.manifest, parent, head, certificate, experiment_id=self.experiment_id
        )

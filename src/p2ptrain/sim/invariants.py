"""The safety invariants, checked by an observer that sees what every simulated node sends,
certifies and adopts:

* at most one certified head per height;
* every adopted head carries a certificate that verifies against the manifest;
* no update inside a certified head is forged, stale, replayed from another window, built
  on another base, from a trainer the parent head excluded, or accepted twice;
* at the end, all honest nodes hold the same head with identical weights.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Signed
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Head, Proposal, Update
from p2ptrain.core.tensors import encode_state_dict
from p2ptrain.protocol.quarantine import excluded_until

if TYPE_CHECKING:
    from p2ptrain.sim.world import World

__all__ = ["Observer"]


class Observer:
    def __init__(self, manifest: ExperimentManifest) -> None:
        self.manifest = manifest
        self.experiment_id = manifest.id
        self.violations: list[str] = []
        self.certified: dict[int, dict[str, Head]] = defaultdict(dict)
        self.certified_at: dict[int, float] = {}
        self.updates: dict[str, tuple[Update, str]] = {}
        self.proposals: dict[str, Proposal] = {}
        self.forged: set[str] = set()
        self.stale: set[str] = set()
        self.replayed: set[str] = set()
        self.lies: set[str] = set()
        self.reports: Counter[str] = Counter()
        self.rejected_messages: Counter[str] = Counter()
        self._in_head: dict[str, int] = {}
        self._verified: dict[str, bool] = {}
        self.adoptions: dict[str, tuple[str, float]] = {}
        self.target = 0
        self.on_target: Callable[[], None] | None = None
        self.now: Callable[[], float] = lambda: 0.0

    def window_of(self, update_id: str) -> int | None:
        found = self.updates.get(update_id)
        return None if found is None else found[0].window

    def saw_update(self, signed: Signed[Update], behaviour: str) -> None:
        self.updates[signed.record_id] = (signed.record, behaviour)

    def saw_proposal(self, proposal: Proposal) -> None:
        self.proposals.setdefault(proposal.head.id, proposal)

    def reported(self, node: str, peer_id: str, reason: str) -> None:
        self.reports[reason.split(":", maxsplit=1)[0][:60]] += 1

    def rejected_from(self, sender: str, reason: str) -> None:
        self.rejected_messages[sender] += 1

    def saw_certificate(self, head: Head, certificate: QuorumCertificate, node: str) -> None:
        key = certificate.id
        ok = self._verified.get(key)
        if ok is None:
            ok = bool(certificate.verify(self.manifest)) and certificate.head_id == head.id
            self._verified[key] = ok
        if not ok:
            return
        height, head_id = head.height, certificate.head_id
        heads = self.certified[height]
        if head_id in heads:
            return
        heads[head_id] = head
        self.certified_at.setdefault(height, self.now())
        if len(heads) > 1:
            self.violations.append(
                f"two certified heads at height {height}: {sorted(h[:12] for h in heads)}"
            )
        self._check_head(head, head_id)
        if self.target and len(self.certified) == self.target and self.on_target:
            self.on_target()

    def _check_head(self, head: Head, head_id: str) -> None:
        parents = self.certified.get(head.height - 1, {})
        parent = parents.get(head.parent or "") if head.height > 1 else None
        for update_id in head.accepted:
            where = f"head {head_id[:12]} at height {head.height} accepted {update_id[:12]}"
            known = self.updates.get(update_id)
            if update_id in self.forged or known is None:
                self.violations.append(f"{where}: a forged or unknown update")
                continue
            update, behaviour = known
            if update.window != head.height or update.base_head != head.parent:
                self.violations.append(f"{where}: built for another window or base")
            if update_id in self.stale or behaviour in ("forger", "stale"):
                self.violations.append(f"{where}: from the {behaviour} adversary")
            if parent is not None and excluded_until(
                parent.quarantine, update.trainer_id, head.height
            ):
                self.violations.append(f"{where}: its trainer was quarantined")
            if self._in_head.setdefault(update_id, head.height) != head.height:
                self.violations.append(f"{where}: already accepted at another height")

    def adopted(self, node: str, head: Head, head_id: str, now: float) -> None:
        self.adoptions[node] = (head_id, now)
        if head_id not in self.certified.get(head.height, {}):
            self.violations.append(f"{node} adopted head {head_id[:12]} without a certificate")

    def final_check(self, world: World) -> None:
        """All honest, running nodes hold one head with identical weights."""
        finals: dict[tuple[str, str], list[str]] = defaultdict(list)
        for node in world.honest_nodes():
            base = node.machine.base
            weights = sha256_hex(bytes(encode_state_dict(base.weights)))
            finals[(base.head_id, weights)].append(node.name)
        if len(finals) > 1:
            summary = {f"{h[:12]}/{w[:12]}": len(names) for (h, w), names in finals.items()}
            self.violations.append(f"honest nodes disagree on the final head/weights: {summary}")

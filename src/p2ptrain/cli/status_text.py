"""The facts of a node's status that ``p2ptrain status`` prints and its ``--watch`` view
shows, in the same words: one function per fact, each the text after its label."""

from __future__ import annotations

import datetime

from p2ptrain.observe.status import NodeStatus, ValidationMetrics


def mib(size: int) -> str:
    """``size`` bytes in MiB, for people."""
    return f"{size / (1 << 20):,.1f} MiB"


__all__ = ["chain_text", "reduction_text", "store_text", "tallies", "validation_text"]


def store_text(status: NodeStatus) -> str:
    """The blob store: its size, what it keeps, what was collected."""
    kept = f"the last {status.keep_heads} heads' blobs"
    if status.keep_heads is None:
        kept = "every blob (archive)"
    failed = f"; {status.collect_failures} passes failed" if status.collect_failures else ""
    return (
        f"{status.store_blobs} blobs, {mib(status.store_bytes)}; keeps {kept}; collected "
        f"{status.blobs_collected} ({mib(status.bytes_collected)}){failed}"
    )


def validation_text(v: ValidationMetrics) -> str:
    """The evaluators' median validation loss of the latest head they reported on."""
    return (
        f"{v.median_loss:.4f} at height {v.height} (head {v.head_id[:12]}; median of "
        f"{v.reports} report{'s' if v.reports != 1 else ''})"
    )


def chain_text(status: NodeStatus) -> str:
    """What following the chain cost the node since it started, and its peak memory."""
    text = (
        f"{status.chains} copy for its roles; {status.heads_adopted} heads adopted, "
        f"{status.outer_steps} outer steps, {status.certificate_checks} certificates verified"
    )
    if status.peak_rss_mib:
        text += f"; peak memory {status.peak_rss_mib:,.1f} MiB"
    return text


def reduction_text(status: NodeStatus) -> str | None:
    """How long the node's last reduction of a window took, and all of them so far (None:
    the node has not reduced a window)."""
    seconds, window = status.reduction_seconds, status.reduction_window
    if seconds is None or window is None:
        return None
    accepted = status.reduction_accepted
    updates = "" if accepted is None else f", {_count(accepted, 'update')} accepted"
    return (
        f"last took {seconds:.3f} s (window {window}{updates}); "
        f"{_count(status.reductions_timed, 'reduction')} in "
        f"{status.reduction_seconds_total:.2f} s since the node started"
    )


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def tallies(status: NodeStatus) -> list[tuple[str, str]]:
    """The counters, label first: windows, updates, the chain, the last reduction, bytes
    by kind, metrics."""

    def by_reason(counts: dict[str, int]) -> str:
        return ", ".join(f"{label} {n}" for label, n in sorted(counts.items()))

    failed = sum(status.windows_failed.values())
    windows = f"{status.windows_certified} certified"
    if failed:
        windows += f"; {failed} failed here ({by_reason(status.windows_failed)})"
    rejected = sum(status.updates_rejected.values())
    updates = f"{status.updates_accepted} accepted, {rejected} rejected"
    if rejected:
        updates += f" ({by_reason(status.updates_rejected)})"
    lines = [("windows", windows), ("updates", updates)]
    if status.heads_adopted or status.peak_rss_mib:
        lines.append(("chain", chain_text(status)))
    reduced = reduction_text(status)
    if reduced is not None:
        lines.append(("reduction", reduced))
    for direction, counts in (
        ("sent", status.bytes_sent_by_kind),
        ("received", status.bytes_received_by_kind),
    ):
        moved = [f"{kind} {n / 2**20:.2f}" for kind, n in counts.items() if n]
        if moved:
            lines.append((f"MiB {direction}", ", ".join(moved)))
    if status.metrics_address is not None:
        lines.append(("metrics", f"{status.metrics_address}/metrics and dashboard at /"))
    return lines


def admission_rows(status: NodeStatus) -> list[tuple[str, str]]:
    """On a certificate network: the node's certificate, and the peers it refuses."""
    rows = []
    own = status.admission
    if own is not None:
        expiry = "never expires"
        if own.not_after_ms:
            when = datetime.datetime.fromtimestamp(own.not_after_ms / 1000, datetime.UTC)
            expiry = f"expires {when:%Y-%m-%d %H:%M} UTC"
        roles = ", ".join(own.roles) or "any role"
        named = f"{own.name}, " if own.name else ""
        rows.append(("admission", f"{named}{roles}, {expiry}, from issuer {own.issuer[:16]}"))
        if own.renews_at:
            renewed = f", renewed {own.renewed} time(s) since start" if own.renewed else ""
            rows.append(("renewal", f"at {own.renews_at}{renewed}"))
        if own.renewal_problem:
            rows.append(("renewal", f"FAILING: {own.renewal_problem}"))
    for peer in status.revoked:
        rows.append(("revoked", f"{peer.peer_id[:16]} by {peer.issuer[:16]}: {peer.reason or '-'}"))
    return rows

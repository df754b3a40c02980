"""Deterministic discrete-event network simulator: virtual time, links, partitions, crashes."""

"""A node renews its admission certificate before it expires, from the issuer it signed in
at (``p2ptrain sign-in`` kept the issuer's address in the data directory).

The renewal is due when two thirds of the certificate's life have passed; the new one is
shown from the next request on, kept in the data directory and in the status. When the
issuer cannot be reached the node tries again soon (a tenth of the time left, at most five
minutes apart); when it says no (an allow-list changed, a renewal needs a new sign-in), the
status says so, with what to do, and the node keeps training on the certificate it has until
it expires, asking again now and then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from p2ptrain.core.admission import when_text
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import AdmissionCertificate
from p2ptrain.errors import LocalError
from p2ptrain.issuer.client import IssuerUnreachable, kept_issuer, renew, save

__all__ = ["CertificateRenewal", "renewal_for"]

logger = logging.getLogger(__name__)

#: The part of a certificate's life after which it is renewed.
RENEW_AT: Final = 2 / 3
#: The longest pause between two tries after a failure, seconds.
MAX_RETRY_S: Final = 300.0


class CertificateRenewal:
    """Renews ``certificate`` at ``issuer_url`` for as long as the node runs."""

    def __init__(
        self,
        issuer_url: str,
        identity: Identity,
        data_dir: Path,
        certificate: Signed[AdmissionCertificate],
        use: Callable[[Signed[AdmissionCertificate]], None],
    ) -> None:
        self.issuer_url = issuer_url
        self.identity = identity
        self.data_dir = data_dir
        self.certificate = certificate
        self._use = use
        #: Why the last renewal failed ("" when it did not).
        self.problem = ""
        #: How many certificates this node renewed since it started.
        self.renewed = 0

    def _due_in_s(self) -> float:
        record = self.certificate.record
        issued = record.issued_at_ms or int(time.time() * 1000)
        due_ms = issued + (record.not_after_ms - issued) * RENEW_AT
        return max(0.0, due_ms / 1000 - time.time())

    def _left_s(self) -> float:
        return max(0.0, self.certificate.record.not_after_ms / 1000 - time.time())

    async def run(self) -> None:
        wait = self._due_in_s()
        while True:
            await asyncio.sleep(wait)  # a timer: nothing else says when a renewal is due
            try:
                renewed = await renew(self.issuer_url, self.identity, self.certificate)
            except IssuerUnreachable as exc:
                self.problem = f"cannot renew the certificate yet: {exc}"
                logger.warning("%s", self.problem)
                wait = min(MAX_RETRY_S, max(1.0, self._left_s() / 10))
                continue
            except LocalError as exc:
                expiry = when_text(self.certificate.record.not_after_ms)
                self.problem = (
                    f"{exc}; the certificate expires at {expiry}: run p2ptrain sign-in "
                    f"{self.issuer_url} --dir {self.data_dir} (the node takes the new one at "
                    "its next start)"
                )
                logger.error("%s", self.problem)
                wait = min(3600.0, max(10.0, self._left_s() / 3))
                continue
            save(self.data_dir, self.issuer_url, renewed)
            self.certificate = renewed
            self.problem = ""
            self.renewed += 1
            self._use(renewed)
            logger.info(
                "renewed this node's certificate at %s: valid until %s",
                self.issuer_url,
                when_text(renewed.record.not_after_ms),
            )
            wait = self._due_in_s()


def renewal_for(
    data_dir: Path,
    identity: Identity,
    certificate: Signed[AdmissionCertificate] | None,
    use: Callable[[Signed[AdmissionCertificate]], None],
) -> CertificateRenewal | None:
    """The renewal of ``certificate`` (None: it does not expire, or the node did not sign
    in at an issuer, so nobody renews it: ``p2ptrain admit`` certificates)."""
    if certificate is None or not certificate.record.not_after_ms:
        return None
    issuer_url = kept_issuer(data_dir)
    if issuer_url is None:
        return None
    return CertificateRenewal(issuer_url, identity, data_dir, certificate, use)

"""Joining an experiment through its bootstrap seeds (the third way in of :mod:`.setup`).

The signed network manifest comes from the bootstrap seeds (without credentials; it is only
trusted because the experiment, whose id we were given, names its id), then the experiment
manifest (checked to hash to the id) and the genesis weights (checked against the manifest)
with signed requests. A trainer builds the genesis weights from its workload instead, and
downloads them only when what it built differs. Every bootstrap is asked at once and every
one that answers serves the genesis weights; the join fails only when all of them failed,
saying what each did.
"""

from __future__ import annotations

import asyncio
import logging
import time

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Signed, open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest, NetworkManifest
from p2ptrain.core.tensors import encode_state_dict, schema_hash
from p2ptrain.errors import LocalError, ProtocolViolation, StorageFault, TransportError
from p2ptrain.net.auth import ClientCredentials
from p2ptrain.net.client import PeerClient, fetch_network_manifest
from p2ptrain.net.transfer import BlobFetcher
from p2ptrain.node.admission import node_certificate
from p2ptrain.node.persist import NodeStore, decode_genesis
from p2ptrain.node.setup import GenesisBuilder, NodeSettings, Prepared, remember_manifests

__all__ = ["joined"]

logger = logging.getLogger(__name__)


#: Once the first bootstrap answered a join, how long the others may still answer before the
#: genesis fetch starts without them: twice the first one's time, within these bounds (what
#: a dead bootstrap can cost a join). One that answers later is asked if that fetch fails.
_ANSWER_GRACE_S = (0.25, 1.0)

#: How many times a join asks one bootstrap for the genesis weights when it fails in
#: transit (a link stalled or cut: each try resumes from the bytes on disk), and the pause
#: before the second try (doubling after each).
_GENESIS_TRIES = 3
_RETRY_S = 1.0

_Manifests = tuple[Signed[NetworkManifest], Signed[ExperimentManifest]]


class _Answers:
    """The bootstraps' answers to a join as they come: the manifests, who answered them (in
    the order they answered), why each other one failed, and the requests still out."""

    def __init__(self, asks: dict[asyncio.Task[_Manifests], str]) -> None:
        self._asks = asks
        self._pending = set(asks)
        self.started = time.monotonic()
        self.manifests: _Manifests | None = None
        self.answered: list[str] = []
        self.errors: dict[str, str] = {}

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    async def wait_next(self) -> None:
        """Take the next answer or failure (each request is bounded by its own timeout)."""
        await self._take(asyncio.FIRST_COMPLETED, None)

    async def wait_all(self, timeout_s: float) -> None:
        """Take what comes within ``timeout_s``; the requests left stay out."""
        await self._take(asyncio.ALL_COMPLETED, timeout_s)

    async def _take(self, when: str, timeout_s: float | None) -> None:
        if not self._pending:
            return
        done, self._pending = await asyncio.wait(self._pending, timeout=timeout_s, return_when=when)
        for task in [t for t in self._asks if t in done]:  # the operator's order
            address, error = self._asks[task], task.exception()
            if error is None:
                # every answer is the same pair of manifests: _experiment_from checked that
                # the experiment hashes to the id asked for and names the network's id
                self.manifests = self.manifests or task.result()
                self.answered.append(address)
            elif isinstance(error, TransportError | ProtocolViolation):
                self.errors[address] = str(error)
            else:
                raise error


async def joined(
    settings: NodeSettings,
    identity: Identity,
    store: NodeStore,
    experiment_id: str,
    build_genesis: GenesisBuilder | None = None,
) -> Prepared:
    """Ask every bootstrap at once for the experiment and keep every one that answers.
    A node that builds the experiment's workload (``build_genesis``: a trainer) builds the
    genesis weights from it and downloads nothing when they hash to the manifest's. Else
    the genesis weights come from all that answered by the time the first did and a short
    grace passed (the fetcher races them and drops a slow one); should that fetch fail, it
    resumes from those that answered since. No request is cancelled while the join may
    still need it, so the join fails only once every bootstrap failed, saying what each
    did."""
    addresses = list(dict.fromkeys(settings.bootstrap))
    asks = {
        asyncio.create_task(_answer_of(settings, identity, experiment_id, a)): a for a in addresses
    }
    answers = _Answers(asks)
    try:
        prepared = None
        if build_genesis is not None:
            while answers.manifests is None and answers.pending:
                await answers.wait_next()
            if answers.manifests is not None:
                prepared = await _built_here(identity, store, answers.manifests, build_genesis)
        if prepared is None:
            prepared = await _genesis_from(settings, identity, store, experiment_id, answers)
    finally:
        for task in asks:  # the join has what it needs (or failed): the rest are not asked
            task.cancel()
        await asyncio.gather(*asks, return_exceptions=True)
    if prepared is not None:
        return prepared
    raise LocalError(
        f"cannot join experiment {experiment_id[:16]}: "
        + "; ".join(f"{a}: {answers.errors[a]}" for a in addresses)
        + ". Check the seed addresses and that the seeds run this experiment"
    )


async def _built_here(
    identity: Identity,
    store: NodeStore,
    manifests: _Manifests,
    build_genesis: GenesisBuilder,
) -> Prepared | None:
    """The experiment with the genesis weights this node built (its workload's initial
    weights), when they are the manifest's, byte for byte; None (saying why) when they
    cannot be built here or differ: the join downloads them."""
    network, experiment = manifests
    expected = experiment.record.genesis_weights
    try:
        weights = await asyncio.to_thread(build_genesis.build, experiment.record)
        blob = await asyncio.to_thread(encode_state_dict, weights)
    except LocalError as exc:
        logger.info("the genesis weights cannot be built here (%s); downloading them", exc)
        return None
    built = sha256_hex(blob)
    if built != expected:
        logger.log(
            logging.WARNING if build_genesis.expected else logging.INFO,
            "the workload's initial weights here hash to %s, experiment %s's genesis weights "
            "to %s (a model initialised otherwise: unseeded, or another library version); "
            "downloading the experiment's. A factory that seeds its model (torch.manual_seed) "
            "builds them on every trainer instead",
            built[:12],
            experiment.record_id[:16],
            expected[:12],
        )
        return None
    try:
        store.blobs.put(blob)
    except StorageFault as exc:
        raise LocalError(
            f"cannot store the genesis weights of experiment {experiment.record_id[:16]}: "
            f"{exc.problem} ({exc.path}); free disk space there (or make it writable) and "
            "start the node again"
        ) from exc
    logger.info(
        "genesis weights %s built from the workload (the manifest's hash): not downloaded",
        expected[:12],
    )
    return _adopted(identity, store, network, experiment)


async def _genesis_from(
    settings: NodeSettings,
    identity: Identity,
    store: NodeStore,
    experiment_id: str,
    answers: _Answers,
) -> Prepared | None:
    """Fetch the genesis weights from the bootstraps that answered, in rounds: each round
    asks those that answered since the last round failed; when there are none, those that
    failed in transit (too slow, cut off: the next try resumes from the bytes on disk) fewer
    than :data:`_GENESIS_TRIES` times, after a pause that doubles. None once every
    bootstrap failed (``answers.errors`` says why, for each)."""
    tried: list[str] = []
    again: list[str] = []  # failed in transit: asked again in the next round
    tries: dict[str, int] = {}
    client: PeerClient | None = None
    faults: dict[str, str] = {}  # the latest fault of each provider, as the fetcher saw it
    try:
        pause_s = _RETRY_S
        while True:
            new = await _next_round(answers, tried, waits=not again)
            if again and not new:  # a backoff: a stalled link may recover
                joining, asked = experiment_id[:16], ", ".join(again)
                logger.info("joining %s: asking %s again in %.0f s", joining, asked, pause_s)
                await asyncio.sleep(pause_s)
            fresh = new or again  # those not tried yet, alone: a slow one would hold them up
            if not fresh:
                return None
            tried += new
            assert answers.manifests is not None  # someone answered
            network, experiment = answers.manifests
            if client is None:
                client = PeerClient(_credentials(settings, identity, network.record))
            fetcher = BlobFetcher(
                client, store.blobs, timeout_s=settings.fetch_timeout_s, on_fault=faults.__setitem__
            )
            for address in fresh:
                tries[address] = tries.get(address, 0) + 1
            try:
                await fetcher.fetch(experiment.record.genesis_weights, fresh)
            except StorageFault as exc:
                raise LocalError(
                    f"cannot store the genesis weights of experiment {experiment_id[:16]}: "
                    f"{exc.problem} ({exc.path}); free disk space there (or make it "
                    "writable) and start the node again"
                ) from exc
            except (TransportError, ProtocolViolation) as exc:
                in_transit = not isinstance(exc, ProtocolViolation)
                again += [a for a in fresh if in_transit and a not in again]
                again = [a for a in again if tries[a] < _GENESIS_TRIES]
                for address in fresh:
                    why = f"the genesis weights: {faults.get(address, exc)}"
                    answers.errors[address] = why + (
                        f" ({tries[address]} tries)" if tries[address] > 1 else ""
                    )
                pause_s = _RETRY_S * 2 ** (max((tries[a] for a in again), default=1) - 1)
                logger.info(
                    "joining %s: no genesis weights from %s (%s)%s",
                    experiment_id[:16],
                    ", ".join(fresh),
                    exc,
                    "; waiting for the other bootstraps" if answers.pending else "",
                )
                continue
            return _adopted(identity, store, network, experiment)
    finally:
        if client is not None:
            await client.close()


async def _next_round(answers: _Answers, tried: list[str], *, waits: bool = True) -> list[str]:
    """The bootstraps to fetch the genesis weights from next: those that answered and were
    not tried yet, once one did (the first round also waits a short grace for the others);
    none once every bootstrap answered or failed and all that answered were tried.
    ``waits=False``: only those that answered by now (others are asked again anyway)."""
    if not waits:
        await answers.wait_all(0.0)
    while waits and answers.pending and len(answers.answered) == len(tried):
        await answers.wait_next()
    if not tried and answers.answered:
        low, high = _ANSWER_GRACE_S
        first_s = time.monotonic() - answers.started
        await answers.wait_all(min(high, max(low, 2 * first_s)))
    return [a for a in answers.answered if a not in tried]


def _adopted(
    identity: Identity,
    store: NodeStore,
    network: Signed[NetworkManifest],
    experiment: Signed[ExperimentManifest],
) -> Prepared:
    """Keep the manifests of an experiment whose genesis weights are in the store."""
    genesis = decode_genesis(bytes(store.blobs.get(experiment.record.genesis_weights)))
    if schema_hash(genesis) != experiment.record.workload.schema_hash:
        raise LocalError(
            f"the genesis weights of experiment {experiment.record_id[:16]} (as its manifest "
            "names them) do not match its schema hash: the experiment is broken; ask its "
            "seed's operator"
        )
    remember_manifests(store, network, experiment)
    return Prepared(identity, network, experiment, genesis)


async def _answer_of(
    settings: NodeSettings, identity: Identity, experiment_id: str, address: str
) -> _Manifests:
    """:func:`_experiment_from`, bounded by ``settings.join_timeout_s``."""
    try:
        async with asyncio.timeout(settings.join_timeout_s):
            return await _experiment_from(settings, identity, experiment_id, address)
    except TimeoutError:
        raise TransportError(f"no answer within {settings.join_timeout_s:g}s") from None


async def _experiment_from(
    settings: NodeSettings, identity: Identity, experiment_id: str, address: str
) -> _Manifests:
    """The network and experiment manifests as ``address`` serves them, checked."""
    network = open_envelope(await fetch_network_manifest(address), NetworkManifest)
    client = PeerClient(_credentials(settings, identity, network.record))
    try:
        raw = await client.record(address, experiment_id)
    finally:
        await client.close()
    experiment = open_envelope(raw, ExperimentManifest)
    if experiment.record_id != experiment_id:
        raise ProtocolViolation(f"{address} answered another experiment")
    if experiment.record.network_id != network.record_id:
        raise ProtocolViolation(f"{address} serves another network than the experiment's")
    return network, experiment


def _credentials(
    settings: NodeSettings, identity: Identity, network: NetworkManifest
) -> ClientCredentials:
    """What this node shows at a bootstrap's door: its secret proof, and its admission
    certificate on a certificate network."""
    admission = node_certificate(
        network, identity, settings.data_dir, settings.roles, settings.certificate
    )
    return ClientCredentials(network, identity, secret=settings.secret, admission=admission)

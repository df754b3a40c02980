"""Getting a node ready to run: its identity, the manifests it follows and the genesis weights.

Three ways in, tried in this order:

1. **Restart.** The data directory already follows an experiment: the signed manifests and
   the genesis weights are read back from it (the certified chain is restored by the node).
2. **A seed creating the network.** ``experiment_toml`` names an experiment definition: the
   seed signs a network manifest and the experiment manifest with its own key, filling in
   what a registered workload computes (dataset shards, schema hash, genesis weights,
   ``lease_size = inner_steps x batch size``) unless the file sets them.
3. **Joining.** ``experiment_id`` names the experiment: the manifests and the genesis
   weights come from the bootstrap seeds, every one asked at once (:mod:`.join`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Signed, open_envelope, seal
from p2ptrain.core.experiment_config import (
    defined_workload,
    experiment_from_tables,
    parse_experiment_toml,
)
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    ADMISSION_POLICIES,
    ExperimentManifest,
    NetworkManifest,
    minority_quorum_problem,
    secret_check,
)
from p2ptrain.core.tensors import encode_state_dict, schema_hash
from p2ptrain.data.prepare import PreparedDataset, read_prepared
from p2ptrain.driver.failures import DEFAULT_MAX_FAILURES
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.node.data_import import import_prepared
from p2ptrain.node.persist import NodeStore, decode_genesis
from p2ptrain.protocol.retention import DEFAULT_KEEP_HEADS
from p2ptrain.store.keyfile import create_identity, identity_path, load_identity
from p2ptrain.torch.pod import PodSettings

__all__ = [
    "DEFAULT_DATA_CACHE_MB",
    "ROLES",
    "GenesisBuilder",
    "NodeSettings",
    "Prepared",
    "definition_data",
    "new_secret",
    "prepare",
    "read_definition",
    "remember_manifests",
]

logger = logging.getLogger(__name__)

ROLES = ("seed", "trainer", "reducer", "validator", "viewer")
#: How many MiB of a prepared dataset's shards a trainer keeps by default.
DEFAULT_DATA_CACHE_MB = 4096
_MANIFEST_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(ExperimentManifest)}


@dataclass(frozen=True)
class NodeSettings:
    """Everything a node is told by its operator (the CLI builds this from TOML and flags)."""

    data_dir: Path
    #: One or more of :data:`ROLES` (one identity, data directory, server and store).
    roles: tuple[str, ...]
    #: The experiment to join (64 hex), or None on restart / for a seed creating one.
    experiment_id: str | None = None
    #: A seed creating the network: the experiment definition (TOML) to sign.
    experiment_toml: Path | None = None
    #: A seed creating the network may sign a quorum that is not a majority of the
    #: validators (refused otherwise: two disjoint quorums could certify two heads).
    allow_minority_quorum: bool = False
    bootstrap: tuple[str, ...] = ()
    #: Listen address; None runs no server (outbound only, or relayed through ``relay``).
    host: str | None = "127.0.0.1"
    port: int = 0
    advertise: tuple[str, ...] = ()
    relay: str | None = None
    #: A private network's secret (every request proves it).
    secret: bytes | None = None
    #: A seed creating the network: ``open`` (anyone, or anyone with the secret) or
    #: ``certificate`` (only peers holding an issuer's admission certificate).
    admission: str = "open"
    #: A certificate network's issuer keys (empty: the seed's own key).
    issuers: tuple[bytes, ...] = ()
    #: This node's admission certificate to a certificate network (``p2ptrain admit``
    #: writes one; kept in the data directory from then on).
    certificate: Path | None = None
    #: Serve over TLS with a self-signed certificate whose fingerprint the signed peer
    #: record pins.
    tls: bool = False
    network_name: str = "p2ptrain"
    #: Stop after taking part in this many more certified windows, counted from the height
    #: the node is at once it has caught up (None: run until stopped).
    windows: int | None = None
    #: Stop once the chain reaches this height (None: run until stopped).
    until_height: int | None = None
    #: A reducer or validator closes a window before its deadline once every trainer it
    #: expects has reported (False: every window waits for its deadline, for steady window
    #: lengths and room for trainers it does not expect yet).
    close_early: bool = True
    #: Torch threads for training and reductions.
    threads: int = 1
    mdns: bool = False
    #: How often the node asks a peer whether the chain moved past it (missed certificates).
    sync_interval_s: float = 2.0
    #: Seconds a blob fetch waits for bytes before failing over.
    fetch_timeout_s: float = 30.0
    #: Seconds a join waits for each bootstrap's manifests before it gives up on that one.
    join_timeout_s: float = 60.0
    #: A gossip socket whose peer answers no ping for this long is closed (no strike).
    heartbeat_s: float = 20.0
    #: A role whose steps fail this many times in a row ends the node.
    max_role_failures: int = DEFAULT_MAX_FAILURES
    #: Keep every accepted update and proposal for good (who proposed and trained what),
    #: and every blob; otherwise a node keeps the records its roles used, for the last
    #: certified window, and collects the blobs it no longer needs (``keep_heads``).
    archive: bool = False
    #: Certified heads whose blobs (weights, outer-optimizer state) a node keeps besides the
    #: genesis weights; older heads' blobs and older windows' updates are deleted
    #: (:mod:`p2ptrain.protocol.retention`; ``archive`` keeps everything).
    keep_heads: int = DEFAULT_KEEP_HEADS
    #: The workload's code, when it is not built in or installed: ``path/file.py:factory``
    #: or ``package.module:factory`` (a seed signs it into the experiment; a trainer runs it).
    workload: str | None = None
    #: Where a trainer trains: ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
    device: str = "cpu"
    #: Evaluate every certified head the node adopts on the experiment's validation data
    #: and publish a signed metrics report (builds the experiment's workload).
    evaluate: bool = False
    #: A prepared dataset (``p2ptrain data prepare``) whose shards the node serves.
    serve_data: Path | None = None
    #: The most bytes of fetched shards a trainer keeps (least recently leased out first).
    data_cache_bytes: int = DEFAULT_DATA_CACHE_MB << 20
    #: ``HOST:PORT`` of a listener of its own for ``/metrics`` and the dashboard (None:
    #: ``/metrics`` answers loopback callers of the node's server only).
    metrics_listen: str | None = None
    #: This process's place in a pod of trainer ranks (``torchrun``); rank 0 is the node.
    pod: PodSettings | None = None

    def __post_init__(self) -> None:
        unknown = [r for r in self.roles if r not in ROLES]
        if unknown or not self.roles:
            raise LocalError(f"roles {list(self.roles)}: choose one or more of {', '.join(ROLES)}")
        object.__setattr__(self, "roles", tuple(dict.fromkeys(self.roles)))
        if self.max_role_failures < 1:
            raise LocalError(
                f"--max-role-failures {self.max_role_failures}: use 1 or more (a role that "
                "fails that many steps in a row stops the node)"
            )
        if self.experiment_toml is not None and "seed" not in self.roles:
            raise LocalError(
                "--experiment-toml is for the node that creates the network: add --role seed"
            )
        if self.admission not in ADMISSION_POLICIES:
            raise LocalError(
                f"--admission {self.admission!r}: choose {' or '.join(ADMISSION_POLICIES)}"
            )
        if (self.admission != "open" or self.issuers) and self.experiment_toml is None:
            raise LocalError(
                "--admission and --issuer are for the seed creating the network (with "
                "--experiment-toml); a joining node learns them from the network's manifest"
            )
        if self.issuers and self.admission != "certificate":
            raise LocalError("--issuer names the issuers of a network with --admission certificate")
        if self.tls and self.host is None:
            raise LocalError(
                "--tls needs a server: give the node --listen HOST:PORT (an outbound-only "
                "node serves nothing to encrypt)"
            )
        if self.keep_heads < 1:
            raise LocalError(
                f"--keep-heads {self.keep_heads}: use 1 or more (a node keeps the blobs of "
                "its last certified heads; --archive keeps every blob)"
            )
        if self.data_cache_bytes < 0:
            raise LocalError(
                f"--data-cache-mb {self.data_cache_bytes / (1 << 20):g}: use 0 or more (0 keeps "
                "only the shards of the current lease)"
            )
        if not 0 < self.join_timeout_s <= 3600:
            raise LocalError(
                f"join timeout {self.join_timeout_s:g}s: use a value in (0, 3600] seconds"
            )
        if self.pod is not None and self.roles != ("trainer",):
            raise LocalError(
                f"a pod of {self.pod.world_size} ranks is one trainer: run it with the "
                f"trainer role alone (roles given: {', '.join(self.roles)})"
            )
        if self.experiment_id is not None and not _is_hex_id(self.experiment_id):
            raise LocalError(f"experiment id {self.experiment_id!r:.80} is not 64 hex digits")


@dataclass(frozen=True)
class Prepared:
    identity: Identity
    network: Signed[NetworkManifest]
    experiment: Signed[ExperimentManifest]
    genesis: dict[str, torch.Tensor]


def _is_hex_id(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _identity(data_dir: Path) -> Identity:
    if identity_path(data_dir).exists():
        return load_identity(data_dir)
    return create_identity(data_dir)


@dataclass(frozen=True)
class GenesisBuilder:
    """What builds the experiment's genesis weights on this machine (a trainer's workload,
    built from the experiment's manifest), so that a join need not download them."""

    build: Callable[[ExperimentManifest], Mapping[str, torch.Tensor]]
    #: whether they should be the manifest's: built from the manifest's workload (a
    #: difference is worth a warning), not taken from a model the user built (Trainer API),
    #: whose weights are its own until the network's replace them
    expected: bool


async def prepare(
    settings: NodeSettings, store: NodeStore, *, build_genesis: GenesisBuilder | None = None
) -> Prepared:
    """The node's identity, the manifests it follows and the genesis weights: restored from
    its data directory, created from an experiment definition (a seed), or joined through
    the bootstraps (``build_genesis``: the genesis weights built here, checked against the
    manifest's hash and downloaded only when they differ)."""
    identity = _identity(settings.data_dir)
    known = store.experiment_id()
    if known is not None:
        if settings.experiment_id not in (None, known):
            raise LocalError(
                f"{settings.data_dir} follows experiment {known}, not {settings.experiment_id}; "
                "use another --dir to join another experiment"
            )
        restored = _restored(identity, store, known)
        if settings.experiment_toml is not None:
            data = _check_definition(
                settings.experiment_toml, restored, settings.data_dir, settings.workload
            )
            if data is not None:
                import_prepared(store.blobs, data, restored.experiment.record.dataset)
        return restored
    if settings.experiment_toml is not None:
        return _created(settings, identity, store)
    if settings.experiment_id is None:
        raise LocalError(
            "no experiment: pass --experiment ID to join one (the seed prints it), or give a "
            "seed an experiment definition (--experiment-toml FILE)"
        )
    if not settings.bootstrap:
        raise LocalError("joining needs a seed: pass --bootstrap http://SEED:PORT")
    from p2ptrain.node.join import joined  # it builds on this module's records

    return await joined(settings, identity, store, settings.experiment_id, build_genesis)


def _restored(identity: Identity, store: NodeStore, experiment_id: str) -> Prepared:
    raw_experiment = store.record(experiment_id)
    if raw_experiment is None:
        raise LocalError(f"{store.datadir.path}: the experiment manifest is missing; rejoin")
    experiment = open_envelope(raw_experiment, ExperimentManifest)
    raw_network = store.record(experiment.record.network_id)
    if raw_network is None:
        raise LocalError(f"{store.datadir.path}: the network manifest is missing; rejoin")
    try:
        network = open_envelope(raw_network, NetworkManifest)
    except ProtocolViolation as exc:
        if "protocol_version" not in str(exc):
            raise
        raise LocalError(
            f"{store.datadir.path} holds a network of another protocol version: {exc}. Its "
            "chain and records cannot be carried over; start this node with a new --dir "
            "(and a new network and experiment), or keep this one with that release"
        ) from exc
    genesis = decode_genesis(store.blobs.get(experiment.record.genesis_weights))
    return Prepared(identity, network, experiment, genesis)


def read_definition(path: Path) -> str:
    """The text of an experiment definition, or a LocalError naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LocalError(f"cannot read the experiment definition {path}: {exc}") from exc


def definition_data(raw: dict[str, Any], path: Path) -> PreparedDataset | None:
    """The prepared dataset a definition's ``[data]`` table names (``prepared = "DIR"``, a
    path relative to the definition's directory), taken out of ``raw``; None without one."""
    table = raw.pop("data", None)
    if table is None:
        return None
    if not isinstance(table, dict) or set(table) != {"prepared"}:
        given = sorted(table) if isinstance(table, dict) else table
        raise LocalError(
            f'{path}: [data] takes one key, prepared = "DIR" (a directory written by '
            f"p2ptrain data prepare); it has {given!r}"
        )
    where = table["prepared"]
    if not isinstance(where, str) or not where:
        raise LocalError(f"{path}: [data] prepared must be a directory path, got {where!r}")
    return read_prepared(path.parent / where)


def _check_definition(
    path: Path, restored: Prepared, data_dir: Path, workload: str | None
) -> PreparedDataset | None:
    """Refuse a seed restarted with a definition other than the experiment it serves: the
    definition, filled in with what the seed computed when it created the experiment, must
    be that experiment to the byte. Returns the prepared dataset the definition names."""
    served = restored.experiment.record
    fill: dict[str, Any] = {
        "network_id": served.network_id,
        "workload": {
            "schema_hash": served.workload.schema_hash,
            "batch_size": served.workload.batch_size,
            "config_hash": served.workload.config_hash,
        },
        "dataset": msgspec.to_builtins(served.dataset),
        "genesis_weights": served.genesis_weights,
        "lease_size": served.lease_size,
    }
    advice = (
        "use a fresh --dir to create a new experiment, or restart with the original "
        "--experiment-toml"
    )
    try:
        raw = parse_experiment_toml(read_definition(path))
        data = definition_data(raw, path)
        if data is not None:
            fill["dataset"] = msgspec.to_builtins(data.manifest)
        _workload_table(raw, workload, path)
        defined = experiment_from_tables(raw, restored.identity.public_key, fill).id
    except LocalError as exc:
        raise LocalError(
            f"{data_dir} follows experiment {restored.experiment.record_id}, which {path} "
            f"does not define ({exc}); {advice}"
        ) from exc
    if defined != restored.experiment.record_id:
        raise LocalError(
            f"{data_dir} follows experiment {restored.experiment.record_id}, not {defined} "
            f"defined by {path}; {advice}"
        )
    return data


def _workload_table(raw: dict[str, Any], given: str | None, path: Path) -> str:
    """Normalise the definition's ``[workload]`` in place (a reference in ``name``, or the
    seed's ``--workload``, becomes ``reference`` with a name made from it) and return the
    name or reference to build the workload from."""
    from p2ptrain.torch.registry import is_reference, reference_name

    code = defined_workload(raw, given, str(path))
    spec = dict(raw.get("workload", {}))
    if is_reference(code):
        spec["reference"] = code
        if not isinstance(spec.get("name"), str) or is_reference(spec["name"]) or given:
            spec["name"] = reference_name(code)
    else:
        spec["name"] = code
        spec.pop("reference", None)
    raw["workload"] = spec
    return code


def _created(settings: NodeSettings, identity: Identity, store: NodeStore) -> Prepared:
    from p2ptrain.torch.capabilities import model_config
    from p2ptrain.torch.registry import config_hash, make_workload

    assert settings.experiment_toml is not None
    path = settings.experiment_toml
    text = read_definition(path)
    certified = settings.admission == "certificate"
    network = NetworkManifest(
        name=settings.network_name,
        authority=identity.public_key,
        secret_check=None if settings.secret is None else secret_check(settings.secret),
        admission=settings.admission,
        issuer_keys=tuple(sorted(set(settings.issuers or [identity.public_key])))
        if certified
        else (),
    )
    signed_network = seal(identity, network)
    raw = parse_experiment_toml(text)
    _check_quorum(raw, path, settings.allow_minority_quorum)
    data = definition_data(raw, path)
    code = _workload_table(raw, settings.workload, path)
    workload = make_workload(
        code, raw["workload"].get("config", {}), dataset=None if data is None else data.manifest
    )
    genesis = workload.initial_weights()
    genesis_blob = bytes(encode_state_dict(genesis))
    inner_steps = int(raw.get("inner_steps", _MANIFEST_DEFAULTS["inner_steps"]))
    fill: dict[str, Any] = {
        "network_id": signed_network.record_id,
        "workload": {
            "schema_hash": schema_hash(genesis),
            "batch_size": workload.batch_size,
            "config_hash": config_hash(
                raw["workload"].get("config", {}),
                model_config(workload),
            ),
        },
        "dataset": msgspec.to_builtins(
            workload.dataset_manifest() if data is None else data.manifest
        ),
        "genesis_weights": sha256_hex(genesis_blob),
        "lease_size": inner_steps * workload.batch_size,
    }
    manifest = experiment_from_tables(raw, identity.public_key, fill)
    if manifest.network_id != signed_network.record_id:
        raise LocalError(
            f"{path}: network_id is set to another network; leave it out and the seed fills "
            "in its own"
        )
    signed = seal(identity, manifest)
    if data is not None:
        import_prepared(store.blobs, data, manifest.dataset)
    store.blobs.put(genesis_blob)
    remember_manifests(store, signed_network, signed)
    return Prepared(identity, signed_network, signed, dict(genesis))


def _check_quorum(raw: dict[str, Any], path: Path, allowed: bool) -> None:
    """Refuse a quorum that is not a majority of the validators unless ``allowed`` (before
    the workload is built: the seed says it at once; a malformed definition is the
    manifest's to name)."""
    quorum, validators = raw.get("quorum"), raw.get("validators")
    if allowed or not isinstance(quorum, int) or not isinstance(validators, list):
        return
    opt_in = "--allow-minority-quorum (NodeSettings.allow_minority_quorum)"
    problem = minority_quorum_problem(quorum, len(validators), opt_in)
    if problem is not None:
        raise LocalError(f"{path}: {problem}")


def remember_manifests(
    store: NodeStore, network: Signed[NetworkManifest], experiment: Signed[ExperimentManifest]
) -> None:
    store.state.put_record(
        network.record_id,
        "network",
        bytes(network.envelope.encode()),
        signer=network.signer_id,
    )
    store.state.put_record(
        experiment.record_id,
        "experiment",
        bytes(experiment.envelope.encode()),
        experiment_id=experiment.record_id,
        signer=experiment.signer_id,
    )
    store.remember_experiment(experiment.record_id)


def new_secret() -> bytes:
    """A fresh network secret (32 random bytes)."""
    return secrets.token_bytes(32)

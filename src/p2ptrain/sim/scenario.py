"""A simulated run's configuration: who takes part, which faults and adversaries, and when."""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.core.manifests import minority_quorum_problem
from p2ptrain.errors import LocalError

__all__ = ["ADVERSARIES", "Crash", "Partitioned", "Scenario", "SlowLink"]

#: Adversaries a scenario can add (each one node, except silent validators).
ADVERSARIES = (
    "replayer",  # re-sends the previous window's updates
    "stale",  # a trainer that always trains from the genesis head
    "forger",  # updates with bad signatures, and updates with a cherry-picked lease
    "lying_reducer",  # proposes a head with altered weights
    "silent_reducer",  # never proposes
    "equivocating_validator",  # attests the honest head and a forged one at every height
    "lying_provider",  # a reducer, honest but for the blobs it serves: each with a byte flipped
)


@dataclass(frozen=True, slots=True)
class Crash:
    """Node ``node`` goes down at ``at_s`` and (unless None) comes back at ``restart_s``."""

    node: str
    at_s: float
    restart_s: float | None = None


@dataclass(frozen=True, slots=True)
class Partitioned:
    """Between ``start_s`` and ``end_s`` the listed nodes are cut off from all others."""

    start_s: float
    end_s: float
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SlowLink:
    node: str
    bandwidth_bytes_s: float
    latency_s: float = 0.2


@dataclass(frozen=True, slots=True)
class Scenario:
    """Everything a simulated run depends on; the same scenario gives the same run."""

    trainers: int
    validators: int
    quorum: int
    windows: int
    seed: int
    reducers: int = 1
    workload: str = "synthetic"
    byzantine: int = 0
    attack: str = "sign_flip"
    rule: str = "trimmed_mean"
    codec: str = "fp16"
    #: the codec's settings, e.g. ``(("dense_windows", 2),)``
    codec_config: tuple[tuple[str, int | float], ...] = ()
    #: ``aggregation.precision``
    precision: str = "fp32"
    #: the outer step: ``nesterov`` (the manifest's default) or ``sgd`` (lr 1)
    outer: str = "nesterov"
    adversaries: tuple[str, ...] = ()
    silent_validators: int = 0
    crashes: tuple[Crash, ...] = ()
    partitions: tuple[Partitioned, ...] = ()
    slow: tuple[SlowLink, ...] = ()
    loss: float = 0.0
    latency_s: float = 0.02
    allow_minority_quorum: bool = False
    min_updates: int = 1
    max_windows_time_factor: float = 4.0

    def __post_init__(self) -> None:
        from p2ptrain.sim.attacks import ATTACKS  # imports torch: not on `sim --help`

        if self.trainers < 1 or self.validators < 1 or self.windows < 1:
            raise LocalError("--trainers, --validators and --windows must each be at least 1")
        if not 1 <= self.quorum <= self.validators:
            raise LocalError(f"--quorum must be between 1 and --validators ({self.validators})")
        problem = minority_quorum_problem(
            self.quorum, self.validators, "--allow-minority-quorum to simulate it anyway"
        )
        if problem is not None and not self.allow_minority_quorum:
            raise LocalError(problem.replace("Raise quorum", "Raise --quorum"))
        if not 0 <= self.byzantine <= self.trainers:
            raise LocalError("--byzantine must be between 0 and --trainers")
        if self.attack not in ATTACKS:
            raise LocalError(f"unknown attack {self.attack!r}; choose one of {', '.join(ATTACKS)}")
        for adversary in self.adversaries:
            if adversary not in ADVERSARIES:
                raise LocalError(
                    f"unknown adversary {adversary!r}; choose from {', '.join(ADVERSARIES)}"
                )
        if not 0 <= self.silent_validators <= self.validators:
            raise LocalError("--silent-validators must be between 0 and --validators")
        if self.reducers < 0:
            raise LocalError("--reducers must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise LocalError("--loss must be in [0, 1)")

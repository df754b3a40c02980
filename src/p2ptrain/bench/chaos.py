"""``p2ptrain bench chaos``: seeded runs of a real local network under kills, pauses and
partitions, long outages and late joiners; do the stores stay sound, the replicas agree, and
the network and its nodes recover?

Each run starts a seed, a reducer, three validators (quorum 2) and two trainers as separate
processes on a tiny char-GPT experiment with short window deadlines (:mod:`.chaos_network`)
-- each node in its own network namespace when this process may create them (root), else on
loopback without partitions -- waits for the first certified head, then plays the faults
that the run's seed draws (:mod:`.chaos_plan`), one after the other: each strikes, holds,
and heals (the killed node's ``ready``, the SIGCONT, the partition's end). From the heal it
times the next head certified anywhere: that is the fault's recovery, and a fault not
followed by one within the stall limit (two window deadlines, at least
:data:`STALL_MIN_S`) stalls the run; the nodes' status and log tails are then kept as the
run's diagnosis. A fault not followed by a head within twice that ends the run's faults.
After the recovery it waits (up to twice the stall limit from the heal) for every victim to
adopt a head at least as high as the network's at the heal (``rejoin_s``; not a verdict,
but a victim that stays behind is noted), and the next fault strikes its ``after_s`` later.

A long run (:class:`~.chaos_plan.LongFaults`) also plays an ``outage`` -- its victim is
killed and stays down while the network certifies more than ``--outage-heights`` heights
(each of them within twice the stall limit of the one before, else the run stalled), then
starts again on its data directory -- and a ``join``: once the chain is longer than
``--outage-heights``, a viewer with an empty data directory starts. Either node must then
adopt a head at least as high as the network's when it was ready within ``catch_up_s``
(:data:`CATCH_UP_S`, 30 s: time to page through more than one 256-link catch-up answer
and fetch the tip's state, with room for two loaded cores); otherwise the run stalled, with
the diagnosis.

At the end every node is stopped cleanly (the trainers first, so that the others settle on
one height) and its data directory is read back (:mod:`.chaos_stores`) for the verdicts of
:mod:`.chaos_report`. Runs go one after the other; the data directories and logs of a
failing run are kept (``details[].kept``), a passing run's are deleted.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from p2ptrain.bench.chaos_network import ChaosNetwork
from p2ptrain.bench.chaos_plan import KINDS, LONG_KINDS, Fault, LongFaults, plan_faults
from p2ptrain.bench.chaos_report import (
    FaultOutcome,
    RunOutcome,
    diverged_replicas,
    lost_heads,
    summarize,
)
from p2ptrain.bench.chaos_stores import read_replica
from p2ptrain.bench.netns_lab import NamespaceLab, namespaces_unavailable
from p2ptrain.errors import LocalError

__all__ = ["ChaosConfig", "FaultTarget", "RunLog", "play_fault", "play_run", "run_chaos_bench"]

#: Peer reports kept per run in the details (all are counted in its notes).
REPORTS_KEPT = 20
#: The shortest stall limit: with sub-second windows a recovery still waits for reconnects
#: and for the nodes' 2-second sync with their peers, not only for a window deadline.
STALL_MIN_S = 10.0
#: How long a node back from a long outage, or a fresh joiner, may take from ``ready`` to
#: the network's height at that moment.
CATCH_UP_S = 30.0
#: Window deadlines at most this long let a trainer be an outage's victim (while one is down
#: every window waits out its deadline: 300 of them must take minutes, not an hour).
SHORT_DEADLINE_S = 1.0
TRAINERS = ("trainer-0", "trainer-1")
VALIDATORS = ("validator-0", "validator-1", "validator-2")


@dataclass(frozen=True)
class ChaosConfig:
    runs: int = 10
    seed: int = 0
    #: Planned fault time per run (quiet gaps and holds; recoveries come on top).
    duration_s: float = 50.0
    deadline_s: float = 10.0
    proposal_s: float = 3.0
    #: Run the nodes in network namespaces (and partition them) when root allows it.
    netns: bool = True
    workdir: str | None = None
    keep_passing: bool = False
    #: Run the nodes with ``p2ptrain -v``: their logs (``<run>/logs``) get debug lines.
    debug_logs: bool = False
    #: Runs whose seed is a multiple of this play a long outage and a fresh joiner (0: none).
    long_every: int = 5
    #: A long outage lasts, and a joiner waits for, more than this many heights (0: none).
    outage_heights: int = 300
    catch_up_s: float = CATCH_UP_S

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise LocalError(f"--runs must be at least 1, got {self.runs}")
        if self.long_every < 0:
            raise LocalError(f"--long-every must be 0 or more, got {self.long_every}")
        if self.outage_heights < 0:
            raise LocalError(f"--outage-heights must be 0 or more, got {self.outage_heights}")
        if self.catch_up_s <= 0:
            raise LocalError(f"catch_up_s must be positive, got {self.catch_up_s}")
        if self.duration_s <= 0:
            raise LocalError(f"--duration-s must be positive, got {self.duration_s}")
        if not 0 < self.proposal_s < self.deadline_s:
            raise LocalError(
                f"need 0 < --proposal-s < --deadline-s, got {self.proposal_s} and {self.deadline_s}"
            )

    def replay_flags(self, netns: bool) -> str:
        """The flags besides --runs and --seed that a replay of one run needs (``netns``:
        whether the runs had namespaces, hence partitions)."""
        flags = []
        defaults = ChaosConfig()
        for name in ("duration_s", "deadline_s", "proposal_s", "long_every", "outage_heights"):
            if getattr(self, name) != getattr(defaults, name):
                flags.append(f"--{name.replace('_', '-')} {getattr(self, name)}")
        if not netns:
            flags.append("--no-netns")
        return " ".join(flags)

    @property
    def stall_after_s(self) -> float:
        """No head this long after a heal is a stall: two window deadlines, at least
        :data:`STALL_MIN_S`."""
        return max(2 * self.deadline_s, STALL_MIN_S)

    @property
    def give_up_after_s(self) -> float:
        return 2 * self.stall_after_s

    @property
    def long_faults(self) -> LongFaults:
        """Which runs are long, and whom their outage may take: a validator (the other two
        keep the quorum), or with short windows a trainer too."""
        short = self.deadline_s <= SHORT_DEADLINE_S
        return LongFaults(
            every=self.long_every,
            heights=self.outage_heights,
            victims=VALIDATORS + TRAINERS if short else VALIDATORS,
        )

    @property
    def first_head_timeout_s(self) -> float:
        return 2 * self.deadline_s + 30.0


def run_chaos_bench(
    config: ChaosConfig, progress: Callable[[str], None] = lambda _line: None
) -> dict[str, Any]:
    """Play ``config.runs`` runs; return the summary (:func:`.chaos_report.summarize`)."""
    skipped = namespaces_unavailable() if config.netns else "namespaces turned off (--no-netns)"
    netns = skipped is None
    kinds = KINDS if netns else tuple(k for k in KINDS if k != "partition")
    if skipped is not None:
        progress(f"partitions skipped: {skipped}; kills and pauses only, on loopback")
    root = Path(config.workdir or tempfile.mkdtemp(prefix="p2ptrain-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for run in range(config.runs):
        seed = config.seed + run
        faults = plan_faults(seed, kinds=kinds, budget_s=config.duration_s, long=config.long_faults)
        progress(f"run {run + 1}/{config.runs}, seed {seed}: "
                 + "; ".join(f.describe() for f in faults))  # fmt: skip
        outcome = play_run(
            seed, faults, config, root / f"seed-{seed}", netns=netns, progress=progress
        )
        outcomes.append(outcome)
        progress(_run_line(outcome))
        for diagnosis in outcome.diagnoses:
            progress(diagnosis)
    if config.workdir is None and not any(root.iterdir()):
        root.rmdir()
    summary = summarize(outcomes, netns=netns, partitions_skipped=skipped)
    summary["seed"] = config.seed
    summary["duration_s"] = config.duration_s
    summary["deadline_s"] = config.deadline_s
    summary["stall_after_s"] = config.stall_after_s
    summary["catch_up_bound_s"] = config.catch_up_s
    summary["outage_heights"] = config.outage_heights
    summary["replay_flags"] = config.replay_flags(netns)
    return summary


def play_run(
    seed: int,
    faults: Sequence[Fault],
    config: ChaosConfig,
    workdir: Path,
    *,
    netns: bool,
    progress: Callable[[str], None] = lambda _line: None,
) -> RunOutcome:
    """Start the network in ``workdir``, play ``faults``, stop it, read the stores."""
    started = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    log = RunLog(seed)
    lab = NamespaceLab(ChaosNetwork.NAMES) if netns else None
    net = ChaosNetwork(
        workdir,
        lab=lab,
        deadline_s=config.deadline_s,
        proposal_s=config.proposal_s,
        debug_logs=config.debug_logs,
    )
    try:
        _play(net, faults, config, log, progress)
        log.notes += net.finish()
    finally:
        net.close()
        if lab is not None:
            lab.close()
    outcome = _verdicts(net, log, workdir, wall_s=time.monotonic() - started)
    if outcome.failed or config.keep_passing:
        return outcome
    shutil.rmtree(workdir, ignore_errors=True)
    return replace(outcome, kept=None)


@dataclass
class RunLog:
    """What a run saw while it played, before the stores are read."""

    seed: int
    played: list[FaultOutcome] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    diagnoses: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


def _play(
    net: ChaosNetwork,
    faults: Sequence[Fault],
    config: ChaosConfig,
    log: RunLog,
    progress: Callable[[str], None],
) -> None:
    """Launch, wait for the first head, play the faults; a run that cannot go on (a node
    that does not start, no recovery at all) records why and stops playing."""
    try:
        net.launch()
        if net.wait_certified_above(0, config.first_head_timeout_s) is None:
            raise LocalError(
                f"no head certified within {config.first_head_timeout_s:.0f} s of the launch"
            )
        for index, fault in enumerate(faults):
            outcome = play_fault(net, fault, config, log)
            log.played.append(outcome)
            progress(f"  {fault.describe()}: {_fault_line(outcome)}")
            left = len(faults) - index - 1
            if outcome.recovery_s is None:
                if left:
                    log.notes.append(f"{left} fault(s) not played: the network did not recover")
                return
    except LocalError as exc:
        log.error = str(exc)
        log.diagnoses.append(net.diagnose(f"seed {log.seed}: {exc}"))


class FaultTarget(Protocol):
    """What :func:`play_fault` needs of a network (:class:`ChaosNetwork`, or a test's)."""

    @property
    def height(self) -> int: ...
    def height_of(self, name: str) -> int: ...
    def pump(self, timeout_s: float, until: Callable[[], bool] | None = None) -> bool: ...
    def kill(self, names: Sequence[str]) -> None: ...
    def restart(self, names: Sequence[str]) -> list[str]: ...
    def join(self, names: Sequence[str]) -> None: ...
    def pause(self, names: Sequence[str]) -> None: ...
    def resume(self, names: Sequence[str]) -> None: ...
    def cut(self, names: Sequence[str]) -> None: ...
    def heal(self) -> None: ...
    def wait_certified_above(self, height: int, timeout_s: float) -> float | None: ...
    def wait_rejoined(
        self, names: Sequence[str], height: int, since: float, timeout_s: float
    ) -> dict[str, float | None]: ...
    def diagnose(self, title: str) -> str: ...


def play_fault(net: FaultTarget, fault: Fault, config: ChaosConfig, log: RunLog) -> FaultOutcome:
    """Strike, hold, heal; time the next certified head, then wait for the victims to be
    back at the network's height (see the module docstring)."""
    net.pump(fault.after_s)
    struck_at = time.monotonic()
    short_of_heights = _strike_and_heal(net, fault, config, log)
    healed_at, height = time.monotonic(), net.height
    long = fault.kind in LONG_KINDS
    behind = height - min(net.height_of(n) for n in fault.victims) if long else None
    at = net.wait_certified_above(height, config.stall_after_s)
    if at is None:
        log.diagnoses.append(
            net.diagnose(
                f"seed {log.seed}: no head certified within {config.stall_after_s:.0f} s "
                f"after {fault.describe()} healed (height {height})"
            )
        )
        at = net.wait_certified_above(height, config.give_up_after_s - config.stall_after_s)
    recovery = None if at is None else round(max(0.0, at - healed_at), 2)
    outcome = FaultOutcome(
        kind=fault.kind,
        victims=fault.victims,
        hold_s=round(healed_at - struck_at, 2) if fault.kind == "outage" else fault.hold_s,
        recovery_s=recovery,
        stalled=recovery is None or recovery > config.stall_after_s or bool(short_of_heights),
        behind=behind,
        note=short_of_heights or "",
    )
    if recovery is None:
        return outcome
    bound_s = config.catch_up_s if long else config.give_up_after_s
    back = net.wait_rejoined(
        fault.victims, height, healed_at, max(0.0, healed_at + bound_s - time.monotonic())
    )
    late = [name for name, t in back.items() if t is None]
    if not late:
        latest = max(t for t in back.values() if t is not None)
        return replace(outcome, rejoin_s=round(max(0.0, latest - healed_at), 2))
    where = ", ".join(f"{name} at {net.height_of(name)}" for name in late)
    if not long:
        return replace(outcome, note=f"not back at height {height}: {where}")
    why = f"not at the tip (height {height}) within {bound_s:.0f} s of ready: {where}"
    log.diagnoses.append(net.diagnose(f"seed {log.seed}: {fault.describe()}: {why}"))
    return replace(outcome, stalled=True, note="; ".join(filter(None, [outcome.note, why])))


def _strike_and_heal(
    net: FaultTarget, fault: Fault, config: ChaosConfig, log: RunLog
) -> str | None:
    """Play ``fault`` up to its heal; for an outage or a join, return why the network did
    not reach the heights the fault waits for (None: it did)."""
    victims, short_of_heights = fault.victims, None
    if fault.kind == "kill":
        net.kill(victims)
        net.pump(fault.hold_s)
        log.lost += net.restart(victims)  # healed once the restarted nodes are ready
    elif fault.kind == "outage":
        net.kill(victims)
        target = net.height + fault.heights + 1
        short_of_heights = _wait_for_height(net, target, fault, config, log)
        log.lost += net.restart(victims)
    elif fault.kind == "join":
        short_of_heights = _wait_for_height(net, fault.heights + 1, fault, config, log)
        net.join(victims)
    elif fault.kind == "pause":
        net.pause(victims)
        net.pump(fault.hold_s)
        net.resume(victims)
    else:
        net.cut(victims)
        net.pump(fault.hold_s)
        net.heal()
    return short_of_heights


def _wait_for_height(
    net: FaultTarget, target: int, fault: Fault, config: ChaosConfig, log: RunLog
) -> str | None:
    """Wait until the network certified ``target``, each head within the give-up limit
    of the one before; return why it did not, with a diagnosis (None: it did)."""
    while net.height < target:
        height = net.height
        if net.wait_certified_above(height, config.give_up_after_s) is None:
            why = (
                f"no head certified for {config.give_up_after_s:.0f} s at height {height}, "
                f"short of height {target}"
            )
            log.diagnoses.append(net.diagnose(f"seed {log.seed}: {fault.describe()}: {why}"))
            return why
    return None


def _verdicts(net: ChaosNetwork, log: RunLog, workdir: Path, *, wall_s: float) -> RunOutcome:
    """Read every node's stopped store and judge the run."""
    replicas = [read_replica(name, workdir / name) for name in net.NAMES if name in net.started]
    notes = [*log.notes, *net.notes]
    notes += [f"role failure: {failure}" for failure in net.role_failures]
    if net.reports:
        notes.append(f"{len(net.reports)} peer report(s)")
    strikes, bans = net.logged_strikes()
    return RunOutcome(
        seed=log.seed,
        wall_s=wall_s,
        faults=tuple(log.played),
        corrupt_stores=tuple(f"{r.name}: {r.problem}" for r in replicas if r.problem),
        lost_heads=(*log.lost, *lost_heads(replicas, net.adopted)),
        diverged=tuple(diverged_replicas(replicas)),
        crashed=tuple(f"{name} {what}" for name, what in net.crashed),
        heights={r.name: r.tip_height for r in replicas},
        error=log.error,
        diagnoses=tuple(log.diagnoses),
        peer_reports=tuple(net.reports[:REPORTS_KEPT]),
        notes=tuple(notes),
        strikes=dict(strikes.most_common()),
        bans=bans,
        kept=str(workdir),
    )


def _fault_line(outcome: FaultOutcome) -> str:
    if outcome.recovery_s is None:
        return "STALLED, no head certified after the heal"
    stalled = " (STALLED)" if outcome.stalled else ""
    back = outcome.note or f"victims back after {outcome.rejoin_s} s"
    if outcome.long and outcome.rejoin_s is not None:
        caught_up = f"{outcome.behind} heights caught up in {outcome.rejoin_s} s"
        back = "; ".join(filter(None, [caught_up, outcome.note]))
    return f"next head {outcome.recovery_s:.1f} s after the heal{stalled}; {back}"


def _run_line(outcome: RunOutcome) -> str:
    verdict = "FAILED" if outcome.failed else "ok"
    heights = sorted(set(outcome.heights.values()))
    problems = [
        f"{label} {len(items)}"
        for label, items in (
            ("corrupt stores", outcome.corrupt_stores),
            ("lost heads", outcome.lost_heads),
            ("diverged", outcome.diverged),
            ("crashed", outcome.crashed),
        )
        if items
    ]
    if outcome.stalled:
        problems.append("stalled")
    if outcome.error:
        problems.append(f"broken: {outcome.error}")
    return f"seed {outcome.seed}: {verdict} in {outcome.wall_s:.0f} s, heights {heights}" + (
        f"; {', '.join(problems)}" if problems else ""
    )

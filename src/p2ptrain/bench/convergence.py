"""``p2ptrain bench convergence``: real DDP, hivemind and our network on one task, on real links.

The three systems train the same task (:mod:`.convergence_task`: the demo's char GPT, the
same total samples) one after the other, as real processes:

* **ddp** -- ``torch.distributed`` DDP with gloo, ``workers`` ranks, global batch ``workers x
  batch``, ``windows x inner_steps`` steps with the experiment's inner AdamW at its lr.
* **p2ptrain** -- our network as the demo runs it (:mod:`.convergence_network`).
* **hivemind** -- ``hivemind.Optimizer`` peers averaging parameters every epoch of one
  window's samples (:mod:`.convergence_hivemind`), when ``make bench-anchors`` installed it.

As root, every host (each rank, peer and node) gets its own network namespace on one bridge,
its link shaped to ``link_mbit`` in both directions (:class:`~.netns_lab.NamespaceLab`), and
bytes are read from the interface counters: frames sent and received, headers included.
Without root the systems share loopback (``netns: false``) and bytes come from each system's
own counters: our nodes' (TCP payload, as the kernel counted it), a formula for DDP's ring
all-reduce, none for hivemind.

Nobody evaluates while training: DDP's rank 0 saves its weights every ``inner_steps`` steps
(at most 25), hivemind's first peer every ``inner_steps`` steps, and our seed keeps every
certified head; once a system stopped, the bench evaluates each on the same validation set.
Clocks start when a system's first process is launched. A sampler reads the byte counters
while a system runs, for the loss against bytes. CPU seconds are those of the system's
processes (``RUSAGE_CHILDREN``).

Time to a loss: ``seconds_to_target`` is the first model at or below 1.02 x DDP's final
validation loss (null if never); ``seconds_to_common`` at or below the *common* loss, the
worst final loss of the systems (which every system reached). Samples and bytes per trainer
(sent, received) are given to each loss too. Ratios are DDP's (or hivemind's) figure over
ours: above 1, ours is sooner or smaller.

Run to target (``until_target``): DDP runs the reference budget first (its final loss sets
the target); then our network and hivemind train until a model of theirs reaches the target,
or a cap of ``cap_factor`` times the reference samples: a watcher evaluates their newest
model while they run (:mod:`.convergence_watch`, at the lowest CPU priority) and stops them
once one reached it. With shaped links the bench also runs DDP on unshaped loopback, the
*compute bound*: the time the same samples take on this machine with communication nearly
free. :func:`run_convergence_links` runs several link rates in one go, the compute bound
once.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import math
import resource
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain.bench.convergence_task import (
    LOOPBACK,
    Placement,
    Task,
    ask_to_stop,
    build_workload,
    load_snapshot,
    read_snapshots,
)
from p2ptrain.bench.netns_lab import NamespaceLab, namespaces_unavailable
from p2ptrain.errors import LocalError
from p2ptrain.observe.events import mean_utilisation

if TYPE_CHECKING:
    from p2ptrain.bench.convergence_network import CertifiedHead, NetworkRun
    from p2ptrain.bench.convergence_watch import TargetWatch

__all__ = ["SYSTEMS", "ConvergenceSettings", "run_convergence", "run_convergence_links"]

SYSTEMS = ("ddp", "p2ptrain", "hivemind")
#: A system reaches the target at this factor of DDP's final validation loss.
TARGET_FACTOR = 1.02
SAMPLE_S = 0.25
WORKLOAD_THREADS = 2

Counters = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class ConvergenceSettings:
    task: Task
    link_mbit: float = 50.0
    netns: bool = True
    systems: tuple[str, ...] = SYSTEMS
    hivemind_python: str | None = None
    workdir: Path = Path("p2ptrain-bench-convergence")
    out_dir: Path = Path("bench/results")
    #: Seconds our network's windows wait for updates (None: sized from a timed step).
    deadline_s: float | None = None
    timeout_s: float = 3600.0
    #: Our network and hivemind train until they reach the target (or the cap).
    until_target: bool = False
    #: The cap of a run to target: this many times the reference samples.
    cap_factor: float = 2.0

    @property
    def cap_windows(self) -> int:
        """The windows (epochs) our network and hivemind may take: the reference run's, or
        the cap's when running to target."""
        if not self.until_target:
            return self.task.windows
        return max(self.task.windows, math.ceil(self.task.windows * self.cap_factor))


@dataclass
class _System:
    """What one system did: the curve and the counters."""

    name: str
    launched: float = 0.0
    ended: float = 0.0
    #: (time.time(), validation loss) of each evaluated model, genesis first.
    points: list[tuple[float, float]] = field(default_factory=list)
    #: The samples every worker together had trained on at each point.
    point_samples: list[int] = field(default_factory=list)
    #: (time.time(), counters per host) sampled while it ran, and the counters before.
    samples: list[tuple[float, Counters]] = field(default_factory=list)
    before: Counters = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    trainer_hosts: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0
    bytes_source: str = "interfaces"
    extra: dict[str, Any] = field(default_factory=dict)
    #: Bytes per trainer at each point when no sampler measured them (DDP's formula).
    point_bytes: list[int] | None = None


class _Sampler:
    """Reads ``probe()`` every :data:`SAMPLE_S` seconds in a thread until stopped."""

    def __init__(self, probe: Callable[[], Counters], into: list[tuple[float, Counters]]):
        self._probe, self._into = probe, into
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bytes-sampler", daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def _take(self) -> None:
        with contextlib.suppress(OSError, LocalError):  # a status mid-write: next time
            self._into.append((time.time(), self._probe()))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._take()


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_convergence_links(
    settings: ConvergenceSettings, links: Sequence[float], say: Callable[[str], None]
) -> dict[str, Any]:
    """:func:`run_convergence` at each link rate of ``links`` (the compute bound measured
    once); one rate gives its report, several a report of their reports."""
    if len(links) == 1:
        return run_convergence(dataclasses.replace(settings, link_mbit=links[0]), say)
    runs: list[dict[str, Any]] = []
    bound: dict[str, Any] | None = None
    for link in links:
        say(f"links at {link} Mbit/s")
        report = run_convergence(
            dataclasses.replace(settings, link_mbit=link), say, compute_bound=bound
        )
        bound = report.get("compute_bound") or bound
        runs.append(report)
    combined = {"link_mbit": list(links), "runs": runs}
    out = settings.out_dir / f"convergence-links-{time.strftime('%Y%m%d-%H%M%S')}.json"
    combined["json"] = str(out)
    out.write_text(json.dumps(combined, indent=1) + "\n")
    say(f"wrote {out}")
    return combined


def run_convergence(
    settings: ConvergenceSettings,
    say: Callable[[str], None],
    *,
    compute_bound: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every system of ``settings``; return the report (and write its JSON and PNG).
    ``compute_bound``: the compute bound measured by an earlier run (not measured again)."""
    from p2ptrain.bench.convergence_network import network_hosts

    task = settings.task
    unknown = set(settings.systems) - set(SYSTEMS)
    if unknown:
        raise LocalError(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    if settings.until_target and "ddp" not in settings.systems:
        raise LocalError(
            "a run to target needs ddp: its final loss at the reference samples is the "
            "target; add ddp to --systems"
        )
    notes: dict[str, str] = {}
    systems = sorted(settings.systems, key=SYSTEMS.index)  # DDP first: it sets the target
    python = _hivemind_python(settings, systems, notes, say)
    hosts = {
        "ddp": [f"ddp-{i}" for i in range(task.workers)],
        "p2ptrain": network_hosts(task),
        "hivemind": [f"hivemind-{i}" for i in range(task.workers)],
    }
    why_not = namespaces_unavailable(("ip", "tc")) if settings.netns else "--no-netns"
    if why_not is not None:
        say(f"no network namespaces ({why_not}): every system runs on loopback, unshaped")
    settings.workdir.mkdir(parents=True, exist_ok=True)
    lab: NamespaceLab | None = None
    results: dict[str, _System] = {}
    try:
        if why_not is None:
            every = [h for name in systems for h in hosts[name]]
            lab = NamespaceLab(every, link_mbit=settings.link_mbit)
            say(f"{len(every)} hosts in network namespaces, links at {settings.link_mbit} Mbit/s")
        placement: Placement = LOOPBACK if lab is None else lab
        target: float | None = None
        for name in systems:
            say(f"running {name}...")
            results[name] = _run_system(
                name,
                settings,
                placement=placement,
                lab=lab,
                hosts=hosts[name],
                python=python,
                target=target,
            )
            say(f"{name}: {results[name].ended - results[name].launched:.0f} s")
            if name == "ddp" and settings.until_target:
                target = results[name].points[-1][1] * TARGET_FACTOR
                say(f"target: validation loss {target:.4f} (1.02 x DDP's final)")
        if settings.until_target and lab is not None and compute_bound is None:
            say("running ddp on unshaped loopback (the compute bound)...")
            unshaped = _run_system(
                "ddp",
                settings,
                placement=LOOPBACK,
                lab=None,
                hosts=hosts["ddp"],
                python=None,
                folder="ddp-unshaped",
            )
            compute_bound = _compute_bound(unshaped, target)
    finally:
        if lab is not None:
            lab.close()
    report = _report(settings, results, notes, netns=lab is not None)
    if compute_bound is not None:
        report["compute_bound"] = compute_bound
        report["time_ratio_vs_compute_bound"] = _ratio(
            compute_bound["seconds_to_target"],
            report["systems"].get("p2ptrain", {}).get("seconds_to_target"),
        )
    _write(settings, report, results, say)
    return report


def _hivemind_python(
    settings: ConvergenceSettings,
    systems: list[str],
    notes: dict[str, str],
    say: Callable[[str], None],
) -> str | None:
    """The interpreter with hivemind, when hivemind is to run; where it is absent, hivemind
    leaves ``systems`` and ``notes`` says why."""
    if "hivemind" not in systems:
        return None
    from p2ptrain.bench.convergence_hivemind import (
        hivemind_python_candidate,
        hivemind_unavailable,
    )

    python = hivemind_python_candidate(settings.hivemind_python)
    why = hivemind_unavailable(python)
    if why is None:
        return python
    notes["hivemind"] = f"hivemind is absent: {why}"
    systems.remove("hivemind")
    say(notes["hivemind"])
    return None


def _run_system(
    name: str,
    settings: ConvergenceSettings,
    *,
    placement: Placement,
    lab: NamespaceLab | None,
    hosts: list[str],
    python: str | None,
    target: float | None = None,
    folder: str | None = None,
) -> _System:
    """Run system ``name`` (its files in ``folder``, by default its name, under the
    workdir); with a ``target`` (a run to target), our network and hivemind train until they
    reach it or the cap."""
    task = settings.task
    capped = dataclasses.replace(task, windows=settings.cap_windows, schedule_windows=task.windows)
    workdir = settings.workdir / (folder or name)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    system = _System(name, hosts=hosts, trainer_hosts=hosts[: task.workers])
    probe = _probe(name, lab, hosts, workdir)
    if probe is not None:
        system.before = probe()
    cpu = _cpu_of_children()
    steps: list[int] = []  # of DDP's snapshots
    sampling = contextlib.nullcontext() if probe is None else _Sampler(probe, system.samples)
    with sampling:
        if name == "ddp":
            from p2ptrain.bench.convergence_ddp import run_ddp

            ddp = run_ddp(task, workdir, placement, hosts, timeout_s=settings.timeout_s)
            system.launched, system.ended = ddp.launched, ddp.ended
            system.points, steps, system.point_samples = _evaluate_snapshots(
                task, ddp.snapshots, ddp.launched
            )
        elif name == "hivemind":
            from p2ptrain.bench.convergence_hivemind import run_hivemind

            assert python is not None
            with _watch_snapshots(capped, target, workdir, reference=task.samples, system=system):
                hive = run_hivemind(
                    capped, workdir, placement, hosts, python=python, timeout_s=settings.timeout_s
                )
            system.launched, system.ended = hive.launched, hive.ended
            system.points, _, system.point_samples = _evaluate_snapshots(
                task, hive.snapshots, hive.launched
            )
            system.extra["epochs"] = max(hive.epochs, default=0)
            system.extra["averaged_epochs"] = hive.averaged_epochs
            system.extra["local_steps"] = sum(hive.steps)
        else:
            from p2ptrain.bench.convergence_network import run_network

            deadline = settings.deadline_s or _deadline_s(task)
            heads: list[CertifiedHead] = []
            stop = threading.Event()
            with _watch_heads(
                capped,
                target,
                workdir / "seed",
                heads,
                stop.set,
                reference=task.samples,
                system=system,
            ):
                run = run_network(
                    capped,
                    workdir,
                    placement,
                    deadline_s=deadline,
                    timeout_s=settings.timeout_s,
                    stop=stop.is_set,
                    certified=heads.append,
                )
            system.launched, system.ended = run.launched, run.ended
            system.points, system.point_samples = _evaluate_heads(task, run)
            system.extra["compute_utilisation"] = mean_utilisation(run.trained.values())
            system.extra.update(_trainer_bytes_by_kind(workdir, system.trainer_hosts))
    system.cpu_seconds = _cpu_of_children() - cpu
    if lab is None:  # loopback: each system's own counters
        if name == "ddp":
            system.bytes_source = "formula"
            system.point_bytes = _ddp_formula_bytes(task, steps)
        elif name == "hivemind":
            system.bytes_source = "none"
        else:
            system.bytes_source = "node counters"
    return system


def _probe(
    name: str, lab: NamespaceLab | None, hosts: list[str], workdir: Path
) -> Callable[[], Counters] | None:
    """What reads the system's byte counters while it runs (None: nothing can)."""
    if lab is not None:
        return lambda: {host: lab.interface_bytes(host) for host in hosts}
    if name == "p2ptrain":
        return lambda: _status_counters(hosts, workdir)
    return None


def _status_counters(hosts: Sequence[str], workdir: Path) -> Counters:
    from p2ptrain.observe.status import read_status

    counters: Counters = {}
    for host in hosts:
        if (workdir / host / "status.json").is_file():
            status = read_status(workdir / host)
            counters[host] = (status.bytes_sent, status.bytes_received)
        else:
            counters[host] = (0, 0)
    return counters


def _trainer_bytes_by_kind(workdir: Path, trainers: Sequence[str]) -> dict[str, Any]:
    """The trainers' mean bytes by kind, downloads and uploads, as their own counters
    attributed them (aggregates, full states, shards, gossip...) in their last status."""
    from p2ptrain.observe.status import mean_bytes_by_kind, read_status

    statuses = [read_status(workdir / host) for host in trainers]
    return {
        "bytes_per_trainer_received_by_kind": mean_bytes_by_kind(statuses, "received"),
        "bytes_per_trainer_sent_by_kind": mean_bytes_by_kind(statuses, "sent"),
    }


def _deadline_s(task: Task) -> float:
    """The demo's window deadline for the task."""
    from p2ptrain.node.local_network import seconds_per_step, window_seconds

    step_s = seconds_per_step(build_workload(task))
    return window_seconds(step_s, task.inner_steps, task.workers)[1]


def _evaluate_snapshots(
    task: Task, directory: Path, launched: float
) -> tuple[list[tuple[float, float]], list[int], list[int]]:
    """Genesis at launch, then each snapshot the first worker saved; the step of each, and
    the samples every worker together had trained on."""
    workload = build_workload(task, threads=WORKLOAD_THREADS)
    snapshots = read_snapshots(directory)
    if not snapshots:
        raise LocalError(f"the first worker left no weight snapshots in {directory}")
    genesis = (launched, workload.evaluate(workload.initial_weights()))
    points = [genesis, *((s.time, workload.evaluate(load_snapshot(s))) for s in snapshots)]
    return points, [0, *(s.step for s in snapshots)], [0, *(s.samples for s in snapshots)]


def _evaluate_heads(task: Task, run: NetworkRun) -> tuple[list[tuple[float, float]], list[int]]:
    """Genesis at launch, then each certified head; and the samples of the updates the
    heads accepted so far (each a trainer's window: ``inner_steps`` batches)."""
    from p2ptrain.node.export import canonical_weights

    workload = build_workload(task, threads=WORKLOAD_THREADS)
    points = [(run.launched, workload.evaluate(workload.initial_weights()))]
    samples = [0]
    for head in run.heads:
        *_, weights = canonical_weights(run.seed_dir, head.head_id)
        points.append((head.at, workload.evaluate(weights)))
        samples.append(samples[-1] + head.accepted * task.inner_steps * workload.batch_size)
    return points, samples


def _watcher_error(system: _System, watch: TargetWatch) -> None:
    """Say in the system's figures why its watcher gave up, if it did (the run then went on
    to the cap)."""
    if watch.error is not None:
        system.extra["watcher_error"] = watch.error


@contextlib.contextmanager
def _watch_heads(
    task: Task,
    target: float | None,
    seed_dir: Path,
    heads: list[CertifiedHead],
    reached: Callable[[], None],
    *,
    reference: int,
    system: _System,
) -> Iterator[None]:
    """While our network runs to ``target``: once its heads accepted the ``reference``
    samples, evaluate its newest certified head (see :func:`_watch_snapshots`)."""
    if target is None:
        yield
        return
    from p2ptrain.bench.convergence_watch import Model, TargetWatch, head_blob

    batch = int(task.config.get("batch_size", 0) or 0)

    def newest() -> Model | None:
        if not heads or sum(h.accepted for h in heads) * task.inner_steps * batch < reference:
            return None
        head = heads[-1]
        return head.head_id, "blob", head_blob(seed_dir, head.weights_blob)

    with TargetWatch(task, target, newest, reached) as watch:
        yield
    _watcher_error(system, watch)


@contextlib.contextmanager
def _watch_snapshots(
    task: Task, target: float | None, workdir: Path, *, reference: int, system: _System
) -> Iterator[None]:
    """While hivemind runs to ``target``: once the peers trained on the ``reference``
    samples, evaluate the first peer's newest snapshot; once one reached it, ask every peer
    to stop two epochs on (an epoch none has reached, so that they all stop at the same
    average).

    Nothing is evaluated while a run is within the reference budget, where the evaluation
    would take CPU from the run it times (DDP's snapshots, like every model's, are
    evaluated after the run): a run that reached the target by then stops at its first
    model past the budget, and the figures come from evaluating every model afterwards."""
    if target is None:
        yield
        return
    from p2ptrain.bench.convergence_task import rank_directory, snapshot_samples
    from p2ptrain.bench.convergence_watch import Model, TargetWatch

    first = rank_directory(workdir, 0)

    def newest() -> Model | None:
        names = sorted(first.glob("step-*.safetensors"))
        if not names or snapshot_samples(names[-1]) < reference:
            return None
        return names[-1].name, "safetensors", names[-1]

    def reached() -> None:  # genesis, then one snapshot per epoch
        epochs = len(list(first.glob("step-*.safetensors"))) - 1
        ask_to_stop(workdir, epochs + 2)

    with TargetWatch(task, target, newest, reached) as watch:
        yield
    _watcher_error(system, watch)


def _ddp_formula_bytes(task: Task, steps: list[int]) -> list[int]:
    """Bytes per rank (sent + received) after each of ``steps``, by the ring all-reduce
    formula."""
    from p2ptrain.torch.baseline import ddp_bytes_per_worker

    parameters = sum(v.numel() for v in build_workload(task).initial_weights().values())
    return [2 * ddp_bytes_per_worker(parameters, step, task.workers) for step in steps]


# -- the report ---------------------------------------------------------------------------


def _delta(system: _System, counters: Counters, host: str) -> tuple[int, int]:
    sent, received = counters.get(host, (0, 0))
    sent0, received0 = system.before.get(host, (0, 0))
    return sent - sent0, received - received0


def _bytes_at(system: _System, index: int) -> tuple[int, int] | None:
    """Mean bytes (sent, received) per trainer by point ``index`` (None: not measured)."""
    if system.point_bytes is not None:  # DDP's formula: as much sent as received
        each_way = system.point_bytes[index] // 2
        return each_way, each_way
    if not system.samples or system.bytes_source == "none":
        return None
    times = [t for t, _ in system.samples]
    before = bisect.bisect_right(times, system.points[index][0]) - 1
    if before < 0:
        return 0, 0
    counters = system.samples[before][1]
    ways = [_delta(system, counters, host) for host in system.trainer_hosts]
    count = max(1, len(ways))
    return sum(w[0] for w in ways) // count, sum(w[1] for w in ways) // count


def _curve(system: _System) -> list[dict[str, float | int | None]]:
    curve: list[dict[str, float | int | None]] = []
    for index, (at, loss) in enumerate(system.points):
        ways = _bytes_at(system, index)
        curve.append(
            {
                "seconds": round(at - system.launched, 2),
                "val_loss": round(loss, 4),
                "bytes": None if ways is None else sum(ways),
                "samples": system.point_samples[index] if system.point_samples else None,
            }
        )
    return curve


def _first_at(system: _System, loss: float | None) -> int | None:
    """The index of the system's first model at or below ``loss``."""
    if loss is None:
        return None
    return next((i for i, (_, v) in enumerate(system.points) if v <= loss), None)


def _seconds_to(system: _System, loss: float | None) -> float | None:
    """Seconds from launch until the system's first model at or below ``loss``."""
    index = _first_at(system, loss)
    return None if index is None else round(system.points[index][0] - system.launched, 2)


def _to_loss(system: _System, loss: float | None, suffix: str) -> dict[str, Any]:
    """Samples, seconds and bytes per trainer until the first model at or below ``loss``
    (None where it never got there, or nothing measured them)."""
    index = _first_at(system, loss)
    ways = None if index is None else _bytes_at(system, index)
    samples = None
    if index is not None and system.point_samples:
        samples = system.point_samples[index]
    return {
        f"seconds_to_{suffix}": _seconds_to(system, loss),
        f"samples_to_{suffix}": samples,
        f"bytes_per_trainer_to_{suffix}": None if ways is None else sum(ways),
        f"bytes_per_trainer_sent_to_{suffix}": None if ways is None else ways[0],
        f"bytes_per_trainer_received_to_{suffix}": None if ways is None else ways[1],
    }


def _compute_bound(system: _System, target: float | None) -> dict[str, Any]:
    """What DDP on unshaped links took: the same samples with communication nearly free."""
    return {
        "system": "ddp on unshaped loopback",
        "final_val_loss": round(system.points[-1][1], 4),
        "wall_seconds": round(system.ended - system.launched, 1),
        "cpu_seconds": round(system.cpu_seconds, 1),
        **_to_loss(system, target, "target"),
    }


def _figures(
    system: _System, target: float | None, common: float | None, task: Task
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "final_val_loss": round(system.points[-1][1], 4),
        **_to_loss(system, target, "target"),
        **_to_loss(system, common, "common"),
        "samples": system.point_samples[-1] if system.point_samples else None,
        "wall_seconds": round(system.ended - system.launched, 1),
        "cpu_seconds": round(system.cpu_seconds, 1),
        "bytes_source": system.bytes_source,
        "bytes_per_trainer": None,
        "bytes_per_trainer_sent": None,
        "bytes_per_trainer_received": None,
        "bytes_sent_all_nodes": None,
    }
    if system.point_bytes is not None:  # DDP's formula: each rank sends as much as it receives
        each_way = system.point_bytes[-1] // 2
        figures.update(
            bytes_per_trainer=2 * each_way,
            bytes_per_trainer_sent=each_way,
            bytes_per_trainer_received=each_way,
            bytes_sent_all_nodes=each_way * task.workers,
        )
    elif system.samples and system.bytes_source != "none":
        last = system.samples[-1][1]
        sent = [_delta(system, last, h)[0] for h in system.trainer_hosts]
        received = [_delta(system, last, h)[1] for h in system.trainer_hosts]
        figures.update(
            bytes_per_trainer_sent=sum(sent) // len(sent),
            bytes_per_trainer_received=sum(received) // len(received),
            bytes_per_trainer=(sum(sent) + sum(received)) // len(sent),
            bytes_sent_all_nodes=sum(_delta(system, last, h)[0] for h in system.hosts),
        )
    figures.update(system.extra)
    figures["nodes"] = len(system.hosts)
    figures["curve"] = _curve(system)
    return figures


def _ratio(top: Any, bottom: Any) -> float | None:
    if top is None or bottom is None or bottom <= 0:
        return None
    return round(float(top) / float(bottom), 3)


def _report(
    settings: ConvergenceSettings,
    results: dict[str, _System],
    notes: dict[str, str],
    *,
    netns: bool,
) -> dict[str, Any]:
    task = settings.task
    ddp = results.get("ddp")
    target = None if ddp is None else ddp.points[-1][1] * TARGET_FACTOR
    # the loss every system reached: the worst final loss
    common = max((system.points[-1][1] for system in results.values()), default=None)
    systems = {name: _figures(system, target, common, task) for name, system in results.items()}
    ours = systems.get("p2ptrain", {})
    theirs = systems.get("ddp", {})
    hive = systems.get("hivemind", {})
    return {
        "link_mbit": settings.link_mbit if netns else None,
        "netns": netns,
        "trainers": task.workers,
        "windows": task.windows,
        "inner_steps": task.inner_steps,
        "staleness": task.staleness,
        "sparse": task.sparse,
        "samples": task.samples,
        "target_val_loss": None if target is None else round(target, 4),
        "bytes_ratio_vs_ddp": _ratio(
            theirs.get("bytes_per_trainer"), ours.get("bytes_per_trainer")
        ),
        "bytes_all_nodes_ratio_vs_ddp": _ratio(
            theirs.get("bytes_sent_all_nodes"), ours.get("bytes_sent_all_nodes")
        ),
        "until_target": settings.until_target,
        "cap_samples": None
        if not settings.until_target
        else dataclasses.replace(task, windows=settings.cap_windows).samples,
        "bytes_to_target_ratio_vs_ddp": _ratio(
            theirs.get("bytes_per_trainer_to_target"), ours.get("bytes_per_trainer_to_target")
        ),
        "samples_to_target_ratio_vs_ddp": _ratio(
            ours.get("samples_to_target"), theirs.get("samples_to_target")
        ),
        "time_ratio_vs_ddp": _ratio(theirs.get("seconds_to_target"), ours.get("seconds_to_target")),
        "time_ratio_vs_hivemind": _ratio(
            hive.get("seconds_to_target"), ours.get("seconds_to_target")
        ),
        "common_val_loss": None if common is None else round(common, 4),
        "time_ratio_vs_ddp_at_common": _ratio(
            theirs.get("seconds_to_common"), ours.get("seconds_to_common")
        ),
        "time_ratio_vs_hivemind_at_common": _ratio(
            hive.get("seconds_to_common"), ours.get("seconds_to_common")
        ),
        "systems": systems,
        "notes": notes,
    }


def _write(
    settings: ConvergenceSettings,
    report: dict[str, Any],
    results: dict[str, _System],
    say: Callable[[str], None],
) -> None:
    out = settings.out_dir
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = out / f"convergence-{stamp}.json"
    png_path = out / f"convergence-{stamp}.png"
    report["json"], report["png"] = str(json_path), str(png_path)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    _plot(report, png_path)
    say(f"wrote {json_path} and {png_path}")


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    figure, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, figures in report["systems"].items():
        curve = figures["curve"]
        by_time.plot([p["seconds"] for p in curve], [p["val_loss"] for p in curve], "-o",
                     markersize=3, label=name)  # fmt: skip
        with_bytes = [p for p in curve if p["bytes"] is not None and p["bytes"] > 0]
        if with_bytes:
            by_bytes.plot([p["bytes"] / 1e6 for p in with_bytes],
                          [p["val_loss"] for p in with_bytes], "-o", markersize=3,
                          label=f"{name} ({figures['bytes_source']})")  # fmt: skip
    for axes in (by_time, by_bytes):
        if report["target_val_loss"] is not None:
            axes.axhline(report["target_val_loss"], linestyle="--", color="grey",
                         linewidth=0.8, label="1.02 x DDP's final loss")  # fmt: skip
        axes.set_ylabel("validation loss")
        axes.grid(alpha=0.3)
        axes.legend()
    link = f"{report['link_mbit']} Mbit/s links" if report["netns"] else "loopback"
    by_time.set_xlabel("seconds since launch")
    by_time.set_title(f"{report['trainers']} workers, {link}")
    by_bytes.set_xscale("log")
    by_bytes.xaxis.set_minor_formatter(NullFormatter())
    by_bytes.set_xlabel("MB sent + received per trainer")
    by_bytes.set_title("validation loss against bytes")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

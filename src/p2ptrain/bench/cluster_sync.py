"""The gradient-sync throughput of a home cluster: DDP's compression hooks against raw gloo.

A p2ptrain home cluster trains with DDP on gloo; by default (``--compression auto``) its
gradients travel plain on fast links and through PowerSGD (error feedback) on slow ones,
chosen from a plain all-reduce's measured rate
(:func:`~p2ptrain.cluster.settings.choose_compression`). :func:`sync_figures` measures what
that buys: two
:mod:`p2ptrain.bench.cluster_sync_rank` processes, on loopback or each in a network
namespace of a :class:`~p2ptrain.bench.netns_lab.NamespaceLab` whose links are shaped to
``link_mbit``, time raw gloo all-reducing the fp32 gradients and DDP synchronising the same
gradients through each hook (how, in the rank module's docstring), in the same run. The
figures are fp32 gradient bytes synchronised per second; for every hook its ratio to raw
gloo, and at the top ``sync_ratio_to_gloo_loopback`` (or ``..._shaped``) for the hook the
cluster chooses on that link (``cluster_hook``: ``allreduce``, DDP's plain one, or
``powersgd``), with DDP set up as the cluster sets it up (gradients as bucket views;
PowerSGD's gradients in one bucket).

Each method's time is the slower rank's median: a sync is done when both ranks have it.

How the ranks start: both at once (importing torch is most of a start). Rank 0 serves the
rendezvous store on a port the kernel picks and prints it; rank 1 reads ``HOST:PORT`` on its
stdin, which is written as soon as rank 0 has said it. Every wait has a deadline of
``timeout_s`` from the start, and both ranks are killed and reaped on every way out. A rank's
stderr goes to ``work_dir/rank<i>.log``, quoted in the error when it fails.
"""

from __future__ import annotations

import functools
import math
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from p2ptrain.bench.children import child_env, log_tail
from p2ptrain.bench.cluster_sync_rank import HOOKS, RankFigures, StorePort
from p2ptrain.bench.netns_lab import NamespaceLab, namespaces_unavailable
from p2ptrain.cluster.settings import choose_compression
from p2ptrain.errors import LocalError

__all__ = ["CLUSTER_HOOKS", "sync_figures"]

#: The bench's hook for each of ``auto``'s choices: the headline is the chosen one's ratio.
CLUSTER_HOOKS = {"none": "allreduce", "powersgd": "powersgd"}

_HOSTS = ("rank0", "rank1")
_LOOPBACK = "127.0.0.1"
_MAX_LINE = 1 << 20
_REAP_S = 30.0
_decoder = msgspec.json.Decoder(StorePort | RankFigures)


def sync_figures(
    *,
    params: int,
    hooks: Sequence[str],
    link_mbit: float | None,
    repeats: int,
    work_dir: Path,
    tensors: int = 8,
    bucket_mb: float | None = None,
    bucket_view: bool = True,
    powersgd_rank: int = 1,
    warmup: int = 3,
    timeout_s: float = 600.0,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Gradient-sync figures of ``params`` fp32 gradients through ``hooks`` (the default
    hook always among them) against raw gloo, on loopback (``link_mbit`` None) or over
    links shaped to ``link_mbit``. Raises :class:`LocalError` with the reason when the
    arguments are wrong, namespaces are unavailable, or a rank fails or runs past
    ``timeout_s``."""
    hooks = list(dict.fromkeys([*CLUSTER_HOOKS.values(), *hooks]))
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        raise LocalError(f"unknown hooks {', '.join(unknown)}: choose from {', '.join(HOOKS)}")
    if params < tensors or tensors < 1 or repeats < 1 or warmup < 3:
        raise LocalError("need params >= tensors >= 1, repeats >= 1 and warmup >= 3")
    if link_mbit is not None and not link_mbit > 0:
        raise LocalError(f"link_mbit must be positive (or None for loopback), got {link_mbit}")
    work_dir.mkdir(parents=True, exist_ok=True)
    rank_args = [
        "--params", str(params), "--tensors", str(tensors), "--hooks", ",".join(hooks),
        "--powersgd-rank", str(powersgd_rank),
        "--repeats", str(repeats), "--warmup", str(warmup), "--timeout", repr(timeout_s),
    ]  # fmt: skip
    if bucket_mb is not None:
        rank_args += ["--bucket-mb", repr(bucket_mb)]
    if bucket_view:
        rank_args.append("--bucket-view")
    run = functools.partial(
        _run_ranks, rank_args=rank_args, work_dir=work_dir, python=python, timeout_s=timeout_s
    )
    if link_mbit is None:
        return _figures(run([[], []], _LOOPBACK), link_mbit)
    reason = namespaces_unavailable(("ip", "tc"))
    if reason is not None:
        raise LocalError(
            f"a run over {link_mbit:g} Mbit/s links needs network namespaces, and {reason}: "
            "run it as root on Linux with iproute2, or leave the link unshaped (loopback)"
        )
    try:
        lab = NamespaceLab(_HOSTS, link_mbit=link_mbit)
    except OSError as exc:
        raise LocalError(f"cannot build the namespace lab for the shaped run: {exc}") from exc
    with lab:
        prefixes = [lab.command_prefix(host) for host in _HOSTS]
        ranks = run(prefixes, lab.address[_HOSTS[0]])
    return _figures(ranks, link_mbit)


def _figures(ranks: Sequence[RankFigures], link_mbit: float | None) -> dict[str, Any]:
    """The figures of both ranks' reports: the slower rank's time for each method."""
    first = ranks[0]
    gloo_s = max(rank.gloo_seconds for rank in ranks)
    chosen = CLUSTER_HOOKS[choose_compression(first.bytes / gloo_s)]
    if chosen not in first.hooks:
        raise LocalError(
            f"the cluster's {chosen} hook was not timed: "
            f"{first.unsupported.get(chosen, 'its rank reported no figures for it')}"
        )
    hooks: dict[str, dict[str, Any]] = {}
    for hook in first.hooks:
        seconds = max(rank.hooks[hook].sync_seconds for rank in ranks)
        if not seconds > 0:
            raise LocalError(
                f"synchronising through the {hook} hook added no measurable time to a "
                f"backward ({seconds:.3g} s): the gradients are too small to time; give more "
                "params or repeats"
            )
        hooks[hook] = {
            "seconds": seconds,
            "bytes_per_s": first.bytes / seconds,
            "ratio_to_gloo": gloo_s / seconds,
            "backward_seconds": max(rank.hooks[hook].backward_seconds for rank in ranks),
            "no_sync_seconds": max(rank.hooks[hook].no_sync_seconds for rank in ranks),
            "bucket_mb": first.hooks[hook].bucket_mb,
        }
        if first.hooks[hook].compress_rate is not None:
            hooks[hook]["compress_rate"] = first.hooks[hook].compress_rate
    network = "loopback" if link_mbit is None else "shaped"
    figures: dict[str, Any] = {
        "network": network,
        "link_mbit": link_mbit,
        "params": first.params,
        "bytes": first.bytes,
        "tensors": first.tensors,
        "bucket_mb": first.bucket_mb,
        "gradient_as_bucket_view": first.bucket_view,
        "repeats": first.repeats,
        "warmup": first.warmup,
        "threads_per_rank": first.threads,
        "interfaces": [rank.interface for rank in ranks],
        "gloo_fp32": {
            "seconds": gloo_s,
            "bytes_per_s": first.bytes / gloo_s,
            "per_tensor_seconds": max(rank.gloo_per_tensor_seconds for rank in ranks),
        },
        "hooks": hooks,
        "unsupported": dict(first.unsupported),
        "cluster_hook": chosen,
        f"sync_ratio_to_gloo_{network}": hooks[chosen]["ratio_to_gloo"],
    }
    if not all(math.isfinite(hook["bytes_per_s"]) for hook in hooks.values()):
        raise LocalError(f"a throughput is not finite: {hooks}")
    return figures


def _read_lines(rank: int, stream: IO[bytes], lines: queue.Queue[tuple[int, bytes]]) -> None:
    """Puts every line of ``stream`` on ``lines``, then ``b""`` at its end."""
    with stream:
        for line in iter(lambda: stream.readline(_MAX_LINE), b""):
            lines.put((rank, line))
    lines.put((rank, b""))


def _run_ranks(
    prefixes: Sequence[Sequence[str]],
    address: str,
    *,
    rank_args: Sequence[str],
    work_dir: Path,
    python: str,
    timeout_s: float,
) -> list[RankFigures]:
    """Runs both ranks (rank ``i`` under ``prefixes[i]``), rank 0's store at ``address``;
    returns their reports in rank order."""
    module = [python, "-m", "p2ptrain.bench.cluster_sync_rank"]
    commands = [
        [*prefixes[0], *module, "--rank", "0", "--listen", address, *rank_args],
        [*prefixes[1], *module, "--rank", "1", "--store", "-", *rank_args],
    ]
    logs = [work_dir / f"rank{rank}.log" for rank in range(2)]
    deadline = time.monotonic() + timeout_s
    lines: queue.Queue[tuple[int, bytes]] = queue.Queue()
    processes: list[subprocess.Popen[bytes]] = []
    readers: list[threading.Thread] = []
    try:
        for rank, command in enumerate(commands):
            with logs[rank].open("wb") as log:
                try:
                    process = subprocess.Popen(
                        command, stdin=subprocess.PIPE if rank else subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=log, env=child_env(),
                    )  # fmt: skip
                except OSError as exc:
                    raise LocalError(
                        f"cannot start sync rank {rank} ({command[0]}): {exc}"
                    ) from exc
            processes.append(process)
            assert process.stdout is not None
            reader = threading.Thread(target=_read_lines, args=(rank, process.stdout, lines),
                                      daemon=True)  # fmt: skip
            reader.start()
            readers.append(reader)
        return _collect(
            processes, lines, logs=logs, address=address, deadline=deadline, timeout_s=timeout_s
        )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        for process in processes:
            process.wait(timeout=_REAP_S)
            if process.stdin is not None:
                process.stdin.close()
        for reader in readers:
            reader.join(timeout=_REAP_S)


def _collect(
    processes: Sequence[subprocess.Popen[bytes]],
    lines: queue.Queue[tuple[int, bytes]],
    *,
    logs: Sequence[Path],
    address: str,
    deadline: float,
    timeout_s: float,
) -> list[RankFigures]:
    """Passes rank 0's port to rank 1, then gathers both reports and exit statuses."""
    reports: dict[int, RankFigures] = {}
    open_streams = {0, 1}
    while open_streams:
        try:
            rank, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            waiting = ", ".join(str(rank) for rank in sorted(open_streams))
            raise LocalError(
                f"sync rank(s) {waiting} did not finish within {timeout_s:g} s: give a longer "
                f"timeout or fewer params; rank {min(open_streams)}: "
                f"{log_tail(logs[min(open_streams)])}"
            ) from None
        if not line:
            open_streams.discard(rank)
            try:
                code = processes[rank].wait(timeout=max(0.0, deadline - time.monotonic()) + 1)
            except subprocess.TimeoutExpired:
                raise LocalError(
                    f"sync rank {rank} closed its output but did not exit within {timeout_s:g} "
                    f"s; {log_tail(logs[rank])}"
                ) from None
            if code != 0 or rank not in reports:
                raise LocalError(
                    f"sync rank {rank} exited with status {code} without its figures; the "
                    f"other rank was stopped; {log_tail(logs[rank])}"
                )
            continue
        try:
            record = _decoder.decode(line)
        except msgspec.DecodeError as exc:  # not JSON, or not a record of the rank's
            raise LocalError(f"sync rank {rank} printed {line[:200]!r}: {exc}") from exc
        if isinstance(record, StorePort):
            peer = processes[1].stdin
            assert peer is not None
            try:
                peer.write(f"{address}:{record.port}\n".encode())
                peer.close()
            except OSError:  # rank 1 is gone; its end of stream says why
                pass
        else:
            reports[rank] = record
    return [reports[0], reports[1]]

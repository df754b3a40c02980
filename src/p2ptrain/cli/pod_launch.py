"""``p2ptrain train --pod-ranks N``: a trainer made of a pod of ranks under ``torchrun``.

``--pod-ranks N`` starts ``torchrun`` (``python -m torch.distributed.run --standalone
--nproc-per-node N --max-restarts R -m p2ptrain train ...``, the same options without
``--pod-ranks``), which runs the trainer N times: each process finds its rank in the
variables ``torchrun`` sets (:func:`pod_from_environment`), rank 0 runs the node and the
others train the windows it commands (:mod:`p2ptrain.node.pod`). ``torchrun --nproc-per-node
N -m p2ptrain train ...`` directly does the same (multi-machine pods: its rendezvous options).
When a rank dies, ``torchrun`` stops the others and starts the pod again, at most
``--pod-restarts`` times.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

from p2ptrain.errors import LocalError
from p2ptrain.node.parent_death import PARENT_ENV

if TYPE_CHECKING:
    from p2ptrain.torch.pod import PodSettings

__all__ = ["add_pod_arguments", "launch_pod", "pod_from_environment", "without_pod_ranks"]

DEFAULT_POD_TIMEOUT_S = 60.0
DEFAULT_POD_RESTARTS = 3


def add_pod_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pod-ranks",
        type=int,
        help="train as a pod of N ranks on this machine under torchrun: the inner steps run "
        "under DDP (gloo on CPU, NCCL with --device cuda, one GPU per rank), rank 0 speaks "
        "for the pod; one update per window",
    )
    parser.add_argument(
        "--pod-timeout-s",
        type=float,
        help=f"seconds a collective of the pod may take before the window fails (default "
        f"{DEFAULT_POD_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--pod-wrap",
        choices=("ddp", "fsdp2"),
        help="how the pod's ranks hold the model: ddp (a whole copy each) or fsdp2 (sharded "
        "among them, for a model that does not fit one device); default: the workload's "
        "choice (pod_wrap), else ddp",
    )
    parser.add_argument(
        "--pod-restarts",
        type=int,
        help=f"how many times torchrun starts the pod again after a rank died (default "
        f"{DEFAULT_POD_RESTARTS})",
    )


def pod_from_environment(
    environ: Mapping[str, str], *, timeout_s: float | None, wrap: str | None = None
) -> PodSettings | None:
    """This process's place in a pod, from the variables ``torchrun`` sets (None: not in
    a pod)."""
    if "TORCHELASTIC_RUN_ID" not in environ and "LOCAL_RANK" not in environ:
        return None
    from p2ptrain.torch.pod import pod_settings

    return pod_settings(
        environ,
        timeout_s=DEFAULT_POD_TIMEOUT_S if timeout_s is None else float(timeout_s),
        wrap=wrap,
    )


def without_pod_ranks(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--pod-ranks N`` (or ``--pod-ranks=N``)."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--pod-ranks":
            skip = True
        elif not word.startswith("--pod-ranks="):
            kept.append(word)
    return kept


def launch_pod(argv: Sequence[str], ranks: int, restarts: int | None) -> NoReturn:
    """Replace this process with ``torchrun`` running ``p2ptrain`` with ``argv`` (without
    ``--pod-ranks``) on ``ranks`` ranks."""
    if ranks < 1:
        raise LocalError(f"--pod-ranks {ranks}: use 1 or more ranks")
    restarts = DEFAULT_POD_RESTARTS if restarts is None else restarts
    if restarts < 0:
        raise LocalError(f"--pod-restarts {restarts}: use 0 or more")
    if "LOCAL_RANK" in os.environ:
        raise LocalError(
            "--pod-ranks inside torchrun: torchrun already started the pod's ranks; drop "
            "--pod-ranks (or do not start this command with torchrun)"
        )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.5",
        "-m",
        "p2ptrain",
        *without_pod_ranks(argv),
    ]
    # the ranks' parent is torchrun's agent, which keeps this pid (exit_with_parent)
    os.environ[PARENT_ENV] = str(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)  # does not return

"""How much faster one trainer trains as a pod of 2 CPU ranks than as a pod of 1.

Each pod size runs under ``torchrun`` (``--standalone``, one torch thread per rank), the
ranks running this module as their program (``--rank-child``): every rank builds the same
char-GPT workload and joins the pod exactly as a pod trainer's ranks do
(:class:`~p2ptrain.torch.pod.PodGroup`, :class:`~p2ptrain.torch.pod.PodReplica`); rank 0
drives windows through :class:`~p2ptrain.node.pod.PodWorkload`, the pod trainer's own
workload, and the others :func:`~p2ptrain.torch.pod.follow` it. After one warm-up window,
rank 0 times ``windows`` windows of ``steps`` inner steps and reports the samples per second
(the lease's minibatches, split among the ranks; the weights' broadcast, the parts sent to
the ranks and DDP's all-reduces included). The network is not part of it: a pod trainer's
downloads and uploads are a single trainer's.

``scaling`` is the 2-rank pod's samples/s over the 1-rank pod's (2.0 is perfect), and
``scaling_efficiency`` that over 2. On a machine with two cores, the two ranks share them
with the ranks' gloo threads, so expect well under 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2ptrain.bench.children import child_env, log_tail
from p2ptrain.errors import LocalError

__all__ = ["POD_CONFIG", "pod_scaling"]

#: A char-GPT whose inner step is compute, not overhead (about 0.4M parameters).
POD_CONFIG: dict[str, int | float] = {
    "n_layer": 2,
    "n_embd": 128,
    "n_head": 4,
    "block_size": 64,
    "batch_size": 16,
}
_CHILD_TIMEOUT_S = 600.0


def pod_scaling(
    *, windows: int = 3, steps: int = 20, wrap: str = "ddp", workdir: Path | None = None
) -> dict[str, Any]:
    """Samples/s of a pod of 1 and of 2 ranks (``wrap``: ddp or fsdp2), and the scaling
    between them."""
    with tempfile.TemporaryDirectory(dir=workdir) as temporary:
        rates = {ranks: _run_pod(ranks, windows, steps, wrap, Path(temporary)) for ranks in (1, 2)}
    scaling = rates[2]["samples_per_s"] / rates[1]["samples_per_s"]
    return {
        "pod_1_samples_per_s": round(rates[1]["samples_per_s"], 2),
        "pod_2_samples_per_s": round(rates[2]["samples_per_s"], 2),
        "scaling": round(scaling, 3),
        "scaling_efficiency": round(scaling / 2, 3),
        "pod_windows": windows,
        "pod_inner_steps": steps,
        "pod_parameters": rates[1]["parameters"],
        "pod_threads_per_rank": 1,
        "pod_wrap": wrap,
    }


def _run_pod(ranks: int, windows: int, steps: int, wrap: str, workdir: Path) -> dict[str, Any]:
    out, log = workdir / f"pod-{ranks}.json", workdir / f"pod-{ranks}.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "--max-restarts=0", "-m", "p2ptrain.bench.pod_scaling",
        "--rank-child", "--windows", str(windows), "--steps", str(steps), "--out", str(out),
        "--wrap", wrap,
    ]  # fmt: skip
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as handle:
        try:
            code = subprocess.run(
                command, env=env, stdout=handle, stderr=subprocess.STDOUT,
                timeout=_CHILD_TIMEOUT_S, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = None
    if code != 0 or not out.exists():
        raise LocalError(
            f"bench pods: the pod of {ranks} rank(s) failed (exit {code}); {log_tail(log)}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _rank_child(windows: int, steps: int, wrap: str, out: Path) -> int:
    """One rank of a pod under torchrun (this module as its program)."""
    import torch

    from p2ptrain.node.pod import PodWorkload
    from p2ptrain.torch.char_gpt import char_gpt_workload
    from p2ptrain.torch.pod import PodGroup, follow, pod_settings
    from p2ptrain.torch.pod_fsdp import make_replica

    torch.set_num_threads(1)
    workload = char_gpt_workload(POD_CONFIG)
    group = PodGroup(pod_settings(os.environ, timeout_s=120.0), torch.device("cpu"))
    replica = make_replica(group, workload, batch_size=workload.batch_size, wrap=wrap)
    if group.rank != 0:
        follow(group, replica, lambda _command: None)
        group.close()
        return 0
    pod = PodWorkload(workload, group, replica)
    base = workload.initial_weights()
    lease = list(range(steps * workload.batch_size))
    pod.train_window(base, lease, steps=steps, seed=0)  # warm-up
    started = time.perf_counter()
    for window in range(1, windows + 1):
        pod.train_window(base, lease, steps=steps, seed=window)
    seconds = time.perf_counter() - started
    pod.close()
    samples = windows * steps * workload.batch_size
    parameters = sum(t.numel() for t in base.values())
    out.write_text(
        json.dumps(
            {"samples_per_s": samples / seconds, "seconds": seconds, "parameters": parameters}
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.pod_scaling")
    parser.add_argument("--rank-child", action="store_true", required=True)
    parser.add_argument("--windows", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--wrap", default="ddp")
    args = parser.parse_args(argv)
    return _rank_child(args.windows, args.steps, args.wrap, args.out)


if __name__ == "__main__":
    sys.exit(main())

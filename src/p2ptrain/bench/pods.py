"""``p2ptrain bench pods``: the trusted cases on ``torch.distributed``, measured in one run.

* **Pod scaling** (:mod:`.pod_scaling`): samples/s of one trainer as a pod of 1 and of 2
  CPU ranks (one thread each), and ``scaling_efficiency``.
* **Cluster gradient sync** (:mod:`.cluster_sync`): fp32 gradient bytes synchronised per
  second through the cluster's compression hook (fp16 by default; PowerSGD and bf16 too),
  against a raw gloo all-reduce of the same fp32 tensors in the same run: on loopback
  (``sync_ratio_to_gloo_loopback``) and, as root, on links shaped to ``--link-mbit`` in
  network namespaces (``sync_ratio_to_gloo_shaped``).
* **Re-forming** (:mod:`.cluster_reform`): seconds from a cluster member's SIGKILL to the
  next completed step, for a member and for the leader (``reform_seconds_member``,
  ``reform_seconds_leader``).

A part that cannot run here (no network namespaces without root) is reported with the
reason instead of a figure; the others still run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from p2ptrain.bench.cluster_reform import reform_seconds
from p2ptrain.bench.cluster_sync import sync_figures
from p2ptrain.bench.pod_scaling import pod_scaling
from p2ptrain.errors import LocalError

__all__ = ["run_pods_bench"]

#: The cluster's default compression hook, and the others it reports.
HOOKS = ("fp16", "powersgd", "bf16")


def run_pods_bench(
    *,
    windows: int = 3,
    steps: int = 20,
    sync_params: int = 10_000_000,
    repeats: int = 5,
    link_mbit: float = 100.0,
    reform: bool = True,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Every figure of the benchmark (see the module docstring) in one dict."""
    result: dict[str, Any] = {}
    result.update(pod_scaling(windows=windows, steps=steps, workdir=workdir))
    with tempfile.TemporaryDirectory(dir=workdir) as temporary:
        work = Path(temporary)
        loopback = sync_figures(
            params=sync_params, hooks=HOOKS, link_mbit=None, repeats=repeats, work_dir=work
        )
        result["sync_loopback"] = loopback
        result["sync_ratio_to_gloo_loopback"] = loopback.get("sync_ratio_to_gloo_loopback")
        try:
            shaped = sync_figures(
                params=sync_params,
                hooks=HOOKS,
                link_mbit=link_mbit,
                repeats=repeats,
                work_dir=work,
            )
        except LocalError as exc:
            result["sync_shaped"] = {"skipped": str(exc)}
            result["sync_ratio_to_gloo_shaped"] = None
        else:
            result["sync_shaped"] = shaped
            result["sync_ratio_to_gloo_shaped"] = shaped.get("sync_ratio_to_gloo_shaped")
        result["link_mbit"] = link_mbit
        if reform:
            for kill in ("member", "leader"):
                seconds = reform_seconds(kill, work_dir=work / f"reform-{kill}")
                result[f"reform_seconds_{kill}"] = round(seconds, 2)
    return result

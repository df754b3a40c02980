"""A pod whose model is sharded among its ranks with FSDP2 (``fully_shard``).

For a model that does not fit one device: every block of the model (each module held in an
``nn.ModuleList``, as a transformer's layers are) and then the whole model is sharded with
:func:`torch.distributed.fsdp.fully_shard`, so each rank holds ``1/world`` of the weights,
gradients and optimizer state between steps and gathers one block at a time to compute.
Sharding replaces the model's parameters with ``DTensor`` shards, so the replica builds its
inner optimizer again over them (the workload's optimizer's class and parameter groups, by
parameter name).

What crosses the pod's boundary stays whole: the window's base weights are loaded from rank
0's full state (``set_model_state_dict(..., broadcast_from_rank0=True)``), and at the end of
the window every rank takes part in gathering the full weights and optimizer state onto rank
0's CPU (``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict``),
which the trainer then encodes and saves as any trainer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from p2ptrain.errors import LocalError
from p2ptrain.torch.pod import PodGroup, PodReplica

__all__ = ["ShardedReplica", "make_replica"]

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: Only the parameters travel (buffers are the model's own, a tied alias is its parameter).
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)


class ShardedReplica(PodReplica):
    """A pod's replica sharded with FSDP2."""

    wrap = "fsdp2"

    def _wrap(self, workload: Any) -> nn.Module:
        model = self.model
        # the work group's mesh: its backend (NCCL on GPUs) and the pod's timeout
        mesh = DeviceMesh.from_group(self.group.work, self.device.type)
        blocks = [
            module
            for parent in model.modules()
            if isinstance(parent, nn.ModuleList)
            for module in parent
            if any(True for _ in module.parameters())
        ]
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        names = {id(param): name for name, param in self.params.items()}
        old = self.optimizer
        sharded = dict(model.named_parameters())
        groups = [
            {
                **{key: value for key, value in group.items() if key != "params"},
                "params": [sharded[names[id(param)]] for param in group["params"]],
            }
            for group in old.param_groups
        ]
        try:
            build: Any = type(old)  # e.g. AdamW(params): every group carries its settings
            self.optimizer = build(groups)
        except TypeError as exc:
            raise LocalError(
                f"--pod-wrap fsdp2: the inner optimizer {type(old).__name__} cannot be built "
                f"again over the sharded parameters ({exc}); use --pod-wrap ddp"
            ) from exc
        self.params = {name: sharded[name] for name in self.params}
        self._weights: dict[str, torch.Tensor] = {}
        self._state: dict[str, torch.Tensor] = {}
        return model

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        full: dict[str, Any] = {}
        if self.group.rank == 0 and weights is not None:
            full = dict(weights)
        set_model_state_dict(self.model, full, options=_FROM_RANK0)

    def load_optimizer_state(self, state: Mapping[str, torch.Tensor] | None) -> None:
        structured: dict[str, Any] = {}
        if self.group.rank == 0 and state:
            entries: dict[str, dict[str, torch.Tensor]] = {}
            for flat, tensor in state.items():
                name, _, key = flat.rpartition("/")
                entries.setdefault(name, {})[key] = tensor
            names = {id(param): name for name, param in self.params.items()}
            groups = [
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": [names[id(p)] for p in group["params"]],
                }
                for group in self.optimizer.param_groups
            ]
            structured = {"state": entries, "param_groups": groups}
        set_optimizer_state_dict(self.model, self.optimizer, structured, options=_FROM_RANK0)

    def end(self) -> None:
        weights: dict[str, Any] = dict(get_model_state_dict(self.model, options=_GATHER))
        state: dict[str, Any] = dict(
            get_optimizer_state_dict(self.model, self.optimizer, options=_GATHER)
        )
        if self.group.rank != 0:
            return
        self._weights = {
            name: tensor.to(torch.float32).contiguous()
            for name, tensor in weights.items()
            if name in self.params
        }
        flat: dict[str, torch.Tensor] = {}
        for name, entries in state.get("state", {}).items():
            for key, value in entries.items():
                flat[f"{name}/{key}"] = (
                    value if isinstance(value, torch.Tensor) else torch.tensor(value)
                )
        self._state = flat

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self._weights)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return dict(self._state)


def make_replica(group: PodGroup, workload: Any, *, batch_size: int, wrap: str) -> PodReplica:
    """The replica ``wrap`` (``ddp`` or ``fsdp2``) names."""
    if wrap == "ddp":
        return PodReplica(group, workload, batch_size=batch_size)
    if wrap == "fsdp2":
        return ShardedReplica(group, workload, batch_size=batch_size)
    raise LocalError(f"--pod-wrap {wrap!r}: use ddp or fsdp2")

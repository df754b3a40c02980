"""``p2ptrain bench trainer-memory``: a trainer's peak RSS against a plain training loop.

Two measurements of the same GPT-2 (built from a ``transformers.GPT2Config``, seeded, on
the CPU) on the same minibatches of the Shakespeare corpus (:func:`load_corpus`, cut into
rows of ``block_size`` character ids), each in its own fresh interpreter
(``python -m p2ptrain.bench.trainer_memory --child NAME``) so that neither figure holds the
other's memory:

* **baseline**: a plain loop: AdamW, and per step forward, loss, backward, gradient
  clipping to :data:`~p2ptrain.torch.batch_loss.CLIP_NORM`, step. Nothing else.
* **trainer**: one window as a trainer runs it. The model becomes a workload with
  :func:`~p2ptrain.torch.hf_causal_lm.causal_lm_workload`; the base weights are
  ``workload.initial_weights()`` (a trainer holds the head's weights the same way); then
  :func:`p2ptrain.node.trainer_window.train_update`, the function the trainer runner calls
  in its worker thread: the inner steps, ``Δ = θ_base - θ_local`` encoded with the codec's
  :class:`~p2ptrain.aggregate.codecs.UpdateEncoder` (``int8`` by default, the manifest's
  default), and the optimizer state written by a real
  :meth:`~p2ptrain.node.persist.NodeStore.save_trainer_state` into a temporary data
  directory. What is not measured: the network, the event loop, the blob store put of the
  update and the decoding of certified heads (a trainer in a network does these too; the
  figure is the training window's).

The peak is the process's ``VmHWM`` read at the end of the child
(:func:`~p2ptrain.observe.memory.peak_rss_mib`).
The trainer child also reports the high-water mark just before its optimizer state is saved.
Steps per second: the baseline's over its loop; the trainer's over the whole window
(training, encoding, saving), so they differ by the window's fixed costs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Final

from p2ptrain.bench.children import child_env
from p2ptrain.core.manifests import UPDATE_CODECS
from p2ptrain.errors import LocalError
from p2ptrain.observe.memory import peak_rss_mib

__all__ = ["MAX_RATIO", "MemoryBenchConfig", "run_trainer_memory_bench"]

#: The requirement: a trainer's peak RSS is at most this multiple of the plain loop's.
MAX_RATIO: Final = 2.0
#: The peer id a window's seeds are drawn for (any fixed string).
_PEER: Final = "bench-trainer-memory"
_CHILDREN: Final = ("baseline", "trainer")


@dataclass(frozen=True)
class MemoryBenchConfig:
    """The model (GPT-2 sizes; the vocabulary is the corpus's characters), the batches and
    the trainer's codec. The defaults give a GPT-2 of about 57M parameters."""

    n_layer: int = 8
    n_embd: int = 768
    n_head: int = 12
    block_size: int = 128
    batch_size: int = 8
    steps: int = 10
    lr: float = 3e-4
    samples_per_shard: int = 256
    seed: int = 0
    codec: str = "int8"

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_embd", "n_head", "batch_size", "steps", "samples_per_shard"):
            if getattr(self, key) < 1:
                raise LocalError(f"trainer-memory: {key} must be at least 1")
        if self.block_size < 2:
            raise LocalError("trainer-memory: block_size must be at least 2")
        if self.n_embd % self.n_head:
            raise LocalError("trainer-memory: n_embd must be a multiple of n_head")
        if self.codec not in UPDATE_CODECS:
            raise LocalError(
                f"trainer-memory: codec must be one of {', '.join(UPDATE_CODECS)}, "
                f"got {self.codec!r}"
            )


def run_trainer_memory_bench(
    config: MemoryBenchConfig, *, timeout_s: float = 3600.0
) -> dict[str, Any]:
    """Both measurements, one child process each, and their ratio: one JSON-ready object."""
    figures = {name: _run_child(name, config, timeout_s) for name in _CHILDREN}
    baseline, trainer = figures["baseline"], figures["trainer"]
    ratio = trainer["peak_rss_mib"] / baseline["peak_rss_mib"]
    return {
        "config": asdict(config),
        "parameters": baseline["parameters"],
        "baseline_peak_rss_mib": round(baseline["peak_rss_mib"], 1),
        "trainer_peak_rss_mib": round(trainer["peak_rss_mib"], 1),
        "trainer_peak_rss_before_state_save_mib": round(trainer["before_state_save_mib"], 1),
        "ratio": round(ratio, 3),
        "max_ratio": MAX_RATIO,
        "passed": ratio <= MAX_RATIO,
        "baseline_steps_per_s": round(baseline["steps_per_s"], 3),
        "trainer_steps_per_s": round(trainer["steps_per_s"], 3),
        "update_bytes": trainer["update_bytes"],
    }


def _run_child(name: str, config: MemoryBenchConfig, timeout_s: float) -> dict[str, Any]:
    """Runs one measurement in a fresh interpreter importing this same p2ptrain (killed and
    reaped by ``subprocess.run`` on a timeout or an interrupt)."""
    env = child_env()
    command = [
        sys.executable,
        "-m",
        "p2ptrain.bench.trainer_memory",
        "--child",
        name,
        "--config",
        json.dumps(asdict(config)),
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise LocalError(
            f"trainer-memory: the {name} measurement took over {timeout_s:g} s"
        ) from exc
    if done.returncode != 0:
        raise LocalError(
            f"trainer-memory: the {name} measurement failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-2000:]}"
        )
    lines = done.stdout.strip().splitlines()
    figures: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    if figures.get("child") != name:
        raise LocalError(f"trainer-memory: the {name} measurement printed no result")
    return figures


# ----------------------------------------------------------------------- in the children


def _token_rows(block_size: int) -> tuple[Any, Any]:
    """Train and validation datasets of ``block_size``-long int64 token-id rows (the last
    tenth of the corpus's rows validates)."""
    from p2ptrain.data.shakespeare import load_corpus

    tokens = load_corpus().tokens
    rows = tokens[: len(tokens) // block_size * block_size].reshape(-1, block_size)
    val_rows = max(1, len(rows) // 10)
    return _Rows(rows[:-val_rows]), _Rows(rows[-val_rows:])


class _Rows:
    """A map-style dataset over a uint8 ``[rows, block]`` tensor: row ``i`` as int64 ids."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, index: int) -> Any:
        return self.rows[index].long()


def _gpt2(config: MemoryBenchConfig, vocab_size: int) -> Any:
    import torch
    import transformers

    gpt2 = transformers.GPT2Config(
        n_layer=config.n_layer,
        n_embd=config.n_embd,
        n_head=config.n_head,
        n_positions=config.block_size,
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(config.seed)
    return transformers.GPT2LMHeadModel(gpt2)


def _setup(config: MemoryBenchConfig) -> tuple[Any, Any, Any, list[list[int]], int]:
    """The model, the datasets, the window's minibatches and the parameter count."""
    from p2ptrain.data.shakespeare import load_corpus
    from p2ptrain.node.trainer_runner import window_seed
    from p2ptrain.torch.workload import minibatch_plan

    train, val = _token_rows(config.block_size)
    model = _gpt2(config, load_corpus().vocab_size)
    parameters = sum(param.numel() for param in model.parameters())
    indices = list(range(min(config.samples_per_shard, len(train))))
    seed = window_seed(_PEER, 1)
    plan = minibatch_plan(indices, steps=config.steps, batch_size=config.batch_size, seed=seed)
    return model, train, val, plan, parameters


def _baseline(config: MemoryBenchConfig) -> dict[str, Any]:
    import torch

    from p2ptrain.torch.batch_loss import CLIP_NORM

    model, train, _, plan, parameters = _setup(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    model.train()
    started = time.perf_counter()
    for batch in plan:
        ids = torch.stack([train[i] for i in batch])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimizer.step()
    seconds = time.perf_counter() - started
    return {"parameters": parameters, "steps_per_s": config.steps / seconds}


def _trainer(config: MemoryBenchConfig) -> dict[str, Any]:
    from p2ptrain.aggregate.codecs import make_encoder
    from p2ptrain.core.manifests import CodecSpec
    from p2ptrain.core.tensors import schema_of
    from p2ptrain.node.persist import NodeStore
    from p2ptrain.node.trainer_runner import window_seed
    from p2ptrain.node.trainer_window import train_update
    from p2ptrain.store.datadir import DataDir
    from p2ptrain.torch.hf_causal_lm import causal_lm_workload

    model, train, val, plan, parameters = _setup(config)
    workload = causal_lm_workload(
        model,
        train,
        val,
        batch_size=config.batch_size,
        samples_per_shard=config.samples_per_shard,
        name=f"bench-shakespeare-rows-{config.block_size}",
        lr=config.lr,
    )
    del model
    base = workload.initial_weights()
    encoder = make_encoder(
        CodecSpec(name=config.codec), schema_of(base), seed=window_seed(_PEER, 0)
    )
    indices = list(range(min(config.samples_per_shard, len(train))))
    before_save: list[float] = []
    with tempfile.TemporaryDirectory(prefix="p2ptrain-trainer-memory-") as workdir:
        datadir = DataDir(workdir)
        store = NodeStore(datadir)

        def save_state(state: Any) -> None:
            before_save.append(peak_rss_mib())
            store.save_trainer_state(state, {"window": "1", "experiment": "bench"})

        try:
            started = time.perf_counter()
            update = train_update(
                workload,
                encoder,
                base,
                indices,
                steps=config.steps,
                seed=window_seed(_PEER, 1),
                save_state=save_state,
            )
            seconds = time.perf_counter() - started
        finally:
            datadir.close()
    assert len(plan) == config.steps  # the same minibatches as the baseline's
    return {
        "parameters": parameters,
        "steps_per_s": config.steps / seconds,
        "before_state_save_mib": before_save[0],
        "update_bytes": len(update.blob),
    }


def main(argv: list[str] | None = None) -> int:
    """The child's entry point: one measurement, printed as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.trainer_memory")
    parser.add_argument("--child", choices=_CHILDREN, required=True)
    parser.add_argument("--config", required=True, help="MemoryBenchConfig as JSON")
    args = parser.parse_args(argv)
    config = MemoryBenchConfig(**json.loads(args.config))
    figures = _baseline(config) if args.child == "baseline" else _trainer(config)
    figures.update(child=args.child, peak_rss_mib=peak_rss_mib())
    print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The settings the demo runs the char GPT (:mod:`p2ptrain.torch.char_gpt`) with.

Plain values without torch, so that ``p2ptrain demo --help`` shows them without loading the
model's code. How they were chosen: the char GPT's module docstring.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DEMO_AGGREGATE_PRECISION", "DEMO_CODEC", "DEMO_DEFAULTS"]

#: The protocol settings the demo uses with the char GPT's
#: :data:`~p2ptrain.torch.char_gpt.DEFAULT_CONFIG` (see bench/tune_diloco.py).
DEMO_DEFAULTS: Final[dict[str, int | float]] = {
    #: H: the same 1,200 steps per trainer as 24 windows of 50, in shorter windows: the
    #: certified model ends within 3% of the DDP replay (bench/tune_diloco.py: ratio 1.026
    #: against 1.045 at H = 50; `make demo` 1.020), for 2.5 times the updates' bytes
    "inner_steps": 20,
    "windows": 60,
    "outer_lr": 1.0,
    "outer_momentum": 0.5,
    "trainers": 4,
    #: samples per lease: inner_steps x batch_size, so a window sees each leased sample once
    "lease_size": 320,
    #: window.staleness: 1 lets trainers train the next window while one is certified
    #: (compute utilisation 0.985 against 0.56), but its one-step-delayed outer steps ended
    #: 24 windows at validation loss 1.97 against 1.93 on loopback, so the demo waits
    "staleness": 0,
    #: the inner learning rate decays along a cosine to this fraction of the workload's lr
    #: over the run's windows (bench/tune_diloco.py --cosine 0.1: 24 windows ended at
    #: validation loss 1.877 against 1.913 at a constant rate)
    "min_lr_ratio": 0.1,
}

#: The demo's update codec and aggregation.precision: trainers upload 4-bit blockwise codes
#: (an eighth of float32's bytes) and download each window's aggregate rounded the same way
#: (the outer step applies the rounded values). bench/tune_diloco.py: 24 windows ended at
#: validation loss 1.877 with both at 4 bits, 1.876 with both at 8 bits.
DEMO_CODEC: Final = "int4"
DEMO_AGGREGATE_PRECISION: Final = "int4"

"""Aggregation math: robust rules, outer optimizers, update codecs and screening.

Pure torch on the CPU, no I/O. Everything that enters a signed id is bit-exact: the same
inputs give the same bytes on any machine, thread count or input order (see ``exact``). The
optional C kernel (``native``) is built and installed from outside, by
:mod:`p2ptrain.store.kernel_build`.
"""

"""Settings that several entry points' own sections hold, declared once: the same flag means
the same thing in every entry point (tests/test_cli.py checks that a flag shared by two entry
points sets a setting of the same name and doc)."""

from __future__ import annotations

from config.base import NON_EMPTY, POSITIVE_INT, number_in, setting


def out(default: str):
    return setting(default, "the folder the results are written to", NON_EMPTY)


def quick():
    return setting(False, "small sizes: a smoke run in seconds")


def repeats(default: int):
    return setting(default, "runs of every timed figure, the fastest kept (a shared machine's noise only slows a run)", POSITIVE_INT)


def progress():
    return setting(True, "progress bars on stderr")


def timeout(default: float):
    return setting(default, "seconds a collective may wait before the job fails naming the rank", number_in(0, 86400, lo_open=True))


def attn_backend(choices):
    return setting("auto", "attention: auto (flash-attn, else torch's varlen, on CUDA; the torch path elsewhere)", choices=tuple(choices))

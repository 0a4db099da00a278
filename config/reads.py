"""Which settings a run reads: a setting given (by a flag, a config file or a hardware profile)
that the run would not read is an error naming it and what would read it, never a value recorded
in the results and silently unused.

Most settings are read by every run of every entry point that takes them (an entry point takes
only the settings it reads: `config.cli.Command(only=..., exclude=...)`). The rest are read only
under some other setting: the length mixture's shape only when no other source gives the
documents, the document offsets only with a token file, the checkpoint folder only when the run
checkpoints or resumes. `UNREAD` declares each such case once, and `config.cli.Command.resolve`
checks every command line against it (an entry point may add its own rules:
`Command(unread=...)`), so no entry point checks this alone.

The data sources, in the order one replaces the next (train only: `--replay`, `--tokens`):
  --replay FOLDER   an ablation's steps, its workload and its plans' pricing (experiments.train)
  --tokens FILE     a token file's documents, with --doc-offsets (experiments.train)
  --trace FILE      a length trace's steps
  --lengths FILE    documents drawn from a file's (or a shipped) length distribution
  (none)            documents drawn from the length mixture (--body-*, --long-*)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import SettingError


@dataclass(frozen=True)
class Unread:
    """Settings (`section.setting`, or `section.preset` for a preset's name) that a run does not
    read while `why` gives a reason: why(settings) says why and what would read them, or None
    while they are read."""

    keys: tuple[str, ...]
    why: Callable[[Any], str | None]


def value(settings, key: str):
    """A setting's resolved value, or None where the command has no such section."""
    section, _, name = key.partition(".")
    sections = settings.sections
    return getattr(sections[section], name) if section in sections else None


# the sources that replace the length mixture, in precedence order: the first given one gives the documents
REPLACERS = ("train.replay", "train.tokens", "workload.trace", "workload.lengths")
SOURCE_FLAGS = "--lengths, --trace, --tokens and --replay"


def shown(settings, key: str) -> str:
    """A setting as its route gave it: --trace='t.csv'."""
    return f"{settings.route(key)}={value(settings, key)!r}"


def replacer(settings, among: tuple[str, ...] = REPLACERS) -> str | None:
    """The data source (of `among`) that gives this run's documents, or None: the mixture does."""
    return next((k for k in among if value(settings, k)), None)


def data_source(settings) -> str:
    """The run's documents as the user gave them: "--trace='t.csv'", or the generator's."""
    key = replacer(settings)
    return shown(settings, key) if key else "the generated workload"


def _replaced(among: tuple[str, ...], what: str):
    def why(settings) -> str | None:
        key = replacer(settings, among)
        if key is None:
            return None
        return f"{shown(settings, key)} gives this run's documents, so {what}"

    return why


MIXTURE = tuple(
    f"workload.{k}" for k in ("body_median", "body_sigma", "body_min", "body_max", "long_prob", "long_min")
)  # the length mixture's shape: long_max also clips drawn lengths under clip_to_cluster


def _long_max(settings) -> str | None:
    replaced = _replaced(
        REPLACERS[:3], "the length mixture is not drawn (--long-max shapes it, or clips --lengths' draws with --clip-to-cluster)"
    )
    reason = replaced(settings)
    if reason is None and value(settings, "workload.lengths") and not value(settings, "workload.clip_to_cluster"):
        reason = (
            f"{shown(settings, 'workload.lengths')} gives this run's document lengths, which --long-max clips only with --clip-to-cluster"
        )
    return reason


def _trace_seed(settings) -> str | None:
    if value(settings, "workload.trace") and "train" not in settings.sections:
        return f"{shown(settings, 'workload.trace')} is one fixed workload: a seed changes nothing in it (the driver reads it: its tokens)"
    return None


def _trace_seeds(settings) -> str | None:
    if value(settings, "workload.trace"):
        return f"{shown(settings, 'workload.trace')} is one fixed workload: more seeds would repeat the same steps"
    return None


def _doc_offsets(settings) -> str | None:
    if value(settings, "train.tokens") or value(settings, "train.doc_offsets") is None:
        return None
    return "it gives the document boundaries of a token file, and no --tokens is given: give both, or neither"


def _replay(what: str):
    def why(settings) -> str | None:
        if not value(settings, "train.replay"):
            return None
        return f"{shown(settings, 'train.replay')} runs the ablation's steps, so {what}"

    return why


def _checkpoints(settings) -> str | None:
    t = settings.sections.get("train")
    if t is None or t.save_every or t.resume or t.resume_step is not None:
        return None
    return "the run neither writes nor reads checkpoints: give --save-every N or --resume with it"


def _emulate(settings) -> str | None:
    e = settings.sections.get("emulate")
    if e is None or e.compare:
        return None
    return "without --compare the emulated cluster runs only the module given after '--', which takes its own flags"


UNREAD: tuple[Unread, ...] = (
    Unread(MIXTURE, _replaced(REPLACERS, "the length mixture is not drawn (its settings are read with no " + SOURCE_FLAGS + ")")),
    Unread(("workload.long_max",), _long_max),
    Unread(
        ("workload.clip_to_cluster",),
        _replaced(REPLACERS[:3], "no document is drawn to clip (--clip-to-cluster clips generated and --lengths documents)"),
    ),
    Unread(("workload.lengths",), _replaced(REPLACERS[:2], "no length is drawn from --lengths")),
    Unread(("workload.trace",), _replaced(REPLACERS[:2], "the trace is not read")),
    Unread(("train.tokens",), _replaced(REPLACERS[:1], "the token file is not read")),
    Unread(
        ("workload.fill", "workload.tokens_per_step"),
        _replaced(("train.replay", "workload.trace"), "the batch settings are not read (they size generated steps and a token file's)"),
    ),
    Unread(("workload.seed",), _trace_seed),
    Unread(("ablation.seeds", "sweep.seeds", "advise.seeds", "advise.sensitivity_seeds"), _trace_seeds),
    Unread(("advise.vary_fill",), _replaced(("workload.trace",), "no fill is varied (a trace's steps are fixed)")),
    Unread(("train.doc_offsets",), _doc_offsets),
    Unread(("planner.assignment_pricing",), _replay("its plans are priced as the ablation priced them")),
    Unread(("train.ckpt_dir",), _checkpoints),
    Unread(("model.preset", "workload.steps", "workload.seed", "emulate.repeats"), _emulate),
)


def unread_reason(settings, key: str, rules: tuple[Unread, ...] = UNREAD) -> str | None:
    """Why `key` is not read by this run (None: it is), whether given or not."""
    for rule in rules:
        if key in rule.keys:
            why = rule.why(settings)
            if why:
                return why
    return None


def check_read(settings, rules: tuple[Unread, ...] = UNREAD) -> None:
    """SettingError naming the first setting given (a flag, a config file's key, a profile) that
    this run does not read, by the route it came by, and why."""
    for rule in rules:
        given = [k for k in rule.keys if k in settings.given]
        if given:
            why = rule.why(settings)
            if why:
                raise SettingError(f"{settings.route(given[0])} is not read: {why}")

"""The machinery of the config tree: a setting (a dataclass field with its one-line doc, its check,
its flag and the source of its default) and a section (a frozen dataclass of settings, checked
field by field whatever route its values came by: a preset, a config file, a flag, code)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar


class SettingError(ValueError):
    """A setting whose value is invalid, or settings that contradict each other. The message names
    the setting as the user wrote it (a flag, a config file's key, or section.field) and what
    would be valid."""


# ----- checks ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """What a valid value is, in words (completing "it must be ..."), and the test."""

    requirement: str
    ok: Callable[[Any], bool]
    listed: bool = False  # the value is a comma-separated list: a command's choices hold for each item
    hi: float | None = None  # a numeric setting's largest valid value (every numeric setting has one: tests/test_cli.py)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_in(lo: int, hi: int) -> Check:
    """An integer in [lo, hi]: every integer setting has an upper bound, the largest value that
    still means something (a model, a cluster, a run that could exist), so a typo of 2^62 is one
    line here, not a step priced at 3.5e16 s or an allocation that never ends."""
    return Check(f"an integer in [{lo}, {hi}]", lambda v: _int(v) and lo <= v <= hi, hi=hi)


def number_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Check:
    text = f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    return Check(text, lambda v: _number(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi), hi=hi)


def power_of_two(hi: int) -> Check:
    """A power of two in [1, hi]."""
    return Check(f"a power of two (1, 2, 4, 8, ...) up to {hi:,}", lambda v: _int(v) and 1 <= v <= hi and v & (v - 1) == 0, hi=hi)


FRACTION = number_in(0, 1)
# the largest values that still describe a run that could exist (a typo of 2^62 is refused, not run)
MAX_STEPS = 10_000_000  # steps of a run: over a hundred days at one step a second
MAX_REPEATS = 10_000  # timed repeats, rounds and seeds of one figure
SEED = int_in(0, 2**63 - 1)  # numpy's and torch's seeds: any non-negative int64
NON_EMPTY = Check("a non-empty string", lambda v: isinstance(v, str) and v != "")


def one_of(choices) -> Check:
    choices = tuple(choices)
    return Check(f"one of {list(choices)}", lambda v: v in choices)


def list_from(choices) -> Check:
    """A comma-separated list of one or more of `choices`."""
    choices = tuple(choices)
    return Check(
        f"a comma-separated list from {list(choices)}",
        lambda v: isinstance(v, str) and bool(v) and set(v.split(",")) <= set(choices),
        listed=True,
    )


def names() -> Check:
    """A comma-separated list of one or more names, each of which the entry point's choices for the
    setting hold (`config.cli.Command(choices=...)`: a registry of another package)."""
    return Check("a comma-separated list of names", lambda v: isinstance(v, str) and all(v.split(",")), listed=True)


def optional(check: Check) -> Check:
    """None (the setting's default follows another setting, as its doc says) or a value `check` passes."""
    return Check(f"{check.requirement}, or unset", lambda v: v is None or check.ok(v), check.listed, check.hi)


# ----- settings ------------------------------------------------------------------------------------
TYPES = (int, float, str, bool, dict, tuple)  # the types a setting's value may have


def setting(
    default,
    doc: str,
    check: Check | None = None,
    *,
    type_: type | None = None,
    flag: str | None = None,
    source: str | None = None,
    choices=None,
    cli: bool = True,
):
    """A field of a config section.

    doc: one line, what the setting is; check: what a valid value is (choices give one_of);
    type_: the value's type where the default does not show it (None); flag: the command-line
    spelling where it is not --<name-with-dashes>; source: where the default comes from (a
    datasheet, a paper, a measurement), printed in docs/configuration.md; cli: False keeps it
    out of every command line (set it in a config file or a preset)."""
    if type_ is None:
        type_ = tuple if isinstance(default, (tuple, list)) else type(default)
    if type_ not in TYPES:
        raise TypeError(f"setting type {type_} is not one of {TYPES}")
    if choices is not None and check is None:
        check = one_of(choices)
    meta = {"doc": doc, "check": check, "type": type_, "flag": flag, "source": source, "choices": choices, "cli": cli}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda d=dict(default): dict(d), hash=False, metadata=meta)
    return dataclasses.field(default=tuple(default) if type_ is tuple and default is not None else default, metadata=meta)


def of_type(value, expected: type) -> bool:
    """Is `value` of the setting's type? (an int is a float; a bool is neither; None is checked by
    the setting's check, not here)"""
    if value is None:
        return True
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return _int(value)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is tuple:
        return isinstance(value, (tuple, list))
    return isinstance(value, expected)


TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object", tuple: "a list"}


INT64 = 2**63  # every integer setting lies in (-INT64, INT64): seeds, sizes and counts reach numpy and torch as int64


def check_value(name: str, value, f: dataclasses.Field) -> None:
    """Raise SettingError naming `name` unless `value` is of the field's type and passes its check."""
    meta = f.metadata
    expected = meta.get("type")
    if expected is not None and not of_type(value, expected):
        raise SettingError(f"{name}={value!r} is invalid: it must be {TYPE_NAMES[expected]}, not {type(value).__name__}")
    if _int(value) and not -INT64 < value < INT64:
        raise SettingError(f"{name}={value} is invalid: it is beyond a 64-bit integer (|value| < 2^63), the widest numpy and torch take")
    check = meta.get("check")
    if check is not None and not check.ok(value):
        raise SettingError(f"{name}={value!r} is invalid: it must be {check.requirement}")


def flag_of(f: dataclasses.Field) -> str:
    """A setting's one command-line spelling."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


class _Object(dict):
    """A JSON object as read, with the first key it was given twice (None: none was)."""

    duplicate: str | None = None


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    out = _Object(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        out.duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def _plain(obj, path: str = ""):
    """`obj` with plain dicts for the _Objects read, or a SettingError naming the first key given
    twice, by its path from the top (model.sparse_params.'window')."""
    if isinstance(obj, dict):
        if getattr(obj, "duplicate", None) is not None:
            raise SettingError(f"key {path}{obj.duplicate!r} is given twice in one object; give it once (JSON would keep only the last)")
        return {k: _plain(v, f"{path}{k}.") for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v, f"{path}[{i}].") for i, v in enumerate(obj)]
    return obj


def load_json(f) -> Any:
    """A user's JSON file (a config file, a hardware profile), refusing a key given twice in one
    object at any depth: Python's json keeps the last silently, so a section written twice would
    lose the first. ValueError for text that is not JSON; SettingError naming a repeated key."""
    return _plain(json.load(f, object_pairs_hook=_object))


def profile_section(path: str, name: str) -> dict:
    """The `name` section of a profile written by experiments.calibrate (a JSON file); a
    SettingError naming the file when it cannot be read, is not JSON, or has no such object."""
    what = f"{name} profile {path!r}"
    if os.path.isdir(path):
        raise SettingError(f"{what} is a folder, not a profile (a .json file written by python -m experiments.calibrate)")
    try:
        with open(path) as f:
            obj = load_json(f)
    except OSError as e:
        raise SettingError(f"{what} cannot be read: {e.strerror or e}") from None
    except SettingError as e:
        raise SettingError(f"{what}: {e}") from None
    except ValueError as e:
        raise SettingError(f"{what} is not JSON: {e}") from None
    section = obj.get(name) if isinstance(obj, dict) else None
    if not isinstance(section, dict):
        raise SettingError(f"{what} has no {name!r} object (write one with python -m experiments.calibrate)")
    return section


class Section:
    """A frozen dataclass of settings. Every field is checked when an instance is made (whatever
    route its values came by), then `check()` checks the fields against each other."""

    SECTION: ClassVar[str] = ""  # the name of the section in config files and results
    PRESETS: ClassVar[dict[str, Any] | None] = None  # named instances, where the section has any

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("type") is tuple and isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))  # from JSON: lists become the tuple the field holds
            check_value(f"{self.SECTION}.{f.name}", getattr(self, f.name), f)
        self.check()

    def check(self) -> None:
        """Checks of the fields against each other; SettingError naming them."""

    def merge(self, changes: dict) -> dict:
        """The changes to apply to this instance, given the changes a config file and the flags ask
        for: where one setting's new value changes what another's means (a section's own rule)."""
        return changes

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def settings(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def spelt(cls, name: str) -> str:
        """A setting as both routes name it, for errors a check of several settings raises:
        'workload.fill (--fill)'."""
        return f"{cls.SECTION}.{name} ({flag_of(cls.settings()[name])})"

    @classmethod
    def unknown(cls, keys, where: str) -> None:
        """SettingError naming the first key that is not a setting of this section."""
        known = cls.settings()
        bad = sorted(set(keys) - set(known))
        if bad:
            raise SettingError(f"{where}{cls.SECTION}.{bad[0]} is not a setting; the {cls.SECTION} settings: {sorted(known)}")

    @classmethod
    def from_dict(cls, values: dict, where: str = ""):
        """An instance from a dict of settings (a config file's section, a results file's record);
        an unknown key is a SettingError naming it."""
        cls.unknown(values, where)
        return cls(**values)

    @classmethod
    def from_name(cls, name: str, **overrides):
        """The named preset (with `overrides`); SettingError naming the valid presets."""
        presets = cls.PRESETS or {}
        if name not in presets:
            raise SettingError(f"unknown {cls.SECTION} preset {name!r}; valid presets: {sorted(presets)}")
        return presets[name].replace(**overrides) if overrides else presets[name]

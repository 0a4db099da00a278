"""Checks every entry point runs on its inputs before any work: one-line errors naming the value.

A config file (--config) is JSON: {"model": {...}, "hardware": {...}, "training": {...},
"cluster": {...}, "workload": {...}}, each section a dict of overrides of that dataclass's fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

from solver import Cluster, HardwareConfig, ModelConfig, PlanError, TrainingConfig
from solver.cluster import matches_type

from .workload import WorkloadConfig

SECTIONS = {"model": ModelConfig, "hardware": HardwareConfig, "training": TrainingConfig, "cluster": Cluster, "workload": WorkloadConfig}
__all__ = ["SECTIONS", "check_output_dir", "load_config_file"]


def check_output_dir(path: str, flag: str = "--out") -> None:
    """The folder results go to can be written: it is a folder (or can be made one) and a file
    can be created in it. Checked first, so a run never ends by losing its results."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise PlanError(f"{flag} {path!r} is a file, not a folder: name a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise PlanError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def load_config_file(path: str) -> dict[str, dict]:
    """The overrides in a config file, checked: the file exists and holds a JSON object whose
    sections are known and are objects, whose keys are fields of that section's config, each of
    the field's type. A bad one is a PlanError naming it."""
    if not os.path.isfile(path):
        raise PlanError(f"config file {path!r} does not exist")
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise PlanError(f"config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise PlanError(f"config file {path!r} holds a {type(obj).__name__}; it must be an object of sections {sorted(SECTIONS)}")
    kinds = SECTIONS
    bad = sorted(set(obj) - set(kinds))
    if bad:
        raise PlanError(f"config file {path!r} has unknown section {bad[0]!r}; valid: {sorted(kinds)}")
    for name, section in obj.items():
        if not isinstance(section, dict):
            raise PlanError(f"config file {path!r}: section {name!r} is a {type(section).__name__}; it must be an object of settings")
        defaults = {f.name: f for f in dataclasses.fields(kinds[name])}
        for key, value in section.items():
            if key not in defaults:
                raise PlanError(f"config file {path!r}: {name}.{key} is not a setting; valid: {sorted(defaults)}")
            f = defaults[key]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if not matches_type(value, default):
                raise PlanError(
                    f"config file {path!r}: {name}.{key}={value!r} is a {type(value).__name__}; it must be a {type(default).__name__}"
                )
    return obj

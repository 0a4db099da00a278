"""The command lines generated from the config tree: one spelling per setting, precedence written
once, every entry point takes --config, and the set of options is frozen (a new one is a decision:
update tests/cli_options.txt in the same commit)."""

import dataclasses
import importlib
import json
import os

import pytest

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, OptimConfig, PlannerConfig, SettingError, WorkloadConfig
from config.cli import Command, Derived
from tests.test_structure import entry_points

HERE = os.path.dirname(os.path.abspath(__file__))
FROZEN = os.path.join(HERE, "cli_options.txt")
SECTIONS = (ModelConfig, HardwareConfig, Cluster, CostsConfig, WorkloadConfig, PlannerConfig, OptimConfig)


def commands() -> dict[str, Command]:
    """Every entry point's command line, by module."""
    return {mod: importlib.import_module(mod).COMMAND for mod in sorted(entry_points())}


def test_every_entry_point_has_a_generated_command_line_that_takes_a_config_file():
    cmds = commands()
    assert len(cmds) >= 10, sorted(cmds)
    for mod, cmd in cmds.items():
        assert isinstance(cmd, Command), mod
        assert f"{cmd.prog} --config FILE" in cmd.options(), mod
        assert mod.removesuffix(".__main__") == cmd.prog, f"{mod} names itself {cmd.prog}"


def test_the_option_set_is_frozen():
    now = sorted(line for cmd in commands().values() for line in cmd.options())
    frozen = sorted(line for line in open(FROZEN).read().splitlines() if line and not line.startswith("#"))
    added, removed = sorted(set(now) - set(frozen)), sorted(set(frozen) - set(now))
    assert not added and not removed, (
        f"options added {added}, removed {removed}: a new option is a decision; update tests/cli_options.txt with it"
    )


def test_a_flag_means_one_thing_everywhere():
    """A flag spelt alike in two entry points sets a setting of the same name and doc."""
    meaning: dict[str, tuple[str, str, str]] = {}
    for cmd in commands().values():
        for cls in cmd.sections:
            for f in cmd.settings_of(cls):
                flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
                mine = (f.name, f.metadata["doc"], cmd.prog)
                if flag in meaning:
                    name, doc, where = meaning[flag]
                    assert (name, doc) == mine[:2], (
                        f"{flag} means {name!r} ({doc!r}) in {where} but {mine[0]!r} ({mine[1]!r}) in {cmd.prog}"
                    )
                meaning[flag] = mine


def test_every_setting_has_a_one_line_doc_and_numbers_have_a_check():
    for cmd in commands().values():
        for cls in cmd.sections:
            for f in dataclasses.fields(cls):
                doc = f.metadata.get("doc", "")
                assert doc and "\n" not in doc, f"{cls.SECTION}.{f.name} has no one-line doc"
                if f.metadata["type"] in (int, float):
                    assert f.metadata["check"] is not None, f"{cls.SECTION}.{f.name} is a number without a check"


def _write(tmp_path, obj) -> str:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_precedence_preset_then_entry_default_then_file_then_flag(tmp_path):
    cmd = Command(
        "demo",
        "",
        SECTIONS,
        defaults={
            "model": "tiny",
            "workload.steps": 100,
            "hardware.a2a_latency": 3e-6,
            "cluster.tokens_per_rank": Derived(lambda s: s.model.hidden, ""),
        },
    )
    base = cmd.parse([])
    assert base.model == ModelConfig.from_name("tiny")  # the entry point's preset
    assert base.workload.steps == 100 and base.hardware.a2a_latency == 3e-6  # its defaults over the fields'
    assert base.cluster.tokens_per_rank == 64  # a default that follows a setting resolved before it (tiny's hidden)
    path = _write(
        tmp_path, {"model": {"preset": "small", "n_layers": 4}, "workload": {"steps": 7, "seed": 2}, "hardware": {"a2a_latency": 5e-6}}
    )
    s = cmd.parse(["--config", path, "--seed", "9", "--n-layers", "12"])
    assert s.model.name == "small" and s.model.hidden == 1024  # the file's preset
    assert s.model.n_layers == 12 and s.workload.seed == 9  # flags win over the file
    assert s.workload.steps == 7 and s.hardware.a2a_latency == 5e-6  # the file wins over the entry point's defaults
    assert s.cluster.tokens_per_rank == 1024  # derived from the small model the file chose
    assert s.given == {
        "model.preset",
        "model.n_layers",
        "workload.steps",
        "workload.seed",
        "hardware.a2a_latency",
    }  # the file named the preset
    assert cmd.parse(["--config", path, "--model", "paper"]).model.hidden == 4096  # a preset flag wins over the file's


def test_a_bad_value_is_named_by_the_route_it_came_by(tmp_path):
    cmd = Command("demo", "", SECTIONS)
    with pytest.raises(SettingError, match=r"^--ratio=0\.0 is invalid: it must be a finite number in \(0, 1e\+06\]$"):
        cmd.parse(["--ratio", "0"])
    path = _write(tmp_path, {"hardware": {"inter_intra_ratio": 1e308}})
    with pytest.raises(SettingError, match=r"^config file '.*c\.json': hardware\.inter_intra_ratio=1e\+308 is invalid"):
        cmd.parse(["--config", path])
    with pytest.raises(SettingError, match=r"^demo's default costs\.ep_degree=0 is invalid"):
        Command("demo", "", SECTIONS, defaults={"costs.ep_degree": 0}).parse([])
    with pytest.raises(SettingError, match=r"--fill and --tokens-per-step set the same thing two ways"):
        cmd.parse(["--fill", "0.5", "--tokens-per-step", "10"])
    path = _write(tmp_path, {"workload": {"fill": 0.5}})
    with pytest.raises(SettingError, match=r"config file .*: workload\.fill and --tokens-per-step set the same thing two ways"):
        cmd.parse(["--config", path, "--tokens-per-step", "10"])


def test_a_list_setting_holds_each_item_to_the_commands_choices_from_any_route(tmp_path):
    """A comma-separated setting whose names another package owns (the host bench's modes, from the
    mode table): each item is held to the command's choices, and the bad item is named."""
    from config.entries import HostBenchOptions

    cmd = Command("demo", "", (HostBenchOptions,), choices={"bench.modes": ("baseline", "halo")})
    assert cmd.parse(["--modes", "halo,baseline"]).bench.modes == "halo,baseline"
    with pytest.raises(SettingError, match=r"^--modes='halo,fast' is invalid: 'fast' is not one of \['baseline', 'halo'\]$"):
        cmd.parse(["--modes", "halo,fast"])
    path = _write(tmp_path, {"bench": {"modes": "fast"}})
    with pytest.raises(SettingError, match=r"^config file '.*': bench\.modes='fast' is invalid: 'fast' is not one of"):
        cmd.parse(["--config", path])
    with pytest.raises(SettingError, match=r"must be a comma-separated list of names"):  # an empty item, whatever the choices
        cmd.parse(["--modes", "halo,"])


def test_every_setting_is_checked_whatever_route_it_takes():
    """The same limits in code as on the command line: a section cannot be made with a bad value."""
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            if f.metadata["type"] not in (int, float) or f.metadata["check"] is None:
                continue
            bad = -1 if f.metadata["type"] is int else float("nan")
            if f.metadata["check"].ok(bad):
                continue  # a setting where -1 is valid (none today): nothing to show
            with pytest.raises(SettingError, match=rf"{cls.SECTION}\.{f.name}={bad!r} is invalid"):
                cls(**{f.name: bad})


def test_a_new_sparse_kind_changes_the_parameters_and_given_ones_add_to_the_presets():
    cmd = Command("demo", "", SECTIONS)
    assert cmd.parse(["--sparse-kind", "chunked"]).model.sparse_params == {}  # that kind's defaults, filled in by the solver
    assert cmd.parse(["--sparse-params", "window=1024"]).model.sparse_params == {"window": 1024}
    assert cmd.parse(["--model", "tiny", "--sparse-params", "extra=2.5"]).model.sparse_params == {"window": 8, "extra": 2.5}

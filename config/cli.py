"""Command lines generated from the config tree, and the one place precedence is written.

An entry point declares a `Command`: the sections it reads (in the order they resolve), its own
defaults and the settings it leaves out. Every setting of those sections becomes one flag, spelt
the same in every entry point (--<name-with-dashes>, or the setting's own `flag`); a section with
presets gets --<section> NAME; every command takes --config FILE.

Precedence, lowest first, for every setting of every section:
  1. the section's field default;
  2. the preset (--<section> NAME, or the config file's "<section>": {"preset": NAME}, or the
     entry point's default preset);
  3. the entry point's own default for the setting (it may follow a setting resolved before it);
  4. the config file (--config FILE: {"<section>": {"<setting>": value, ...}, ...});
  5. the flag.
Every value is checked by its setting's check whatever route it came by, and an error names the
route: the flag, the config file's key, or the entry point's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import Section, SettingError, check_value, flag_of, load_json
from .reads import UNREAD, Unread, check_read

CONFIG_FLAG = "--config"
PLUGIN_FLAG = "--plugin"
_PLUGINS: dict[str, Any] = {}  # the plugins this process imported, by what named them


def plugins_in(argv: Sequence[str]) -> list[str]:
    """The --plugin values of a command line, in order (--plugin X, or --plugin=X)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == PLUGIN_FLAG and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif arg.startswith(PLUGIN_FLAG + "="):
            out.append(arg.split("=", 1)[1])
    return out


def load_plugin(spec: str):
    """Import a user's module once, before the command line is read, so that what it registers (a
    sparse kind, with its mask, FLOPs and parameters) is valid on it: `spec` is a module path
    (pkg.my_kinds, importable from here) or a Python file (my_kinds.py). Every process that reads
    the command line imports it (each torchrun rank reads its own). SettingError naming the plugin
    where it cannot be found or fails as it is imported."""
    if spec in _PLUGINS:
        return _PLUGINS[spec]
    is_file = spec.endswith(".py") or os.sep in spec
    if is_file and not os.path.isfile(spec):
        raise SettingError(f"{PLUGIN_FLAG} {spec!r}: no such file (give a module path, pkg.my_kinds, or a .py file)")
    try:
        if is_file:
            name = "repack_plugin_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(spec))
            loader = importlib.util.spec_from_file_location(name, spec)
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(spec)
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything as it is imported: one line naming it
        raise SettingError(f"{PLUGIN_FLAG} {spec!r} cannot be imported: {type(e).__name__}: {e}") from None
    _PLUGINS[spec] = module
    return module


@dataclass(frozen=True)
class Derived:
    """An entry point's default that follows settings resolved before it: fn(settings so far)."""

    fn: Callable[[Settings], Any]
    text: str  # what the default is, for --help

    def __call__(self, settings: Settings):
        return self.fn(settings)


class Settings:
    """The resolved sections of one command line: settings.model, settings.cluster, ...;
    `routes`: the route each setting's value came by ('section.setting', or 'section.preset' for
    a preset's name, -> '--lengths', "config file 'c.json': workload.lengths", ...), where it did
    not come from its field's default; `given`: the settings the user set (by a flag, a config
    file or a hardware profile)."""

    def __init__(self, command: str):
        self.command = command
        self.sections: dict[str, Section] = {}
        self.routes: dict[str, str] = {}
        self.given: set[str] = set()
        self.from_presets: set[str] = set()  # the settings a named preset set: their flag is what to change, not the preset
        self.plugins: list[str] = []  # the --plugin modules imported before the settings were read

    def reroute(self, message: str) -> str:
        """A check's message with each setting it names by its flag ('costs.ep_degree (--ep)', as
        Section.spelt writes it) named by the route its value came by instead, where that was not
        the flag: a config file's key, a preset, a profile, a replay."""
        for key, route in self.routes.items():
            found = self._setting(key)
            if found is None or key in self.from_presets:
                continue
            cls, name = found
            spelt = cls.spelt(name)
            if spelt in message and route != flag_of(cls.settings()[name]):
                message = message.replace(spelt, f"{key} ({route})")
        return message

    def route(self, key: str) -> str:
        """How a setting's value came: its route, or 'section.setting (--flag)' for a field default."""
        if key in self.routes:
            return self.routes[key]
        found = self._setting(key)
        return found[0].spelt(found[1]) if found is not None else key

    def _setting(self, key: str) -> tuple[type[Section], str] | None:
        """(its section's class, its name) of 'section.setting', or None where it names no setting
        of these sections ('section.preset')."""
        section, _, name = key.partition(".")
        cls = type(self.sections[section]) if section in self.sections else None
        return (cls, name) if cls is not None and name in cls.settings() else None

    def __getattr__(self, name: str):
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        raise AttributeError(f"{self.__dict__.get('command', 'the command')} has no settings section {name!r}")

    def replace(self, **sections: Section) -> Settings:
        """A copy with some sections replaced (the sweep's points)."""
        out = Settings(self.command)
        out.sections = {**self.sections, **sections}
        out.routes, out.given, out.from_presets = dict(self.routes), set(self.given), set(self.from_presets)
        out.plugins = list(self.plugins)
        return out

    def to_dict(self) -> dict[str, dict]:
        return {name: s.to_dict() for name, s in self.sections.items()}


class _Parser(argparse.ArgumentParser):
    """A bad command line is a SettingError (one line), not the usage of some sixty flags (--help
    lists them)."""

    def error(self, message: str):
        raise SettingError(f"{message} (python -m {self.prog.split()[-1]} --help lists every setting)")


def _parse_params(items: Sequence[str], flag: str) -> dict:
    """KEY=VALUE pairs -> dict; values as int, else float, else str."""
    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise SettingError(f"{flag} {item!r} is invalid: give KEY=VALUE pairs (e.g. window=1024)")
        for kind in (int, float):
            try:
                out[key] = kind(raw)
                break
            except ValueError:
                continue
        else:
            out[key] = raw
    return out


def _describe(value) -> str:
    if isinstance(value, Derived):
        return value.text
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "none"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return "unset" if value is None else str(value)


@dataclass
class Command:
    """The command line of one entry point, generated from its sections.

    defaults: 'section.setting' -> value (or Derived), and 'section' -> a preset name (or
    Derived); exclude: 'section.setting' names this command leaves out (they keep their default
    and no route can set them); only: section -> the settings of it the command takes (the rest
    excluded); choices: 'section.setting' -> the values this command accepts where the setting's
    own check cannot know them (or a callable giving them)."""

    prog: str
    description: str
    sections: tuple[type[Section], ...]
    defaults: dict[str, Any] = field(default_factory=dict)
    exclude: frozenset[str] = frozenset()
    choices: dict[str, Any] = field(default_factory=dict)
    only: dict[str, tuple[str, ...]] = field(default_factory=dict)  # section -> the only settings of it this command takes
    unread: tuple[Unread, ...] = ()  # this command's own cases of a setting it does not read, beyond config.reads.UNREAD
    epilog: str = ""  # what --help prints after the settings (the modes an entry point runs)

    def __post_init__(self):
        for name, keep in self.only.items():
            cls = self._section(name)
            self.exclude = set(self.exclude) | {f"{name}.{f}" for f in cls.settings() if f not in keep}
        self.exclude = frozenset(self.exclude)
        names = [s.SECTION for s in self.sections]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.prog}: a section appears twice in {names}")
        for key in list(self.defaults) + list(self.exclude) + list(self.choices):
            section, _, name = key.partition(".")
            cls = self._section(section)
            if name and name not in cls.settings():
                raise ValueError(f"{self.prog}: {key!r} is not a setting")
            if not name and not cls.PRESETS:
                raise ValueError(f"{self.prog}: section {section!r} has no presets to default to")

    def _section(self, name: str) -> type[Section]:
        for s in self.sections:
            if s.SECTION == name:
                return s
        raise ValueError(f"{self.prog}: no section {name!r} among {[s.SECTION for s in self.sections]}")

    def settings_of(self, cls: type[Section]) -> list[dataclasses.Field]:
        """The settings of `cls` on this command line."""
        return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f"{cls.SECTION}.{f.name}" not in self.exclude]

    # ----- the parser ---------------------------------------------------------------------------
    def parser(self) -> argparse.ArgumentParser:
        ap = _Parser(
            prog=f"python -m {self.prog}",
            description=self.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=self.epilog or None,
            allow_abbrev=False,  # --mode is not --model: a flag is spelt whole, or refused naming it
        )
        ap.add_argument(CONFIG_FLAG, metavar="FILE", default=argparse.SUPPRESS, help="JSON file of settings by section (flags win over it)")
        ap.add_argument(
            PLUGIN_FLAG,
            metavar="MODULE",
            action="append",
            default=argparse.SUPPRESS,
            help="a module path or a .py file imported before the settings are read (repeatable): a sparse kind it registers is "
            "then a valid --sparse-kind here and in every torchrun rank",
        )
        for cls in self.sections:
            name = cls.SECTION
            group = ap.add_argument_group(f"{name} settings", inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0] or None)
            if cls.PRESETS:
                default = self.defaults.get(name, next(iter(cls.PRESETS)))
                extra = " or a profile .json" if name == "hardware" else ""
                group.add_argument(
                    f"--{name}",
                    dest=name,
                    metavar="NAME",
                    default=argparse.SUPPRESS,
                    help=f"{name} preset: {', '.join(cls.PRESETS)}{extra} (default: {_describe(default)})",
                )
            for f in self.settings_of(cls):
                self._add(group, cls, f)
        return ap

    def _add(self, group, cls: type[Section], f: dataclasses.Field) -> None:
        key = f"{cls.SECTION}.{f.name}"
        meta, value_type = f.metadata, f.metadata["type"]
        preset = self.defaults.get(cls.SECTION, next(iter(cls.PRESETS))) if cls.PRESETS else None
        if key in self.defaults or preset is None:
            shown = _describe(self.defaults.get(key, getattr(cls(), f.name)))
        elif isinstance(preset, Derived):
            shown = "the preset's"
        else:
            shown = f"the preset's; {preset}: {_describe(getattr(cls.from_name(preset), f.name))}"
        help_text = f"{meta['doc']} (default: {shown})"
        kw: dict[str, Any] = {"dest": key, "default": argparse.SUPPRESS, "help": help_text}
        choices = self.choices_of(key) or meta.get("choices")
        if choices and _listed(f):  # argparse would hold the whole list to the choices: checked item by item when resolving
            kw["help"] = f"{meta['doc']}, from {list(choices)} (default: {shown})"
            choices = None
        if value_type is bool:
            group.add_argument(flag_of(f), action=argparse.BooleanOptionalAction, **kw)
            return
        if value_type is dict:
            group.add_argument(flag_of(f), nargs="+", metavar="KEY=VALUE", **kw)
            return
        if value_type is tuple:
            sample = f.default
            group.add_argument(flag_of(f), nargs=len(sample), type=type(sample[0]), metavar="X", **kw)
            return
        group.add_argument(flag_of(f), type=value_type, choices=list(choices) if choices else None, metavar=None if choices else "X", **kw)

    def options(self) -> list[str]:
        """Every option of this command line with the setting it sets: what tests/cli_options.txt freezes."""
        out = [f"{self.prog} {CONFIG_FLAG} FILE", f"{self.prog} {PLUGIN_FLAG} MODULE"]
        for cls in self.sections:
            if cls.PRESETS:
                out.append(f"{self.prog} --{cls.SECTION} {cls.SECTION}.preset")
            out += [f"{self.prog} {flag_of(f)} {cls.SECTION}.{f.name}" for f in self.settings_of(cls)]
        return out

    # ----- resolution ---------------------------------------------------------------------------
    def parse(self, argv: Sequence[str] | None = None) -> Settings:
        """The settings of a command line (sys.argv when None), every value checked; SettingError
        names a bad one by the route it came by."""
        argv = sys.argv[1:] if argv is None else list(argv)
        plugins = plugins_in(argv)
        for spec in plugins:  # first: what they register is what the parser and the checks accept
            load_plugin(spec)
        ns = vars(self.parser().parse_args(argv))
        ns.pop("plugin", None)
        path = ns.pop("config", None)
        flags: dict[str, dict[str, Any]] = {}
        for key, value in ns.items():
            section, _, name = key.partition(".")
            flags.setdefault(section, {})[name or "preset"] = value
        settings = self.resolve(read_config_file(path, self) if path else {}, flags, path)
        settings.plugins = plugins
        return settings

    def resolve(self, file: dict[str, dict], flags: dict[str, dict], path: str | None = None) -> Settings:
        """Precedence (the module's docstring) over every section, in order."""
        out = Settings(self.prog)
        where = f"config file {path!r}: " if path else ""
        for cls in self.sections:
            name = cls.SECTION
            from_file, from_flags = dict(file.get(name, {})), dict(flags.get(name, {}))
            file_preset = from_file.pop("preset", None)
            flag_preset = from_flags.pop("preset", None)
            route = f"--{name}" if flag_preset is not None else f"{where}{name}.preset"
            preset = flag_preset if flag_preset is not None else file_preset
            try:
                base = self._base(cls, preset, out)
            except SettingError as e:
                raise SettingError(f"{route}: {e}") from None
            if preset is not None:
                out.routes[f"{name}.preset"] = f"--{name} {preset}" if flag_preset is not None else route
                out.given.add(f"{name}.preset")
            self._preset_routes(out, cls, base, preset, route)
            known = {f.name: f for f in self.settings_of(cls)}
            for k, v in from_flags.items():  # KEY=VALUE pairs of a flag of a dict setting
                if k in known and known[k].metadata["type"] is dict:
                    from_flags[k] = _parse_params(v, flag_of(known[k]))
            layers = []  # (route of each value, values), lowest precedence first
            entry = {k.partition(".")[2]: v for k, v in self.defaults.items() if k.startswith(name + ".")}
            entry = {k: (v(out) if isinstance(v, Derived) else v) for k, v in entry.items()}
            layers.append(({k: f"{self.prog}'s default {name}.{k}" for k in entry}, entry))
            layers.append(({k: f"{where}{name}.{k}" for k in from_file}, from_file))
            layers.append(({k: flag_of(known[k]) for k in from_flags}, from_flags))
            merged: dict[str, Any] = {}
            for level, (routes, values) in enumerate(layers):
                for k, v in values.items():
                    f = known.get(k) if level else cls.settings()[k]  # the entry point's defaults may set what its users cannot
                    if f is None:
                        raise SettingError(f"{routes[k]} is not a setting of {self.prog}; its {name} settings: {sorted(known)}")
                    if isinstance(v, list) and f.metadata["type"] is tuple:
                        v = tuple(v)
                    check_value(routes[k], v, f)
                    self._check_choices(routes[k], f"{name}.{k}", v, f)
                    merged[k] = v
            for a, b in getattr(cls, "EXCLUSIVE", ()):
                given = [routes[k] for routes, values in layers[1:] for k in values if k in (a, b)]
                if len(given) > 1:
                    raise SettingError(f"{given[0]} and {given[1]} set the same thing two ways: give one of them")
            merged = base.merge(merged)
            try:
                out.sections[name] = base.replace(**merged)
            except SettingError as e:
                raise SettingError(f"{where}{e}" if from_file else str(e)) from None
            for routes, values in layers:
                out.routes.update({f"{name}.{k}": routes[k] for k in values})
                out.from_presets -= {f"{name}.{k}" for k in values}
            out.given |= {f"{name}.{k}" for _, values in layers[1:] for k in values}
        check_read(out, UNREAD + self.unread)
        return out

    def _preset_routes(self, out: Settings, cls: type[Section], base: Section, preset: str | None, route: str) -> None:
        """The routes of the values a preset (or a hardware profile) set: a profile's are given by
        the user; a named preset's are named by it ("--workload flexsp-wikipedia's workload.lengths")."""
        name = cls.SECTION
        if preset is None:
            preset = base.name if "name" in cls.settings() else None
            route = f"the {name} preset {preset!r}"
        elif route == f"--{name}":
            route = f"--{name} {preset}"
        profile = isinstance(preset, str) and preset.endswith(".json")
        default = cls()
        for f in dataclasses.fields(cls):
            if f.name == "name" or (not profile and getattr(base, f.name) == getattr(default, f.name)):
                continue
            key = f"{name}.{f.name}"
            out.routes[key] = f"{name} profile {preset!r}: {key}" if profile else f"{route}'s {key}"
            if profile:
                out.given.add(key)
            else:
                out.from_presets.add(key)

    def _base(self, cls: type[Section], preset: str | None, out: Settings) -> Section:
        if not cls.PRESETS:
            return cls()
        if preset is None:
            preset = self.defaults.get(cls.SECTION, next(iter(cls.PRESETS)))
            preset = preset(out) if isinstance(preset, Derived) else preset
        if not isinstance(preset, str):
            raise SettingError(f"{preset!r} is invalid: a preset is a name (a string), one of {sorted(cls.PRESETS)}")
        return cls.from_name(preset)

    def choices_of(self, key: str):
        """The values this command accepts for 'section.setting' (a callable is asked when parsing:
        a registry that grows at run time), or None."""
        choices = self.choices.get(key)
        return tuple(choices()) if callable(choices) else choices

    def _check_choices(self, route: str, key: str, value, f: dataclasses.Field) -> None:
        choices = self.choices_of(key)
        if choices is None:
            return
        listed = _listed(f)
        for item in value.split(",") if listed else [value]:
            if item not in choices:
                what = f"{item!r} is not one of {list(choices)}" if listed else f"it must be one of {list(choices)}"
                raise SettingError(f"{route}={value!r} is invalid: {what}")


def _listed(f: dataclasses.Field) -> bool:
    """Is the setting a comma-separated list (its check says so)?"""
    check = f.metadata.get("check")
    return check is not None and check.listed


def read_config_file(path: str, command: Command) -> dict[str, dict]:
    """The settings of a config file: a JSON object of sections, each an object of settings (and
    "preset"). A file that is missing, not JSON, or names a section the command does not read is
    a SettingError naming it."""
    if os.path.isdir(path):
        raise SettingError(f"config file {path!r} is a folder, not a JSON file of settings")
    if not os.path.isfile(path):
        raise SettingError(f"config file {path!r} does not exist")
    with open(path) as f:
        try:
            obj = load_json(f)
        except SettingError as e:
            raise SettingError(f"config file {path!r}: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SettingError(f"config file {path!r} is not valid JSON: {e}") from None
    sections = [s.SECTION for s in command.sections]
    if not isinstance(obj, dict):
        raise SettingError(f"config file {path!r} holds a {type(obj).__name__}; it must be an object of sections {sections}")
    for name, section in obj.items():
        if name not in sections:
            raise SettingError(f"config file {path!r}: {command.prog} reads no section {name!r}; its sections: {sections}")
        if not isinstance(section, dict):
            raise SettingError(f"config file {path!r}: section {name!r} is a {type(section).__name__}; it must be an object of settings")
        if "preset" in section and not command._section(name).PRESETS:
            raise SettingError(f"config file {path!r}: section {name!r} has no presets")
    return obj

"""Typed config sections: each option's default, allowed values and doc live in one dataclass field.

A part of the system (trainer, sampler, rewards, ...) declares its settings as a frozen dataclass
deriving from `Section`, one `knob(...)` per option:

    @dataclasses.dataclass(frozen=True)
    class CheckpointConfig(Section):
        section: ClassVar[str] = "checkpoint"
        every_steps: int = knob(10, "save every this many steps; 0 = only at the end")

        def check(self) -> None:
            require(self.every_steps >= 0, f"{self.key('every_steps')}={self.every_steps} must be >= 0.")

Constructing one checks each value's type against the field's annotation (an int where a float is
declared is converted), its allowed values, then the section's own `check()`; every failure is a
`ConfigError` naming the key as a user types it (`--config.checkpoint.every_steps=...`).
`defaults_dict`, `from_mapping` and `docs` walk a tree of sections (config.JobConfig) generically.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import types
import typing
from typing import Any, ClassVar, Iterator, Mapping


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent with another."""


def knob(default: Any, doc: str, *, choices: tuple = ()) -> Any:
    """A dataclass field carrying its doc (shown by --config.help) and its allowed values (if any); a
    dict default is copied for each instance."""
    metadata = {"doc": doc, "choices": tuple(choices)}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok."""
    if not ok:
        raise ConfigError(message)


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (modules use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def _parts(hint: Any) -> tuple[tuple[type, ...], bool]:
    """(accepted plain types, None allowed) of an annotation such as `int`, `float | None`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return tuple(a for a in args if a is not type(None)), type(None) in args
    return (hint,), False


def scalar_type(hint: Any) -> type | None:
    """The scalar type of a field (int, float, str, bool) or None for anything else."""
    plain, _ = _parts(hint)
    return plain[0] if len(plain) == 1 and plain[0] in (int, float, str, bool) else None


def _type_name(value: Any) -> str:
    return type(value).__name__


def _a(t: type) -> str:
    """"an int", "a float": a type's name with its article."""
    name = getattr(t, "__name__", str(t))
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def format_choices(choices: tuple) -> str:
    """"dense, paged"; an empty-string choice shows as ''."""
    return ", ".join(repr(c) if c == "" else str(c) for c in choices)


def parse_override(key: str, text: str, hint: Any) -> None:
    """Raise ConfigError when the command-line text of `--config.<key>=<text>` cannot be read as the
    field's number type (flag parsing would otherwise stop with a bare ValueError)."""
    plain, optional = _parts(hint)
    want = scalar_type(hint)
    if want not in (int, float) or (optional and text == "None"):
        return
    try:
        want(text)
    except ValueError:
        raise ConfigError(f"--config.{key}={text!r} is not {_a(want)}{' (or None)' if optional else ''}: give e.g. "
                          f"--config.{key}={_example(want)}.") from None


def _items(value: Any) -> list | None:
    """The (key, value) pairs of a dict or ConfigDict, else None."""
    return list(value.items()) if isinstance(value, Mapping) or hasattr(value, "items") else None


def coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` checked against the annotation `hint` (int accepted for float, never bool for a number;
    `dict[str, float]` takes any mapping; `tuple[SomeSection, ...]` takes a list of sections or of
    mappings, which become sections); raises ConfigError naming `key` (e.g. "--config.train.lr") otherwise."""
    plain, optional = _parts(hint)
    if value is None:
        require(optional, f"{key}=None is not allowed: give {' or '.join(_a(t) for t in plain)}.")
        return None
    origin, args = typing.get_origin(plain[0]), typing.get_args(plain[0])
    if origin is dict:
        pairs = _items(value)
        require(pairs is not None, f"{key}={value!r} is {_a(type(value))}, not a mapping.")
        return {coerce(f"{key} key", k, args[0]): coerce(f"{key}[{k!r}]", v, args[1]) for k, v in pairs}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
        require(isinstance(value, (list, tuple)), f"{key}={value!r} is {_a(type(value))}, not a list.")
        for i, v in enumerate(value):
            require(isinstance(v, args[0]) or _items(v) is not None,
                    f"{key}[{i}]={v!r} is {_a(type(v))}, not a section of keys.")
            bad = [] if isinstance(v, args[0]) else unknown_keys(args[0], v)
            require(not bad, f"{key}[{i}] has no key {bad[0] if bad else ''!r}; its keys are "
                    f"{', '.join(f.name for f in dataclasses.fields(args[0]))}.")
        return tuple(v if isinstance(v, args[0]) else from_mapping(args[0], v) for v in value)
    want = scalar_type(hint)
    if want is None:
        return value  # other types are checked by the section itself
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
    require(ok, f"{key}={value!r} is {_a(type(value))}, not {_a(want)}"
            f"{' (or None)' if optional else ''}: give e.g. {key}={_example(want)}.")
    return value


def _example(t: type) -> str:
    return {int: "4", float: "0.5", str: "'text'", bool: "True"}[t]


class Section:
    """Base of a config section (a frozen dataclass of knobs): types, choices, then `check()`.

    `section` is the section's name in the config tree ("train", "rollout", ...); "" for the root.
    """

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a nested section validated itself
            value = coerce(self.key(f.name), value, hints[f.name])
            object.__setattr__(self, f.name, value)
            choices = f.metadata.get("choices", ())
            require(not choices or value in choices,
                    f"{self.key(f.name)}={value!r} is not one of {format_choices(choices)}.")
        self.check()

    def check(self) -> None:
        """Ranges and relations inside the section; raise ConfigError (use `require`)."""

    def key(self, name: str) -> str:
        """How a user types this option: "--config.train.lr"."""
        return f"--config.{self.section + '.' if self.section else ''}{name}"

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)


def defaults_dict(cls: type) -> dict[str, Any]:
    """{name: default} of a section class, nested sections as nested dicts, in field order."""
    out: dict[str, Any] = {}
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = defaults_dict(hints[f.name])
        else:
            out[f.name] = _default(f)
    return out


def leaf_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """("train.lr", field, annotation) for every leaf option of a section tree, in field order."""
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, hints[f.name]


def field_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """{"train.lr": float, ...}: the annotation of every leaf option of a section tree."""
    return {key: hint for key, _, hint in leaf_fields(cls, prefix)}


def _doc(f: dataclasses.Field) -> str:
    doc = f.metadata.get("doc", "")
    choices = f.metadata.get("choices", ())
    if choices and not any(str(c) in doc for c in choices if c):
        doc = f"{doc} ({' | '.join(repr(c) if c == '' else str(c) for c in choices)})".strip()
    return doc


def docs(cls: type, prefix: str = "") -> dict[str, str]:
    """{"train.lr": "Adam learning rate", ...}: the doc of every leaf option, in field order."""
    return {key: _doc(f) for key, f, _ in leaf_fields(cls, prefix)}


def from_mapping(cls: type, mapping: Mapping[str, Any], prefix: str = ""):
    """Build a section tree from nested mappings (a ConfigDict); keys the mapping lacks keep their
    defaults. Unknown keys are the caller's to reject (config.validate names them with a suggestion)."""
    hints = type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in mapping:
            continue
        value = mapping[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            require(_items(value) is not None,
                    f"--config.{prefix}{f.name} is a {_type_name(value)}, not a section of keys.")
            kwargs[f.name] = from_mapping(hints[f.name], value, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = value
    return cls(**kwargs)


def unknown_keys(cls: type, mapping: Any, prefix: str = "") -> list[str]:
    """Keys of nested mappings (a ConfigDict) that no field of the section tree `cls` declares."""
    hints = type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    out = []
    for k, v in _items(mapping) or []:
        if k not in names:
            out.append(f"{prefix}{k}")
        elif dataclasses.is_dataclass(hints[k]) and _items(v) is not None:
            out += unknown_keys(hints[k], v, f"{prefix}{k}.")
    return out


def to_dict(obj: Any) -> dict[str, Any]:
    """A section tree as plain nested dicts (JSON-ready for scalars)."""
    return dataclasses.asdict(obj)


def load_config_file(path: str, relative_to: str | None = None) -> Any:
    """The ``get_config()`` of a config file (the ConfigDict it builds), ``path`` taken relative to the directory of
    ``relative_to`` when given: a config file builds on another with ``load_config_file("code.py", __file__)``, which
    works from any working directory."""
    if relative_to is not None:
        path = os.path.join(os.path.dirname(os.path.abspath(relative_to)), path)
    if not os.path.isfile(path):
        raise ConfigError(f"No config file {path!r}.")
    name = "_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"The config file {path!r} defines no get_config().")
    return module.get_config()

"""Typed settings from YAML, for any tree of config dataclasses: files read in order (a file may
extend another), `section.key=value` overrides, every value checked against its type and the rules
in its annotation (rules.py, one error naming the key and the fix), and a tree written back as
YAML with each field's comment. config.py holds the project's own settings and uses these."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml

from .rules import ConfigError, Rule

PACKAGE = __name__.split(".")[0]  # the project's package, whose config module rewrites files (sync)
EXTENDS = "extends"  # a config file's first key: the file it is read over
COMMENT_COLUMN = 24
ELSEWHERE_CUTOFF = 0.8  # a key of another section is suggested only when nearly the same


def build(root: type, tree: dict):
    """A validated `root` (a dataclass of section dataclasses) from a tree of sections."""
    try:
        checked = check_tree(root, tree)
    except UnknownSetting as err:  # the caller did not say which file: the general fix
        raise located(err, None, "<your config file>") from None
    return root(**{name: cls(**checked.get(name, {})) for name, cls in typing.get_type_hints(root).items()})


class UnknownSetting(ConfigError):
    """A section or key that the dataclasses do not have; `owner`: the dataclass that lacks the key."""

    def __init__(self, message: str, owner: str | None = None):
        super().__init__(message)
        self.owner = owner


def located(err: ConfigError, source: str | None, path: str | None = None) -> ConfigError:
    """`err` saying where its setting came from (`source`: "in FILE", "from the command line's
    a.b=c"); an unknown key read from a file also gets the fix for a dataclass that changed."""
    said = [source] if source else []
    if isinstance(err, UnknownSetting) and err.owner and path:
        said.append(f"if {err.owner} changed, `python -m {PACKAGE}.config sync {path}` drops its old keys")
    return ConfigError(f"{err} ({'; '.join(said)})" if said else str(err))


def check_tree(root: type, tree: dict) -> dict:
    """`tree` (one file's sections, or one override's) with each value as its setting's type reads
    it (3 for a float is 3.0); ConfigError naming the first section, key or value that `root` does
    not take, and for a misspelt name the closest known one."""
    sections = typing.get_type_hints(root)
    checked = {}
    for name, values in tree.items():
        if name not in sections:
            near = difflib.get_close_matches(name, sections, 1)
            hint = f"did you mean {near[0]}?" if near else f"known: {', '.join(sections)}"
            raise UnknownSetting(f"{name}: unknown section; {hint}")
        if not isinstance(values, dict | None):
            raise ConfigError(f"{name}: expected a mapping of keys, got {values!r}")
        checked[name] = check_section(name, sections[name], values or {}, sections)
    return checked


def check_section(name: str, cls: type, values: dict, sections: dict) -> dict:
    hints = typing.get_type_hints(cls, include_extras=True)
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise UnknownSetting(f"{name}.{key}: unknown key; {closest_key(name, key, known, sections)}", cls.__name__)
    return {key: check_type(f"{name}.{key}", value, hints[key]) for key, value in values.items()}


def closest_key(name: str, key: str, known: list[str], sections: dict) -> str:
    """ "did you mean section.key?" for a misspelt key: the same key in another section (a key under
    the wrong one), else the section's key it begins (warmup -> warmup_fraction) or is closest to
    (difflib's ratio), else nearly the same key of another section; else the section's keys."""
    elsewhere: dict[str, list[str]] = {}
    for other, kind in sections.items():
        for f in dataclasses.fields(kind):
            if other != name:
                elsewhere.setdefault(f.name, []).append(f"{other}.{f.name}")
    if key in elsewhere:
        *others, last = elsewhere[key]
        return f"did you mean {', '.join(others) + ' or ' if others else ''}{last}?"
    near = [k for k in known if k.startswith(key)][:1] or difflib.get_close_matches(key, known, 1)
    if near:
        return f"did you mean {name}.{near[0]}?"
    near = difflib.get_close_matches(key, elsewhere, 1, ELSEWHERE_CUTOFF)
    return f"did you mean {elsewhere[near[0]][0]}?" if near else f"known keys: {', '.join(sorted(known))}"


def upgrade(tree: dict, renamed: dict[str, str], sections) -> tuple[dict, list[str]]:
    """`tree` with each key that `renamed` maps ("section.key" -> "section.key") under its new
    name, and the old names it held; an old section left empty goes unless it is in `sections`."""
    tree = {name: dict(values) if isinstance(values, dict) else values for name, values in tree.items()}
    moved = []
    for old, new in renamed.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        if isinstance(tree.get(old_section), dict) and old_key in tree[old_section]:
            if not isinstance(tree.get(new_section), dict):
                tree[new_section] = {}
            if new_key in tree[new_section]:
                raise ConfigError(f"{old} and {new} name one setting: keep {new}, drop {old}")
            tree[new_section][new_key] = tree[old_section].pop(old_key)
            moved.append(old)
            if not tree[old_section] and old_section not in sections:
                del tree[old_section]
    return tree, moved


def render(cfg, head: str, only: dict | None = None) -> str:
    """Settings with their values and the comments of their dataclass fields, under `head`: every
    setting of `cfg`, or those `only` names (an experiment file's)."""
    lines = [head.rstrip("\n")]
    for name in typing.get_type_hints(type(cfg)):
        section = getattr(cfg, name)
        comments = field_comments(type(section))
        keys = [f.name for f in dataclasses.fields(section) if only is None or f.name in only.get(name, {})]
        lines += ["", f"{name}:"] if keys else []
        for key in keys:
            line = f"  {key}: {yaml_scalar(getattr(section, key))}"
            comment = comments.get(key)  # a field without one gets no empty "#"
            lines.append(f"{line.ljust(COMMENT_COLUMN - 1)}  # {comment}" if comment else line)
    return "\n".join(lines) + "\n"


def layers(path: Path, extending: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """The file at `path` and what it extends, base first: (path, its settings)."""
    if path.resolve() in extending:
        chain = " -> ".join(str(p) for p in (*extending, path.resolve()))
        raise ConfigError(f"config file {path}: `{EXTENDS}` goes round ({chain}); end it at a file without one")
    tree = load_tree(path)
    base = tree.pop(EXTENDS, None)
    if base is None:
        return [(path, tree)]
    if not isinstance(base, str):
        raise ConfigError(f"config file {path}: `{EXTENDS}: {base!r}` must name one YAML file from {path.parent}")
    target = Path(os.path.normpath(path.parent / base))
    if not target.is_file():  # the file given exists: it is the one to fix
        raise ConfigError(
            f"config file {path}: its `{EXTENDS}: {base}` names {target}, which is "
            f"{'not a file' if target.exists() else 'missing'}; fix the path there (it is read from {path.parent})"
        )
    return [*layers(target, (*extending, path.resolve())), (path, tree)]


def load_tree(path: str | Path) -> dict:
    """A config file's sections as YAML reads them."""
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror}; pass an existing --config") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(tree).__name__}")
    return tree


def merge(tree: dict, layer: dict) -> None:
    """Apply `layer`'s sections over `tree`'s, key by key."""
    for name, values in layer.items():
        if values is None:  # a section named with nothing under it changes nothing
            tree.setdefault(name, {})
        elif isinstance(values, dict) and isinstance(tree.get(name), dict):
            tree[name].update(values)
        else:
            tree[name] = dict(values) if isinstance(values, dict) else values


def parse_override(item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:
        return key.strip(), raw


def set_path(tree: dict, key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is not a section")
    node[leaf] = value


def check_type(key: str, value, expected):
    if typing.get_origin(expected) is Annotated:
        value = check_type(key, value, expected.__origin__)
        for rule in expected.__metadata__:
            if isinstance(rule, Rule) and not holds(rule, key, value):
                raise ConfigError(f"{key}: {value!r} is invalid; {rule.fix}")
        return value
    if typing.get_origin(expected) in (Union, types.UnionType):
        for option in typing.get_args(expected):
            try:
                return check_type(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} is not {describe(expected)}")
    if typing.get_origin(expected) is Literal:
        if value not in typing.get_args(expected):
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, typing.get_args(expected)))}")
        return value
    if expected is type(None):
        if value is not None:
            raise ConfigError(f"{key}: {value!r} is not null")
        return None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str):
        try:  # YAML 1.1 reads 3e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: {value!r} is not {describe(expected)}")
    return value


def holds(rule: Rule, key: str, value) -> bool:
    """Whether `value` keeps the rule; a rule that fails to run is the setting's error, in one line."""
    try:
        return bool(rule.holds(value))
    except Exception as err:
        raise ConfigError(
            f"{key}: its Rule raised {type(err).__name__}: {err} on {value!r}; fix the rule where {key} is declared"
        ) from None


def describe(expected) -> str:
    if typing.get_origin(expected) is Annotated:
        return describe(expected.__origin__)
    if typing.get_origin(expected) in (Union, types.UnionType):
        return " or ".join(describe(option) for option in typing.get_args(expected))
    if typing.get_origin(expected) is Literal:
        return " or ".join(repr(v) for v in typing.get_args(expected))
    return {
        type(None): "null",
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
    }[expected]


def field_comments(cls: type) -> dict[str, str]:
    """The `# comment` written after each field of a config dataclass, read from its source."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"^\s+(\w+):[^#]*#\s*(.+)$", line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def yaml_scalar(value) -> str:
    return yaml.safe_dump([value], default_flow_style=True, width=1000).strip()[1:-1]


def type_problem(key: str, value, expected) -> str | None:
    """Why `value` is not of the setting's type (its rules aside), or None."""
    base = expected.__origin__ if typing.get_origin(expected) is Annotated else expected
    try:
        check_type(key, value, base)
    except ConfigError as err:
        return str(err).removeprefix(f"{key}: ")
    return None

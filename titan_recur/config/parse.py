"""Reading the job config: TOML files (and their extends), a run's saved config.json, ``--section.key value``
flags, and ``--help``.

Precedence is defaults < config file < command line. Values are type-checked strictly (a bool is
not an int, a TOML int is not a bool) so that a typo or a wrong type stops the job at startup with
one line naming the key, where it came from and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import types
from collections.abc import Sequence
from functools import cache
from typing import Any, Literal, Union, cast, get_args, get_origin, get_type_hints

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from titan_recur.config.errors import ConfigError, suggest
from titan_recur.config.schema import JobConfig
from titan_recur.config.validate import validate
from titan_recur.utils.resources import find_config

_CLI = "command line"
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


# ---------------------------------------------------------------------------------------------
# Types


@cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of a config dataclass."""
    return get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = get_args(tp)
        if len(args) == 2 and type(None) in args:
            return next(a for a in args if a is not type(None)), True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _strip_optional(tp)
    if optional:
        return f"{_type_name(inner)} | None"
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return "array of tables"
    if origin in (list, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if dataclasses.is_dataclass(tp):
        return "table"
    return tp.__name__


def _is_table_list(tp: Any) -> bool:
    return get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0])


# ---------------------------------------------------------------------------------------------
# Values from TOML / JSON / dicts


def _render(path: tuple[str | int, ...]) -> str:
    """("data", "phases", 1, "sources", 0) -> "[data.phases][1].sources[0]"."""
    n = next((i for i, p in enumerate(path) if isinstance(p, int)), len(path))
    out = f"[{'.'.join(cast('tuple[str, ...]', path[:n]))}]"  # the keys before the first index
    for p in path[n:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _where(path: tuple[str | int, ...]) -> str:
    """Location of a value: "[training] steps", "[validation.recurrences][2]", "[training]"."""
    if len(path) >= 2 and isinstance(path[-1], str):
        return f"{_render(path[:-1])} {path[-1]}"
    return _render(path)


def _from_value(value: Any, tp: Any, source: str, path: tuple[str | int, ...]) -> Any:
    """Check a parsed TOML/JSON value against ``tp``, converting arrays to lists/tuples/dataclasses."""
    inner, optional = _strip_optional(tp)
    origin, args = get_origin(inner), get_args(inner)
    if optional and value is None:
        return None
    if dataclasses.is_dataclass(inner) and isinstance(value, dict):
        return _build(cast(type, inner), value, source, path)  # a type hint: a dataclass type
    if origin is list and isinstance(value, (list, tuple)):
        return [_from_value(v, args[0], source, path + (i,)) for i, v in enumerate(value)]
    if origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        return tuple(_from_value(v, t, source, path + (i,)) for i, (v, t) in enumerate(zip(value, args, strict=True)))
    if origin is Literal and any(type(value) is type(a) and value == a for a in args):
        return value
    if inner is float and type(value) in (int, float):
        return float(value)
    if inner in (int, str, bool) and type(value) is inner:
        return value
    raise ConfigError(f"{source}: {_where(path)} expects {_type_name(tp)}, got {value!r}")


def _build(cls: type, values: dict[str, Any], source: str, path: tuple[str | int, ...]) -> Any:
    hints = field_types(cls)
    for key in values:
        if key not in hints:
            hint = suggest(key, list(hints))
            what = f"unknown section {key!r}" if not path else f"{_render(path)} unknown key {key!r}"
            raise ConfigError(f"{source}: {what}" + (f" (did you mean {hint!r}?)" if hint else ""))
    return cls(**{k: _from_value(v, hints[k], source, path + (k,)) for k, v in values.items()})


def config_from_dict(values: dict[str, Any], source: str = "dict") -> JobConfig:
    """JobConfig from nested dicts (parsed TOML, a saved ``config_to_dict``); no cross-field checks."""
    return _build(JobConfig, values, source, ())


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain JSON-able nested dict (tuples become lists) for saving the resolved config with a run."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_to_json(cfg: JobConfig) -> str:
    """The resolved config as the run saves it (config.json) and ``--print-config`` shows it; ``--config`` reads it."""
    return json.dumps(config_to_dict(cfg), indent=2) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


class _Entry:
    """The type of ``--ARRAY.N`` (an entry of an array of tables): its one value, none, drops the entry."""


_DROP = object()  # the parsed value of ``--ARRAY.N none``


def option_types() -> dict[str, Any]:
    """``"section.key"`` -> type, for every settable option."""
    return {
        f"{section}.{key}": tp
        for section, cls in field_types(JobConfig).items()
        for key, tp in field_types(cls).items()
    }


def _from_text(text: str, tp: Any) -> Any:
    """Parse a command-line string as ``tp``; raises ValueError when it doesn't fit."""
    inner, optional = _strip_optional(tp)
    origin, args = get_origin(inner), get_args(inner)
    if optional and text.lower() == "none":
        return None
    if origin is list:
        return [_from_text(t.strip(), args[0]) for t in text.split(",")] if text.strip() else []
    if origin is tuple:
        parts = text.split(",")
        if len(parts) != len(args):
            raise ValueError(text)
        return tuple(_from_text(p.strip(), t) for p, t in zip(parts, args, strict=True))
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(text)
    if inner is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(text)
        return text.lower() in _TRUE
    if inner in (int, float, str):
        return inner(text)
    raise ValueError(text)


def _unknown_option(name: str, choices: Sequence[str]) -> ConfigError:
    hint = suggest(name, choices)
    return ConfigError(f"{_CLI}: unknown option --{name}" + (f" (did you mean --{hint}?)" if hint else ""))


def option_type(name: str, options: dict[str, Any]) -> Any:
    """Type of ``section.key``, or of a field inside arrays of tables: ``data.phases.1.sources.0.path``."""
    parts = name.split(".")
    head = ".".join(parts[:2])
    if head not in options:
        raise _unknown_option(name, list(options))
    tp, prefix, rest = options[head], head, parts[2:]
    while rest:
        if not _is_table_list(tp):
            raise _unknown_option(name, list(options))
        index, *rest = rest
        if not index.isdigit():
            raise ConfigError(f"{_CLI}: --{name}: expected an entry number after --{prefix}, got {index!r}")
        prefix += f".{index}"
        if not rest:
            return _Entry
        cls = get_args(tp)[0]
        key, *rest = rest
        if key not in field_types(cls):
            raise _unknown_option(name, [f"{prefix}.{k}" for k in field_types(cls)])
        tp, prefix = field_types(cls)[key], f"{prefix}.{key}"
    return tp


def _assign(cfg: JobConfig, name: str, value: Any) -> None:
    """Set option ``name`` (see option_type); entry number len(array) appends a table of defaults.

    ``value`` _DROP removes the entry ``name`` names; the entries after it move up by one.
    """
    parts = name.split(".")
    obj = getattr(cfg, parts[0])
    for depth, (key, index) in enumerate(
        zip(parts[1::2], map(int, parts[2::2]), strict=False)
    ):  # the last key has no index
        entries = getattr(obj, key)
        array = ".".join(parts[: 2 * depth + 2])
        if value is _DROP and 2 * depth + 3 == len(parts):
            if index >= len(entries):
                numbers = f" (0..{len(entries) - 1})" if entries else ""
                raise ConfigError(f"{_CLI}: --{name}: {array} has {len(entries)} entries{numbers}; nothing to drop")
            del entries[index]
            return
        if index > len(entries):
            raise ConfigError(
                f"{_CLI}: --{name}: {array} has {len(entries)} entries; use an entry number up to "
                f"{len(entries)} (that one appends a new entry)"
            )
        if index == len(entries):
            table: type = type(obj)
            entries.append(get_args(field_types(table)[key])[0]())
        obj = entries[index]
    setattr(obj, parts[-1], value)


def _parse_overrides(argv: Sequence[str]) -> list[tuple[str, Any]]:
    """``--a.b v`` / ``--a.b=v`` tokens -> [("a.b", value)]; a bare boolean flag means true.

    Fields inside arrays of tables take the entry number: ``--data.sources.0.path v``.
    """
    options, out, i = option_types(), [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"{_CLI}: unexpected argument {token!r} (options are --section.key value)")
        name, eq, text = token[2:].partition("=")
        tp = option_type(name, options)
        if _is_table_list(tp):
            raise ConfigError(
                f"{_CLI}: --{name} is an array of tables; set a field of entry N as --{name}.N.key "
                f"(e.g. --{name}.0.path) or [[{name}]] in the config file"
            )
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if tp is bool and (nxt is None or nxt.startswith("--")):
                text = "true"
            elif nxt is None:
                what = "none, to drop the entry" if tp is _Entry else _type_name(tp)
                raise ConfigError(f"{_CLI}: --{name} needs a value ({what})")
            else:
                text, i = nxt, i + 1
        if tp is _Entry:
            if text.lower() != "none":
                array = name.rpartition(".")[0]
                raise ConfigError(
                    f"{_CLI}: --{name} is an entry of {array}; the only value it takes is none (drop it); "
                    f"set its fields as --{name}.key"
                )
            out.append((name, _DROP))
            i += 1
            continue
        try:
            out.append((name, _from_text(text, tp)))
        except ValueError:
            raise ConfigError(f"{_CLI}: --{name} expects {_type_name(tp)}, got {text!r}") from None
        i += 1
    return out


def _split_config_arg(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Pull ``--config FILE`` / ``--config=FILE`` out of argv; the rest are overrides."""
    path, rest, i = None, [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--config" or token.startswith("--config="):
            if path is not None:
                raise ConfigError(f"{_CLI}: --config given more than once")
            if token == "--config":
                if i + 1 >= len(argv):
                    raise ConfigError(f"{_CLI}: --config needs a file")
                i += 1
                path = argv[i]
            else:
                path = token.partition("=")[2]
        else:
            rest.append(token)
        i += 1
    return path, rest


def _field_help(cls: type, table: str, indent: str, cli: bool) -> list[str]:
    """Help lines for each field of ``cls`` (the TOML table ``table``); arrays of tables are file-only."""
    lines, defaults, pad = [], cls(), indent + "    "
    for f in dataclasses.fields(cls):
        tp, default, doc = field_types(cls)[f.name], getattr(defaults, f.name), f.metadata["help"]
        if _is_table_list(tp):
            lines.append(f"{indent}[[{table}.{f.name}]] (array of tables; default {default!r})")
            doc += " Each table has:"
        else:
            name = f"--{table}.{f.name}" if cli else f.name
            lines.append(f"{indent}{name} ({_type_name(tp)}; default {default!r})")
        lines.append(textwrap.fill(doc, 100, initial_indent=pad, subsequent_indent=pad))
        if _is_table_list(tp):
            lines += _field_help(get_args(tp)[0], f"{table}.{f.name}", indent + "      ", cli=False)
    return lines


def format_help(prog: str = "train") -> str:
    """Every option, grouped by section, with its doc, type and default."""
    lines = [
        f"usage: {prog} [--config FILE] [--force] [--section.key VALUE | --section.key=VALUE ...]",
        f"       {prog} --config FILE --check [--world-size N] [--assume-mfu F] [--gpu NAME] [overrides ...]",
        "",
        "Defaults < config file < command line. Lists are comma-separated (1,2,4); 'none' sets an",
        "optional value to None; booleans take true/false/1/0/yes/no, and a bare flag means true.",
        "A field of an array of tables takes the entry number: --data.sources.0.path FILE (the next",
        "number appends an entry); --data.sources.1 none drops entry 1 (one the config inherited, say),",
        "and the entries after it move up by one for the overrides that follow.",
        "",
        "  --config FILE",
        '      TOML job config (or a saved config.json). A file may start with extends = "base.toml" (or a',
        "      list of files, relative to it): its tables merge over theirs, arrays replace theirs.",
        "  --print-config",
        "      Print the resolved config (defaults < file < command line, values checked) as JSON and",
        "      exit, before any model, tokenizer or data file is opened; --config reads the output back.",
        "  --force",
        "      Start over in a dump folder where an earlier run finished and left no checkpoint to continue",
        "      from: its final_model/ and config.json are replaced (refused without --force).",
        "  -h, --help",
        "      Show this help and exit.",
        "",
        "Preflight, before you queue: --check opens the model folder, the tokenizer and every data source,",
        "checks the batch geometry for --world-size N ranks (default: torchrun's WORLD_SIZE, else 1) and",
        "prints the plan (parameters, tokens, steps, training FLOPs, memory per GPU, time at --assume-mfu",
        "F of --gpu NAME's peak, e.g. h100), then exits: 0 when every check passed, 2 otherwise. No",
        "accelerator, process group or file write is needed.",
    ]
    for section, cls in field_types(JobConfig).items():
        lines += ["", f"[{section}] {cls.__doc__}"]
        lines += _field_help(cls, section, "  ", cli=True)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry points


def _read_file(path: str) -> dict[str, Any]:
    """Parse a TOML file, or JSON when it ends in .json (a run's saved resolved config): a table of sections."""
    try:
        with open(path, "rb") as f:
            values = json.load(f) if path.endswith(".json") else tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at position {e.start})") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level is a {type(values).__name__}, not a table of sections")
    return values


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; every other value (arrays and arrays of tables too) replaces the base's."""
    merged = dict(base)
    for key, value in over.items():
        both_tables = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both_tables else value
    return merged


def read_config_file(path: str, _chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config file's values over those of the files it ``extends`` (in order, later ones win).

    ``extends = "base.toml"`` or a list, relative to the file. Each file is type-checked on its own
    first, so an error names the file that has the bad key.
    """
    values = _read_file(path)
    parents = values.pop("extends", [])
    parents = [parents] if isinstance(parents, str) else parents
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: extends expects a file name or a list of file names, got {parents!r}")
    config_from_dict(values, source=path)
    chain, merged = _chain + (os.path.realpath(path),), dict[str, Any]()
    for parent in parents:
        parent_path = os.path.join(os.path.dirname(path), parent)
        if os.path.realpath(parent_path) in chain:
            raise ConfigError(f"{path}: extends {parent!r}, which extends {path} again (a cycle)")
        if not os.path.isfile(parent_path):
            raise ConfigError(f"{path}: extends {parent!r}, but {parent_path} is not a file")
        merged = _merge(merged, read_config_file(parent_path, chain))
    return _merge(merged, values)


def load_config(path: str | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Defaults, then the file at ``path`` (if any), then ``--section.key value`` overrides; validated."""
    path = find_config(path) if path else path
    cfg = config_from_dict(read_config_file(path), source=path) if path else JobConfig()
    for name, value in _parse_overrides(overrides):
        _assign(cfg, name, value)
    validate(cfg)
    return cfg


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """The trainer's command line: ``[--config FILE] [--section.key value ...]``; ``--help`` and ``--print-config`` exit 0."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(format_help(os.path.basename(sys.argv[0]) or "train"))
        raise SystemExit(0)
    path, overrides = _split_config_arg(argv)
    if "--print-config" in overrides:
        print(config_to_json(load_config(path, [a for a in overrides if a != "--print-config"])), end="")
        raise SystemExit(0)
    return load_config(path, overrides)

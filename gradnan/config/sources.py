"""Where a configuration comes from besides keyword arguments: ``GRADNAN_*`` environment variables
(``options_from_env``) and a JSON or TOML file named by ``GRADNAN_CONFIG`` (``options_from_file``),
each value parsed to its field's type, and ``resolve_config``, which merges them in their order of
precedence.

Apart from ``GradnanConfig`` (``gradnan.config``) because this is the part that reads untrusted text (a
variable, a file of any size or syntax) and must turn every mistake into a one-line error naming the
field; the dataclass only checks values it is given.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from ..errors import ConfigError, InputError
from ..formats.schema import read_text
from . import _ENUM_FIELDS, _FIELD_TYPES, PATTERN_FIELDS, RANGE_FIELDS, GradnanConfig, _has_type
from .values import Ranges, parse_patterns

ENV_PREFIX = "GRADNAN_"
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few lines; a larger one (or /dev/zero) is refused
CONFIG_FILE_ENV = "GRADNAN_CONFIG"  # names a config file; not a field
RESERVED_PREFIXES = ("GRADNAN_SELFTEST_",)  # read by `gradnan selftest` only (its test switches)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(text: str) -> Optional[bool]:
    """1/0, true/false, yes/no, on/off (any case, spaces around); None for anything else."""
    lowered = text.strip().lower()
    return True if lowered in _TRUE else False if lowered in _FALSE else None


def _input_type(name: str) -> type:
    """The type a field is given as in a variable or a file: text for a mode (an enum)."""
    return str if name in _ENUM_FIELDS else _FIELD_TYPES[name]


def _parse(name: str, raw: str) -> Any:
    text = raw.strip()
    type_name = _input_type(name)
    if type_name is bool:
        value = parse_bool(text)
        if value is not None:
            return value
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a boolean (use 1/0, true/false)")
    if type_name is int:
        if not re.fullmatch(r"-?[0-9]{1,18}", text):  # ASCII digits: int() would take "٣" or "1_000"
            raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not an integer")
        return int(text)
    if type_name == Tuple[str, ...]:
        return parse_patterns(text)
    return text


def options_from_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The ``GRADNAN_*`` variables as config fields; an unknown ``GRADNAN_`` name is an error (typos)."""
    environ = os.environ if environ is None else environ
    by_env_name = {ENV_PREFIX + spec.name.upper(): spec for spec in fields(GradnanConfig)}
    options = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(RESERVED_PREFIXES) or key == CONFIG_FILE_ENV:
            continue
        spec = by_env_name.get(key)
        if spec is None:
            known = ", ".join(sorted([*by_env_name, CONFIG_FILE_ENV]))
            raise ConfigError(f"unknown environment variable {key} (known: {known})")
        options[spec.name] = _parse(spec.name, raw)
    return options


def _file_value(where: str, name: str, value: Any) -> Any:
    """A config-file value as the field's type: ranges and patterns may also be lists."""
    if name in RANGE_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if name in RANGE_FIELDS and isinstance(value, list):
        if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}: field '{name}' must list step/rank numbers or ranges like \"3-5\"")
        value = ",".join(str(v) for v in value)
    elif name in PATTERN_FIELDS and isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: field '{name}' must list module names or patterns (text)")
        value = ",".join(value)
    type_name = _input_type(name)
    if type_name == Tuple[str, ...] and isinstance(value, (list, str)):
        value = tuple(value) if isinstance(value, list) else parse_patterns(value)
    if not _has_type(value, type_name):
        kind = {str: "text", bool: "true or false", int: "an integer"}.get(type_name, "a list of names")
        raise ConfigError(f"{where}: field '{name}' must be {kind}, got {value!r}")
    if name in RANGE_FIELDS:
        try:
            Ranges.parse(value, name)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return value


def options_from_file(path: str) -> Dict[str, Any]:
    """The fields of a JSON (``.json``) or TOML (``.toml``) config file; unknown or ill-typed fields are
    errors naming the field."""
    where = f"gradnan config file {path}"
    is_toml = str(path).lower().endswith(".toml")
    try:
        text = read_text(Path(path), MAX_CONFIG_BYTES, follow=True)
    except InputError as exc:
        raise ConfigError(f"gradnan config file {exc}") from None
    try:
        document = tomllib.loads(text) if is_toml else json.loads(text)
    except (ValueError, RecursionError) as exc:
        syntax = "TOML" if is_toml else "JSON"
        raise ConfigError(f"{where}: invalid {syntax} ({str(exc).splitlines()[0][:100]})") from None
    if not isinstance(document, dict):
        raise ConfigError(f"{where}: must hold one object of fields")
    by_name = {spec.name: spec for spec in fields(GradnanConfig)}
    options = {}
    for name, value in document.items():
        spec = by_name.get(name)
        if spec is None:
            raise ConfigError(f"{where}: unknown field '{name}' (known: {', '.join(sorted(by_name))})")
        options[name] = _file_value(where, name, value)
    return options


def resolve_config(
    config: Optional[GradnanConfig] = None,
    environ: Optional[Mapping[str, str]] = None,
    config_file: Optional[str] = None,
    **options: Any,
) -> GradnanConfig:
    """Defaults < config file (``config_file``, else ``GRADNAN_CONFIG``) < ``GRADNAN_*`` environment <
    the fields given to ``config``'s constructor < keyword arguments (``None``: not given)."""
    known = {spec.name for spec in fields(GradnanConfig)}
    for name in options:
        if name not in known:
            raise ConfigError(f"unknown gradnan option '{name}' (known: {', '.join(sorted(known))})")
    if config is not None and not isinstance(config, GradnanConfig):
        raise ConfigError(f"gradnan argument 'config' is a {type(config).__name__}, not a GradnanConfig")
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(CONFIG_FILE_ENV, "").strip()
    merged: Dict[str, Any] = options_from_file(config_file) if config_file else {}
    merged.update(options_from_env(environ))
    if config is not None:
        merged.update({name: getattr(config, name) for name in config.explicit_fields})
    merged.update({name: value for name, value in options.items() if value is not None})
    return GradnanConfig(**merged)

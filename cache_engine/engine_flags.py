""":class:`~ragkv.cache_engine.config.EngineConfig` on the command line.

Each field carries its :class:`~ragkv.cache_engine.config.Flag` (help, option name, type,
choices), so a command offers engine settings with :func:`add_engine_flags` and reads them
back with :func:`engine_config_from_args` (or :func:`engine_settings`, for a command whose
own config holds them), instead of declaring and mapping each flag by hand. Defaults come
from :data:`~ragkv.cache_engine.config.DEFAULTS`. Imports no torch (``ragkv --help`` runs
this).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from ragkv.cache_engine.config import DEFAULTS, EngineConfig, Flag


def engine_fields(
    names: Collection[str] | None = None, *, exclude: Collection[str] = ()
) -> list[dataclasses.Field[Any]]:
    """The EngineConfig fields named in ``names`` (None: every one), in declaration order."""
    known = {f.name: f for f in dataclasses.fields(EngineConfig)}
    unknown = set(names or ()) | set(exclude)
    unknown -= known.keys()
    if unknown:
        raise ValueError(f"not EngineConfig fields: {', '.join(sorted(unknown))}")
    wanted = known.keys() if names is None else names
    return [f for name, f in known.items() if name in wanted and name not in exclude]


def add_engine_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Collection[str] | None = None,
    *,
    exclude: Collection[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Add one option per EngineConfig field in ``names`` (None: all but ``exclude``).

    Each option stores into the field's own name, with ``DEFAULTS``' value as its default;
    a bool field's option flips its default. ``overrides`` maps a field to argparse keywords
    that replace the field's own (a command whose default means something else, e.g.
    ``{"kv_cache_tokens": {"help": "default: sized to the workload"}}``).
    """
    overrides = overrides or {}
    for spec in engine_fields(names, exclude=exclude):
        flag: Flag = spec.metadata["flag"]
        default = getattr(DEFAULTS, spec.name)
        options: dict[str, Any] = {"dest": spec.name, "default": default, "help": flag.help}
        if isinstance(default, bool):
            options["action"] = "store_false" if default else "store_true"
        else:
            options["type"] = flag.type
            if flag.choices is not None:
                options["choices"] = flag.choices
        options.update(overrides.get(spec.name, {}))
        parser.add_argument(flag.name or "--" + spec.name.replace("_", "-"), **options)


def engine_settings(
    args: argparse.Namespace, names: Collection[str] | None = None
) -> dict[str, Any]:
    """``{field: value}`` for each EngineConfig field in ``names`` (None: all) that ``args``
    holds, i.e. each one :func:`add_engine_flags` added to the parser."""
    return {f.name: getattr(args, f.name) for f in engine_fields(names) if hasattr(args, f.name)}


def engine_config_from_args(
    args: argparse.Namespace, base: EngineConfig = DEFAULTS
) -> EngineConfig:
    """``base`` with every engine setting the parsed flags hold (validated once, here)."""
    return base.replace(**engine_settings(args))

"""Options made from config fields, by the rule of ``undying.config``: ``--a-b`` is the field
``a_b``.

``add_setting`` declares an option for a field of a config dataclass (``JobConfig``, one of its
sections, ``ManagerOptions``): its ``dest`` is the field's name and its default the field's
default, so the default is written once, on the field; the help, written where the option is
declared, shows it with argparse's ``%(default)g`` (or ``%(default)s``). ``from_args`` builds the
dataclass back from the parsed options by the same rule. ``tests/unit/test_one_name.py`` checks
that every option of ``undying run`` and ``undying manager`` follows it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

__all__ = ["add_setting", "from_args", "field_default"]

T = TypeVar("T")


def field_default(section: type[Any], name: str) -> Any:
    """The default written on ``section``'s field ``name`` (a fresh one when it is a factory's)."""
    found = {f.name: f for f in dataclasses.fields(section)}.get(name)
    if found is None:
        raise AssertionError(f"{section.__name__} has no field {name!r}: an option is its field's "
                             "name")
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    if found.default is dataclasses.MISSING:
        raise AssertionError(f"{section.__name__}.{name} has no default for its option to take")
    return found.default


def add_setting(group: argparse._ActionsContainer, section: type[Any], *options: str,
                **kwargs: Any) -> argparse.Action:
    """``group.add_argument(*options, **kwargs)`` for the field of ``section`` the long option
    names."""
    name = next(o for o in options if o.startswith("--")).removeprefix("--").replace("-", "_")
    return group.add_argument(*options, dest=name, default=field_default(section, name), **kwargs)


def from_args(section: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``section`` with each field from its option by the rule, or from ``given`` (a derived
    value)."""
    fields = dataclasses.fields(section)  # type: ignore[arg-type]
    values = {f.name: getattr(args, f.name) for f in fields
              if f.name not in given and hasattr(args, f.name)}
    return section(**values, **given)

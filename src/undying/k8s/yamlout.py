"""A small YAML writer for Kubernetes manifests, with comments.

Why not PyYAML: it is not a dependency of undying (only of the test extra),
and it cannot write comments, which is where the manifests say what was not
measured or will not survive a pod. Manifests only hold dicts, lists,
strings, ints and bools, so block style with careful quoting is enough.

Quoting matters more than it looks: kubectl reads YAML 1.1, where a plain
``on``, ``no`` or ``y`` is a bool and ``0755`` a number. A string is written
plain only when it cannot be read as anything but that string; otherwise it
is written as a JSON string, which YAML reads back exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["dump", "dump_all", "scalar"]

# Starts with a letter or a slash (or a command-line flag's dashes and a letter), then
# letters, digits and a few safe marks: never a number, a date, an anchor, a tag, a
# flow collection, a comment or a document marker.
_PLAIN = re.compile(r"(-{1,2}[A-Za-z]|[A-Za-z/])[A-Za-z0-9_./=-]*")
# Words YAML 1.1 (kubectl) or 1.2 reads as something other than a string.
_RESERVED = {
    "y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf",
}


def scalar(value: Any) -> str:
    """One scalar as YAML text that reads back as the same value and type."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        raise TypeError(f"floats are not written to manifests (got {value!r}); "
                        "use a string or an int")
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to a manifest")


def _lines(value: Any, indent: int) -> Iterable[str]:
    """The block-style lines of a dict or list, each already indented."""
    pad = " " * indent
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"manifest keys are strings, got {key!r}")
            head = f"{pad}{scalar(key)}:"
            if _is_block(item):
                yield head
                # Lists under a key sit at the key's indent (the usual Kubernetes style).
                yield from _lines(item, indent if isinstance(item, list) else indent + 2)
            else:
                yield f"{head} {_inline(item)}"
    elif isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            if _is_block(item):
                sub = list(_lines(item, indent + 2))
                # The first line of the item follows the dash on the same line.
                yield f"{pad}- {sub[0][indent + 2:]}"
                yield from sub[1:]
            else:
                yield f"{pad}- {_inline(item)}"
    else:
        raise TypeError(f"expected a dict or list, got {value!r}")


def _is_block(value: Any) -> bool:
    return isinstance(value, Mapping | list) and len(value) > 0


def _inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return scalar(value)


def dump(doc: Mapping[str, Any], comments: Sequence[str] = ()) -> str:
    """One document: its comments (each line prefixed ``# ``), then the mapping."""
    head = [f"# {line}".rstrip() for c in comments for line in c.splitlines()]
    return "\n".join([*head, *_lines(doc, 0)]) + "\n"


def dump_all(docs: Sequence[tuple[Mapping[str, Any], Sequence[str]]],
             header: Sequence[str] = ()) -> str:
    """Several documents separated by ``---``, with a header comment at the top."""
    parts = [f"# {line}".rstrip() + "\n" for h in header for line in h.splitlines()]
    for i, (doc, comments) in enumerate(docs):
        if i:
            parts.append("---\n")
        parts.append(dump(doc, comments))
    return "".join(parts)

"""``undying checkpoints list|verify|show``: what a job has on disk, and whether it can be
trusted."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from undying.checkpoint import Checkpoint, CheckpointError, Store, scan
from undying.checkpoint.aside import batches
from undying.checkpoint.lock import live_owner
from undying.checkpoint.mac import key_from_token, using_key
from undying.cli.client import resolve_job_dir
from undying.errors import UsageError
from undying.jobfiles.tokens import find_token

__all__ = ["add_parser", "resolve_root", "checkpoint_row"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "checkpoints",
        help="list, verify or show a job's persistent checkpoints",
        description="List a job's checkpoints (step, kind, world size, size, valid?, age), verify "
        "every file against its manifest's size and checksum (exit 1 naming each problem), or "
        "show a manifest. The root is <job dir>/checkpoints, or any folder or fsspec URL given "
        "with --root.",
    )
    p.add_argument("action", choices=("list", "verify", "show"), help="what to do")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--job-dir",
                       help="the job's folder (default: the newest under ./undying-jobs)")
    where.add_argument("--root",
                       help="the checkpoint root itself: a folder, or a URL such as "
                       "s3://bucket/job")
    p.add_argument("--step", type=int,
                   help="only this step (verify, show; show defaults to the latest valid)")
    p.add_argument("--quick", action="store_true",
                   help="list: check sizes only, not checksums (no file reads)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="the job's token, whose key checks each checkpoint's MAC (default: env "
                   "UNDYING_TOKEN, else <job dir>/token); without one, MACs are not checked and "
                   "the listing says so")
    p.set_defaults(func=run)


def _key(args: argparse.Namespace) -> bytes | None:
    """The job's checkpoint key when its token can be found (then MACs are checked), else None."""
    job_dir: Path | None = None
    if args.root is None:
        with contextlib.suppress(UsageError):
            job_dir = Path(resolve_job_dir(args.job_dir).path)
    token = find_token(job_dir, args.token_file)
    return key_from_token(token) if token else None


def resolve_root(job_dir: str | None, root: str | None) -> Store:
    """The checkpoint root to read, or a UsageError naming the input that does not lead to one."""
    if root is not None:
        try:
            store = Store.open(root)
            present = store.isdir(store.root)
        except (CheckpointError, OSError, ValueError) as e:
            raise UsageError(f"checkpoint root {root} cannot be opened ({e})") from e
        if not present:
            raise UsageError(
                f"checkpoint root {root} does not exist; pass --root with the folder or URL "
                "holding step-* folders"
            )
        return store
    jd = resolve_job_dir(job_dir)
    path = Path(jd.path) / "checkpoints"
    if not path.is_dir():
        raise UsageError(
            f"job dir {jd.path} has no checkpoints folder ({path}): the job saved none yet, "
            "or its checkpoints are elsewhere (pass --root)"
        )
    return Store.open(path)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def checkpoint_row(c: Checkpoint, now: float) -> dict[str, Any]:
    m = c.manifest
    created = m.created_at if m else c.mtime
    return {
        "name": c.name,
        "step": c.step,
        "path": c.url,
        "kind": m.kind if m else None,
        "world_size": m.world_size if m else None,
        "layout": m.layout.get("kind") if m else None,
        "bytes": m.total_bytes if m else None,
        "valid": c.valid,
        "problems": list(c.problems),
        "created_at": created,
        "age_s": None if created is None else max(0.0, now - created),
    }


def _select(store: Store, step: int | None, *, checksums: bool) -> list[Checkpoint]:
    found = scan(store, checksums=checksums)
    if step is None:
        return found
    chosen = [c for c in found if c.step == step]
    if not chosen:
        steps = ", ".join(str(c.step) for c in found) or "none"
        raise UsageError(f"no checkpoint at step {step} under {store.url_of(store.root)} "
                         f"(steps: {steps})")
    return chosen


def _print_list(console: Console, where: str, rows: list[dict[str, Any]]) -> None:
    """The listing at any width (80 columns included): short cells in the table, a long root and
    each problem on lines of their own; paths and problems go in as text, never as console
    markup."""
    console.print(Text(f"checkpoints in {where}"))
    table = Table()
    for header in ("step", "kind", "world size", "layout", "size", "valid", "age"):
        table.add_column(header, overflow="fold")
    for r in rows:
        cells = (r["step"], r["kind"] or "-", r["world_size"] or "-", r["layout"] or "-",
                 _human(r["bytes"]), "yes" if r["valid"] else "no", _age(r["age_s"]))
        table.add_row(*(Text(str(c), style="red" if c == "no" else "") for c in cells))
    console.print(table)
    for r in rows:
        for problem in r["problems"]:
            console.print(Text(f"  step {r['step']} ({r['name']}): {problem}", style="red"))


def run(args: argparse.Namespace) -> int:
    store = resolve_root(args.job_dir, args.root)
    key = _key(args)
    with using_key(key):
        return _run(args, store, mac_checked=key is not None)


def _run(args: argparse.Namespace, store: Store, *, mac_checked: bool) -> int:
    out = sys.stdout
    now = time.time()
    where = store.url_of(store.root)
    if not mac_checked and not args.json:
        sys.stderr.write("note: no token found (--token-file, UNDYING_TOKEN or <job dir>/token): "
                         "checkpoint MACs are not checked, only sizes and checksums\n")
    if args.action == "list":
        rows = [checkpoint_row(c, now) for c in _select(store, args.step, checksums=not args.quick)]
        aside = batches(store)
        owner = live_owner(store)
        if args.json:
            rejected = [{"path": p, "checkpoints": n} for p, n in aside]
            out.write(json.dumps({"root": where, "mac_checked": mac_checked, "checkpoints": rows,
                                  "rejected": rejected, "owner": owner}) + "\n")
            return 0
        console = Console(file=out)
        if not rows:
            console.print(Text(f"no checkpoints under {where}"))
        else:
            _print_list(console, where, rows)
        if owner is not None:
            console.print(Text(f"in use by {owner}"))
        # What --start-fresh or a save set aside: kept whole, never touched by a job.
        for path, n in aside:
            console.print(Text(f"set aside: {n} rejected checkpoint(s) in {path} (`undying "
                               f"checkpoints list --root {path}`)"))
        return 0
    if args.action == "verify":
        found = _select(store, args.step, checksums=True)
        bad = [c for c in found if not c.valid]
        if args.json:
            rows = [{"path": c.url, "step": c.step, "valid": c.valid, "problems": c.problems}
                    for c in found]
            out.write(json.dumps({"root": where, "ok": bool(found) and not bad,
                                  "mac_checked": mac_checked, "checkpoints": rows}) + "\n")
        else:
            if not found:
                out.write(f"no checkpoints under {where}\n")
            for c in found:
                if c.valid:
                    out.write(f"ok      {c.url}\n")
                for problem in c.problems:
                    out.write(f"INVALID {c.url}: {problem}\n")
            if bad:
                out.write(f"{len(bad)} of {len(found)} checkpoints invalid\n")
        return 1 if bad or not found else 0
    # show
    found = _select(store, args.step, checksums=True)
    if args.step is None:
        good = [c for c in found if c.valid]
        if not good:
            raise UsageError(f"no valid checkpoint under {where}; `undying checkpoints verify` "
                             "says why")
        found = good[-1:]
    c = found[0]
    if args.json:
        manifest = c.manifest.to_dict() if c.manifest else None
        shown = {"path": c.url, "valid": c.valid, "problems": c.problems, "manifest": manifest}
        out.write(json.dumps(shown) + "\n")
    else:
        out.write(f"{c.url}: {'valid' if c.valid else 'INVALID'}\n")
        for problem in c.problems:
            out.write(f"  {problem}\n")
        if c.manifest is not None:
            out.write(c.manifest.to_json())
    return 0 if c.valid else 1

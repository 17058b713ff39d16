"""Discovery and retention: which checkpoints under a root can be trusted, which may go.

Discovery never trusts a folder name: a checkpoint is valid only when its
manifest parses, carries the job's MAC where this process holds the job's key
(``checkpoint.mac``), and every listed file exists with the listed size and
checksum. A ``step-*`` folder without a manifest is a commit that did not
finish (``commit``) and is skipped as partial. Retention (``prune``) only ever
deletes names this package writes (``step-*`` and ``.tmp-step-*``), never
the checkpoint ``latest_valid`` would return, and never a checkpoint this
process's key did not sign (``Checkpoint.owned``: another job's stays whole),
so pointing ``--root`` at the wrong folder cannot destroy data.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from undying.checkpoint.mac import current_key, mac_problem, signed_by_us
from undying.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    checksum_stream,
    parse_step_dirname,
)
from undying.checkpoint.store import TMP_PREFIX, Store

__all__ = ["Checkpoint", "Latest", "inspect", "scan", "verify", "latest_valid", "prune"]

log = logging.getLogger("undying.checkpoint")


@dataclass
class Checkpoint:
    """One ``step-*`` folder as found on storage, with what is wrong with it (if anything)."""

    name: str
    step: int
    path: str
    url: str
    manifest: Manifest | None
    problems: list[str] = field(default_factory=list)
    mtime: float | None = None
    # This process may replace or delete it: its own key signed the manifest (``mac.signed_by_us``),
    # or it has no manifest at all (a write that never committed). Another job's, a stranger's or an
    # unreadable one is never overwritten nor pruned: at most set aside (``aside``).
    owned: bool = False

    @property
    def valid(self) -> bool:
        return self.manifest is not None and not self.problems

    @property
    def kind(self) -> str | None:
        return self.manifest.kind if self.manifest else None

    @property
    def size(self) -> int | None:
        return self.manifest.total_bytes if self.manifest else None


class Latest(NamedTuple):
    """What ``latest_valid`` found: the checkpoint (or None) and every newer one it skipped, with
    why."""

    checkpoint: Checkpoint | None
    skipped: list[tuple[str, str]]


def inspect(store: Store, name: str, *, checksums: bool) -> Checkpoint:
    """The checkpoint folder ``name`` under ``store`` as found, with every problem (file checksums
    optional)."""
    folder = store.join(name)
    step = parse_step_dirname(name)
    assert step is not None, name
    ckpt = Checkpoint(name, step, folder, store.url_of(folder), None, mtime=store.mtime(folder))
    manifest_path = store.join(name, MANIFEST_NAME)
    try:
        raw = store.read_bytes(manifest_path)
    except FileNotFoundError:
        ckpt.problems.append(f"no {MANIFEST_NAME}: a partial checkpoint (the write did not finish)")
        ckpt.owned = True
        return ckpt
    except OSError as e:
        ckpt.problems.append(f"{MANIFEST_NAME} cannot be read ({e})")
        return ckpt
    try:
        manifest = Manifest.from_json(raw)
    except ManifestError as e:
        ckpt.problems.append(f"{MANIFEST_NAME} is corrupt: {e}")
        return ckpt
    ckpt.manifest = manifest
    body = json.loads(raw)
    ckpt.owned = signed_by_us(body)
    key = current_key()
    if key is not None:
        # Before any file is trusted (or read): a checkpoint the job did not sign is not the job's.
        problem = mac_problem(body, key)
        if problem is not None:
            ckpt.problems.append(problem)
            return ckpt
    if manifest.step != step:
        ckpt.problems.append(f"{MANIFEST_NAME} says step {manifest.step}, the folder is {name}")
    for entry in manifest.files:
        ckpt.problems.extend(_check_file(store, folder, entry, checksums=checksums))
    return ckpt


def _check_file(store: Store, folder: str, entry: FileEntry, *, checksums: bool) -> list[str]:
    path = store.join(folder, *entry.path.split("/"))
    try:
        size = store.size(path)
    except (FileNotFoundError, OSError):
        return [f"file {entry.path} is missing"]
    if size != entry.size:
        return [f"file {entry.path} has size {size}, manifest says {entry.size}"]
    if not checksums:
        return []
    try:
        with store.open_read(path) as f:
            _, digest = checksum_stream(f, entry.algorithm)
    except OSError as e:
        return [f"file {entry.path} cannot be read ({e})"]
    if digest != entry.checksum:
        return [f"file {entry.path} has {entry.algorithm} {digest}, manifest says {entry.checksum}"]
    return []


def scan(root: str | os.PathLike[str] | Store, *, checksums: bool = True) -> list[Checkpoint]:
    """Every ``step-*`` folder under ``root``, oldest first, each checked (checksums optional)."""
    store = root if isinstance(root, Store) else Store.open(root)
    names = [n for n in store.names() if parse_step_dirname(n) is not None]
    names.sort(key=lambda n: parse_step_dirname(n) or 0)
    return [inspect(store, n, checksums=checksums) for n in names]


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Problems of the one checkpoint at ``path`` (a ``step-*`` folder or its URL); [] when
    valid."""
    text = os.fspath(path).rstrip("/")
    if "://" in text:
        parent, name = text.rsplit("/", 1)
    else:
        p = Path(text).absolute()
        parent, name = str(p.parent), p.name
    if parse_step_dirname(name) is None:
        return [f"{text} is not a checkpoint folder (its name must be step-NNNNNNNNN)"]
    store = Store.open(parent)
    if not store.isdir(store.join(name)):
        return [f"checkpoint {text} does not exist"]
    return inspect(store, name, checksums=True).problems


def latest_valid(
    root: str | os.PathLike[str] | Store,
    *,
    job_id: str | None = None,
    kinds: tuple[str, ...] | None = None,
) -> Latest:
    """The newest checkpoint that is whole and uncorrupted, and the newer ones skipped (name,
    reason).

    Checks newest first and stops at the first valid one, so only the files of
    the checkpoint it returns (and of broken newer ones) are read. ``job_id``
    skips checkpoints of another job; ``kinds`` restricts to periodic or
    dying-gasp. Every skip is also logged at WARNING.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    names = [n for n in store.names() if parse_step_dirname(n) is not None]
    names.sort(key=lambda n: parse_step_dirname(n) or 0, reverse=True)
    skipped: list[tuple[str, str]] = []
    for name in names:
        ckpt = inspect(store, name, checksums=True)
        reason = "; ".join(ckpt.problems)
        if not reason and ckpt.manifest is not None:
            if job_id is not None and ckpt.manifest.job_id != job_id:
                reason = f"belongs to job {ckpt.manifest.job_id!r}, not {job_id!r}"
            elif kinds is not None and ckpt.manifest.kind not in kinds:
                continue  # not a problem, just not asked for
        if reason:
            log.warning("skipped checkpoint %s: %s", store.url_of(ckpt.path), reason)
            skipped.append((name, reason))
            continue
        return Latest(ckpt, skipped)
    return Latest(None, skipped)


def prune(
    root: str | os.PathLike[str] | Store,
    keep: int,
    *,
    tmp_max_age_s: float = 3600.0,
    now: float | None = None,
) -> list[str]:
    """Delete all but the ``keep`` newest valid checkpoints and leftover temp folders; the names
    removed.

    Validity here is manifest + file sizes, plus checksums of the newest
    checkpoints until one passes: the latest valid checkpoint (as
    ``latest_valid`` sees it) is always kept, even beyond ``keep``. Broken ``step-*`` folders older
    than the oldest kept checkpoint go too: they can never be the latest valid
    one. Newer broken folders stay for inspection (or are a commit in progress).
    A ``.tmp-step-*`` folder is a leftover when a newer-or-equal step has been
    committed since it was last touched (only one write per root is in flight),
    or when it has not been touched for ``tmp_max_age_s``. Nothing else under
    the root is ever touched, and no checkpoint this process did not sign
    (``Checkpoint.owned``): another job's stays whole, counts for nothing.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    store = root if isinstance(root, Store) else Store.open(root)
    now = time.time() if now is None else now
    found = scan(store, checksums=False)
    valid = [c for c in found if c.valid and c.owned]
    kept = valid[-keep:]
    # Sizes can match while a byte flipped: never let retention delete the checkpoint that
    # latest_valid would return. Checksum the kept ones newest first (normally the one just
    # written passes at once) and keep the newest that passes even when it is older than N.
    for c in reversed(valid):
        if inspect(store, c.name, checksums=True).valid:
            if c not in kept:
                log.warning("keeping %s beyond keep=%d: every newer checkpoint fails its checksums",
                            c.name, keep)
                kept = [c, *kept]
            break
    kept_names = {c.name for c in kept}
    removed: list[str] = []
    oldest_kept = min((c.step for c in kept), default=None)
    for c in found:
        if c.name in kept_names or not c.owned:
            # (another job's, a stranger's or an unreadable checkpoint is never this job's to
            # delete)
            continue
        if c.valid or (oldest_kept is not None and c.step < oldest_kept):
            store.remove(c.path)
            removed.append(c.name)
    newest = valid[-1] if valid else None
    for name in store.names():
        if not name.startswith(TMP_PREFIX):
            continue
        path = store.join(name)
        mtime = store.mtime(path)
        if mtime is None:
            continue
        digits = name[len(TMP_PREFIX) :].split("-", 1)[0]
        step = int(digits) if digits.isdigit() else None
        superseded = (
            newest is not None
            and newest.manifest is not None
            and step is not None
            and step <= newest.step
            and mtime < newest.manifest.created_at
        )
        if superseded or now - mtime > tmp_max_age_s:
            store.remove(path)
            removed.append(name)
    for name in removed:
        log.info("pruned %s", store.url_of(store.join(name)))
    return removed


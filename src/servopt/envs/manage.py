"""The environments made so far: listed (``servopt envs``) and pruned."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path

from servopt.envs.create import _locked, _read_ready, _remove, _size_mb
from servopt.envs.inside import servopt_src
from servopt.envs.spec import STALE_TMP_S, EnvInfo, EnvSpec, _lock_path, _parse_folder, envs_root
from servopt.errors import UserError

# ----------------------------------------------------------------------------------------------- listing, pruning


def list_envs(declared: Mapping[str, EnvSpec] | None = None, *, home: Path | None = None) -> list[EnvInfo]:
    """Every env folder with its size now; ``declared`` (runtime name → its spec) fills in which runtimes use each.

    An env no declared runtime uses any more (its spec changed) has an empty ``used_by``: ``prune`` can take it."""
    root = envs_root(home)
    if not root.is_dir():
        return []
    keys = {rt: (spec.name, spec.key()) for rt, spec in (declared or {}).items()}
    infos = []
    for entry in sorted(root.iterdir()):
        parsed = _parse_folder(entry.name)
        if parsed is None:
            continue
        name, key, is_tmp = parsed
        if is_tmp:
            with _locked(_lock_path(root, f"{name}-{key}"), blocking=False) as free:
                state = "incomplete" if free else "building"
            ready = None
        else:
            ready = _read_ready(entry)
            state = "ready" if ready else "incomplete"
        infos.append(EnvInfo(name=name, key=key, folder=entry, state=state, size_mb=_size_mb(entry), env=ready,
                             used_by=sorted(rt for rt, nk in keys.items() if nk == (name, key) and not is_tmp)))
    return infos


def prune(keep: set[str] | None = None, *, home: Path | None = None) -> list[Path]:
    """Remove every env (``keep=None``) or every env whose key is not in ``keep``; returns the folders removed.

    Also removes incomplete envs (even kept ones: they are never used), abandoned ``.tmp`` creations and stale copies
    of servopt's source. An env being created right now (its lock held) is left alone, as is its ``.tmp`` folder: the
    lock tells a live creation from an abandoned one, where an age would guess (the age rule, an hour, is kept only
    for ``.tmp`` folders whose name does not say which env they belong to)."""
    root = envs_root(home)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    current_src = None
    with contextlib.suppress(OSError, UserError):
        current_src = servopt_src(home) if keep is not None else None
    for entry in sorted(root.iterdir()):
        if entry.name == ".locks" or entry == current_src:
            continue
        parsed = _parse_folder(entry.name)
        if parsed is None:
            stale = time.time() - entry.lstat().st_mtime > STALE_TMP_S
            if entry.name.startswith(".servopt-src-") or (entry.name.startswith(".tmp-") and stale):
                _remove(entry)
                removed.append(entry)
            continue
        name, key, is_tmp = parsed
        if not is_tmp and keep is not None and key in keep and _read_ready(entry) is not None:
            continue
        lock = _lock_path(root, f"{name}-{key}")
        with _locked(lock, blocking=False) as free:
            if not free:
                continue  # being created right now
            _remove(entry)
            removed.append(entry)
            if not is_tmp:
                lock.unlink(missing_ok=True)  # safe while held: a waiter re-checks the file after locking
    return removed

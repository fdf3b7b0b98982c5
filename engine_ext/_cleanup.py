"""Runtime-dir ownership: who owns an instance's dir, and sweeping dirs of dead owners.

Every instance writes ``.owner`` (its pid and the process start time from
``/proc/<pid>/stat``) into its runtime dir when it starts, and removes it on
close. A dir whose owner is gone -- the process does not exist, or the pid was
reused by a process that started at another time -- was left by a crash or a
``kill -9``: :func:`sweep_stale_runtime_dirs` removes it at the next start of
any instance, but only the files an instance creates there, by exact name
(the sockets ``control.sock`` and ``r.sock``, ``.owner`` and its temporary
``.owner.<pid>.tmp``);
a dir without ``.owner``, with a live owner, owned by another user, or holding
anything else (another program's socket, a file named ``.owner-notes``) is
left alone, with everything in it.

Threads: any; these are plain filesystem calls.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

__all__ = [
    "OWNER_FILE",
    "RANK_SOCKET_FILE",
    "SOCKET_FILE",
    "clear_owner",
    "owner_alive",
    "sweep_stale_runtime_dirs",
    "write_owner",
]

_log = logging.getLogger("engine_ext.cleanup")

OWNER_FILE = ".owner"
SOCKET_FILE = "control.sock"  # the instance's control socket
RANK_SOCKET_FILE = "r.sock"  # the rank channel's listening socket (``.ranks-*`` dirs)
_SOCKETS = frozenset({SOCKET_FILE, RANK_SOCKET_FILE})
_OWNER_TMP = re.compile(r"^\.owner\.\d+\.tmp$")  # write_owner's temporary file


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = data.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def write_owner(runtime_dir: Path, pid: int | None = None) -> None:
    """Record this process (or ``pid``) as the owner of ``runtime_dir`` (atomic replace)."""
    pid = os.getpid() if pid is None else pid
    started = _start_time(pid)
    tmp = runtime_dir / f"{OWNER_FILE}.{pid}.tmp"
    tmp.write_text(f"{pid} {started}\n", encoding="ascii")
    os.chmod(tmp, 0o600)
    os.replace(tmp, runtime_dir / OWNER_FILE)


def clear_owner(runtime_dir: Path) -> None:
    """Remove the owner record if this process wrote it."""
    path = runtime_dir / OWNER_FILE
    try:
        pid = int(path.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return
    if pid == os.getpid():
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def owner_alive(runtime_dir: Path) -> bool | None:
    """True/False whether the recorded owner lives; None if there is no readable record."""
    try:
        pid_s, started = (runtime_dir / OWNER_FILE).read_text(encoding="ascii").split()[:2]
        pid = int(pid_s)
    except (OSError, ValueError):
        return None
    now = _start_time(pid)
    return now is not None and (started == "None" or now == started)


def sweep_stale_runtime_dirs(root: Path, *, keep: str | None = None) -> list[Path]:
    """Remove instance dirs under ``root`` whose owner is dead; returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if entry.name == keep or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if owner_alive(path) is not False:
            continue  # alive, or not ours to judge
        if _remove_instance_dir(path):
            removed.append(path)
    return removed


def _ours(name: str, mode: int) -> bool:
    """Whether an entry of an instance dir is one this project creates (exact names)."""
    if name in _SOCKETS:
        return stat.S_ISSOCK(mode)
    return stat.S_ISREG(mode) and (name == OWNER_FILE or _OWNER_TMP.match(name) is not None)


def _remove_instance_dir(path: Path) -> bool:
    try:
        children = list(os.scandir(path))
        modes = [c.stat(follow_symlinks=False).st_mode for c in children]
    except OSError:
        return False
    foreign = [c.name for c, m in zip(children, modes, strict=True) if not _ours(c.name, m)]
    if foreign:
        _log.warning("left the stale runtime dir %s in place: it holds files kvsidecar did "
                     "not create (%s)", path, ", ".join(sorted(foreign)[:5]))
        return False
    for child in children:
        try:
            os.unlink(child.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("could not remove %s from a stale runtime dir: %s", child.path, exc)
            return False
    try:
        path.rmdir()
    except OSError as exc:
        _log.warning("left the stale runtime dir %s (owner gone) in place: %s", path, exc)
        return False
    _log.info("removed the stale runtime dir %s (its owner is gone)", path)
    return True

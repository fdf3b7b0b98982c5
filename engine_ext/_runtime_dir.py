"""The runtime directory of an instance (or of a rank group): one owner for its life.

:class:`RuntimeDir` creates the dir with safe modes, records its owner, sweeps the dirs of
dead owners next to it, and removes it -- in order at close, or in a few syscalls from a
signal handler. :class:`ElasticInstance` (``control.sock``) and
:meth:`RankGroup.spawn_private` (``r.sock``, short-lived ``.ranks-*`` dirs) use it; the
socket file itself belongs to whoever binds it (:class:`ControlServer`, the rank group),
which removes it first when it stops.

Every dir holds ``.owner`` (the pid and the process start time from ``/proc/<pid>/stat``)
while its process runs. A dir whose owner is gone -- the process does not exist, or the
pid was reused by a process that started at another time -- was left by a crash or a
``kill -9``: :func:`sweep_stale_runtime_dirs` removes it at the next start of any
instance, but only the files an instance creates there, by exact name (the sockets
``control.sock`` and ``r.sock``, ``.owner`` and its temporary ``.owner.<pid>.tmp``);
a dir without ``.owner``, with a live owner, owned by another user, or holding anything
else (another program's socket, a file named ``.owner-notes``) is left alone, with
everything in it.

Threads: any; these are plain filesystem calls (signal handlers: the main thread).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import signal
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from ._errors import EngineExtConfigError

__all__ = [
    "OWNER_FILE",
    "RANK_SOCKET_FILE",
    "SOCKET_FILE",
    "RuntimeDir",
    "clear_owner",
    "owner_alive",
    "sweep_stale_runtime_dirs",
    "write_owner",
]

_log = logging.getLogger("engine_ext.runtime_dir")

OWNER_FILE = ".owner"
SOCKET_FILE = "control.sock"  # the instance's control socket
RANK_SOCKET_FILE = "r.sock"  # the rank channel's listening socket (``.ranks-*`` dirs)
_SOCKETS = frozenset({SOCKET_FILE, RANK_SOCKET_FILE})
_OWNER_TMP = re.compile(r"^\.owner\.\d+\.tmp$")  # write_owner's temporary file
_LOCK_WAIT_S = 2.0  # how long a start waits for a neighbour's sweep to let go of its dir


def _try_lock(path: Path) -> int | None:
    """Open the dir ``path`` and take its ``flock`` without waiting: the fd that holds the
    lock, or None if another open of it holds the lock or the dir is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    if not _still_at(fd, path):  # removed (or replaced) between the open and the lock
        os.close(fd)
        return None
    return fd


def _still_at(fd: int, path: Path) -> bool:
    """Whether the dir open at ``fd`` is still the one at ``path``."""
    try:
        there = os.lstat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


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


def write_owner(runtime_dir: Path, pid: int | None = None, token: str = "-") -> None:
    """Record this process (or ``pid``) as the owner of ``runtime_dir`` (atomic replace).

    ``token`` tells two owners in one process apart (each :class:`RuntimeDir` has its own),
    so one that failed to start never removes the record of the one that runs."""
    pid = os.getpid() if pid is None else pid
    started = _start_time(pid)
    tmp = runtime_dir / f"{OWNER_FILE}.{pid}.tmp"
    tmp.write_text(f"{pid} {started} {token}\n", encoding="ascii")
    os.chmod(tmp, 0o600)
    os.replace(tmp, runtime_dir / OWNER_FILE)


def _owner_record(runtime_dir: Path) -> tuple[int, str] | None:
    """(pid, token) of the recorded owner; None if there is no readable record."""
    try:
        fields = (runtime_dir / OWNER_FILE).read_text(encoding="ascii").split()
        return int(fields[0]), fields[2] if len(fields) > 2 else "-"
    except (OSError, ValueError, IndexError):
        return None


def clear_owner(runtime_dir: Path, token: str | None = None) -> None:
    """Remove the owner record if this process wrote it (with ``token``, if one is given)."""
    record = _owner_record(runtime_dir)
    if record is None or record[0] != os.getpid() or (token is not None and record[1] != token):
        return
    try:
        (runtime_dir / OWNER_FILE).unlink()
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
        # Judged again under the dir's lock, which its owner holds for its whole life: a
        # start that takes the id over in this moment holds the lock before it writes its
        # record, so its files are never taken for a dead owner's.
        fd = _try_lock(path)
        if fd is None:
            continue  # a live owner, a start in progress, or another sweep
        try:
            if owner_alive(path) is False and _remove_instance_dir(path):
                removed.append(path)
        finally:
            os.close(fd)
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
        _log.warning(
            "left the stale runtime dir %s in place: it holds files kvsidecar did not create (%s)",
            path,
            ", ".join(sorted(foreign)[:5]),
        )
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


_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class RuntimeDir:
    """One private runtime directory of this process, from creation to removal.

    Owns the dir (mode 0700, under a root that others cannot write), its ``.owner``
    record, and the removal of both. Files others bind in it (the control socket, the
    rank socket) are theirs to remove; :meth:`remove_now` removes the sockets too, for
    a process that is being killed. Invariant: it never removes a file it did not
    create by name, nor a dir another live process owns.

    Threads: :meth:`create`, :meth:`remove` and :meth:`sweep_siblings` from the thread
    that owns the instance; :meth:`remove_now` from any (it takes no lock);
    :meth:`remove_on_signals` from the main thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._token = secrets.token_hex(8)  # this object's mark in ``.owner``
        self._lock_fd: int | None = None  # holds the dir's flock from create() to removal

    def file(self, name: str) -> Path:
        """A file in the dir (``SOCKET_FILE``, ``RANK_SOCKET_FILE``)."""
        return self.path / name

    def create(self) -> RuntimeDir:
        """Create the dir (and the root) privately and record this process as its owner.

        A dir a live owner holds (another engine with this instance id, in another
        process or this one) is refused and left as it is: taking over its record would
        let this one's cleanup, or a neighbour's sweep after a crash, remove the live
        engine's socket.

        The dir's ``flock`` is held from here until :meth:`remove`: a neighbour's sweep
        judges a dir only under that lock, so it never removes what this start creates."""
        if self._lock_fd is not None:  # created before: hold on, or start over if gone
            if _still_at(self._lock_fd, self.path):
                write_owner(self.path, token=self._token)
                return self
            self._unlock()
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                _make_private_dir(self.path)
            except (EngineExtConfigError, FileNotFoundError) as exc:
                # a sweep removed the dir between our mkdir and its check: make it again
                gone = isinstance(exc, FileNotFoundError) or isinstance(
                    exc.__cause__, FileNotFoundError
                )
                if not gone or time.monotonic() > deadline:
                    raise
                continue
            fd = _try_lock(self.path)
            if fd is not None:
                break
            self._refuse_a_live_owner()  # the lock is a live engine's: say so at once
            if time.monotonic() > deadline:
                raise EngineExtConfigError(
                    f"another process holds the runtime dir {self.path} locked (an engine "
                    "with this instance id, or a process it forked); stop it, or give this "
                    "instance its own KVSIDECAR_INSTANCE_ID"
                )
            time.sleep(0.01)  # a neighbour's sweep holds it for a few syscalls
        try:
            self._refuse_a_live_owner()
            write_owner(self.path, token=self._token)  # tells a later start this from a crash's
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        return self

    def _refuse_a_live_owner(self) -> None:
        record = _owner_record(self.path)
        if (
            record is not None
            and record[1] != self._token
            and owner_alive(self.path)
            and not (record[0] == os.getpid() and record[1] == "-")
        ):
            raise EngineExtConfigError(
                f"another engine (pid {record[0]}) already owns the runtime dir {self.path}; "
                "give this instance its own KVSIDECAR_INSTANCE_ID (or stop the other engine)"
            )

    @classmethod
    def create_unique(cls, root: Path, prefix: str) -> RuntimeDir:
        """A fresh dir ``root/<prefix><random>`` (mode 0700), owned by this process."""
        _make_private_root(root)
        try:
            path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        except OSError as exc:
            raise EngineExtConfigError(
                f"cannot create a runtime dir under {root}: {exc}; set KVSIDECAR_RUNTIME_DIR"
            ) from exc
        made = cls(path)
        made._lock_fd = _try_lock(path)  # fresh and private: nobody else can hold it
        write_owner(path, token=made._token)
        return made

    def sweep_siblings(self) -> list[Path]:
        """Remove the dirs next to this one whose owner is dead (see the module doc)."""
        return sweep_stale_runtime_dirs(self.path.parent, keep=self.path.name)

    def remove(self) -> None:
        """Close: drop the owner record (if this process wrote it) and the dir, once the
        socket owners removed their files. Anything else left in it keeps it (logged)."""
        clear_owner(self.path, self._token)
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("left %s in place: %s", self.path, exc)
        finally:
            self._unlock()

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def remove_now(self) -> None:
        """For a process about to be killed: the sockets, the owner record and the dir,
        each with one syscall or two, errors ignored, no lock and no logging (safe in a
        signal handler, whatever the interrupted code holds). Only in a dir this object
        owns: the sockets of another engine that holds the dir stay."""
        if _owner_record(self.path) != (os.getpid(), self._token):
            with contextlib.suppress(OSError):
                os.rmdir(self.path)  # only if empty: a dir this process made but never owned
            self._unlock()
            return
        for name in _SOCKETS:
            with contextlib.suppress(OSError):
                os.unlink(self.path / name)
        with contextlib.suppress(OSError):
            clear_owner(self.path, self._token)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)
        self._unlock()

    def remove_on_signals(self, then: Callable[[], None] | None = None) -> None:
        """Main thread: on SIGINT/SIGTERM run :meth:`remove_now` first (vLLM SIGKILLs its
        EngineCore right after SIGTERM, so an orderly close may not get to run), then
        ``then`` (the orderly close), then what the previous handler did (a default
        handler: the process dies of the signal; an ignored signal: nothing more).

        SIGHUP too where it would end the process (its default: a terminal that closes
        under ``vllm serve`` ended the engine with its socket and dir left behind); a
        hangup the process ignores (``nohup``) or handles itself is left as it is."""
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(signum)
            if signum == signal.SIGHUP and previous != signal.SIG_DFL:
                continue
            signal.signal(signum, _chained(self.remove_now, then, signum, previous))


def _chained(
    first: Callable[[], None], then: Callable[[], None] | None, signum: int, previous: _Handler
) -> Callable[[int, FrameType | None], None]:
    owner = os.getpid()

    def handler(sig: int, frame: FrameType | None) -> None:
        if os.getpid() == owner:  # not in a forked process: the dir is the parent's
            first()
            if then is not None:
                then()
        if callable(previous):
            previous(sig, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return handler


def _make_private_root(root: Path) -> None:
    """Create ``root`` (mode 0700) or check it; an existing root that others may write to is
    tightened (group and world write removed): anyone who can write there could replace an
    instance's dir."""
    info = _private_dir(root)
    if info.st_mode & 0o022:
        tightened = stat.S_IMODE(info.st_mode) & ~0o022
        _log.warning(
            "the runtime root %s was writable by others (mode %o); tightened to %o",
            root,
            stat.S_IMODE(info.st_mode),
            tightened,
        )
        try:
            os.chmod(root, tightened)
        except OSError as exc:
            raise EngineExtConfigError(
                f"the runtime root {root} is writable by others and cannot be "
                f"tightened ({exc}); set KVSIDECAR_RUNTIME_DIR to a private directory"
            ) from exc


def _make_private_dir(path: Path) -> None:
    """Create ``path`` (and its root) with mode 0700; refuse a dir owned by someone else."""
    _make_private_root(path.parent)
    _private_dir(path)
    os.chmod(path, 0o700)


def _private_dir(directory: Path) -> os.stat_result:
    """Create ``directory`` (mode 0700) if missing; it must be a dir owned by this user."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise EngineExtConfigError(
            f"cannot create the runtime dir {directory}: {exc}; set KVSIDECAR_RUNTIME_DIR"
        ) from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise EngineExtConfigError(
            f"{directory} is not a directory owned by this user; set KVSIDECAR_RUNTIME_DIR "
            "to a private directory"
        )
    return info

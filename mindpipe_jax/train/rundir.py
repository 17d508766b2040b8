"""The run directory (``train.out_dir``): refused early when it cannot be written,
and locked for the run's life so that two runs never write into one.

``check_writable`` reads only: it runs before anything is computed and names what
is wrong (a parent that is a file, a read-only filesystem, no permission).

``RunDirLock`` is an exclusive ``flock(2)`` lock on ``<out_dir>/mindpipe.lock``, a
file that also records the holder (pid, host, start time). The kernel drops the
lock when its process ends, however it ends (SIGKILL included), so a lock file
left behind by a dead run is not a lock: the next run takes it over and says so in
one line. A second run while the first is alive is refused, naming the holder.
On a filesystem without ``flock`` the record decides: a live process of this
host holds it; a record from another host cannot be checked and is refused.
Releasing removes the lock file; a run that fails before it writes anything
also removes the directories the lock had to create, so nothing is left, and a run
stopped at once by Ctrl-C before its first checkpoint removes the directory it
created with what it had begun writing there (``config.json``, empty logs).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from mindpipe_jax.atomic_write import unwritable_reason
from mindpipe_jax.errors import ConfigError

LOCK_NAME = "mindpipe.lock"


def check_writable(out_dir: str | Path, key: str = "train.out_dir") -> Path:
    """``out_dir`` as an absolute path if it is, or can be created as, a directory this
    process can write; ``ConfigError`` (one line) otherwise. Writes nothing."""
    out_dir = Path(out_dir).absolute()
    try:
        exists = out_dir.exists()
    except OSError as err:  # a name too long, a parent this user cannot search (API callers too)
        raise ConfigError(f"{key} {str(out_dir)!r} cannot be used: {(err.strerror or str(err)).lower()}; "
                          f"choose another {key}") from None
    if exists and not out_dir.is_dir():
        raise ConfigError(f"{key} {str(out_dir)!r} exists and is not a directory")
    probe = out_dir
    while not os.path.lexists(probe) or (probe.is_symlink() and not probe.exists()):
        if probe.is_symlink():
            raise ConfigError(f"{key} {str(out_dir)!r} cannot be created: {str(probe)!r} is a "
                              f"broken symbolic link")
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key} {str(out_dir)!r} cannot be created: {str(probe)!r} is a file, "
                          f"not a directory")
    targets = [probe] + [p for p in (out_dir / "checkpoints",) if p.is_dir()]
    for target in targets:
        why = unwritable_reason(target)
        if why is None:
            continue
        if target == out_dir:
            where = f"{key} {str(out_dir)!r} {why}"
        elif target == probe:
            where = f"{key} {str(out_dir)!r} cannot be created: {str(probe)!r} {why}"
        else:
            where = f"{key} {str(out_dir)!r} cannot be written: {str(target)!r} {why}"
        raise ConfigError(f"{where}; choose another {key}")
    return out_dir


def _describe(record: dict) -> str:
    pid, host = record.get("pid", "?"), record.get("host", "?")
    started = record.get("started")
    since = (f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}"
             if isinstance(started, (int, float)) else "")
    return f"pid {pid} on host {host}{since}"


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


class RunDirLock:
    """Exclusive lock on a run directory, held from ``acquire`` to ``release`` (or the
    ``with`` block). ``say`` receives the one-line notice of a stale lock taken over."""

    def __init__(self, out_dir: str | Path, *, say=None):
        self.out_dir = Path(out_dir).absolute()
        self.path = self.out_dir / LOCK_NAME
        self.say = say or (lambda line: print(f"mindpipe: {line}", file=sys.stderr, flush=True))
        self._fd: int | None = None
        self._created: list[Path] = []  # directories acquire made, outermost first
        self.took_over: dict | None = None  # the record of a dead holder, when one was taken over
        # An existing out_dir without a lock file: its entries and (atime, mtime) before
        # the lock file, so a run that fails having written nothing leaves it as it was.
        self._before: tuple[list[str], tuple[int, int]] | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(remove_created=exc_type is not None)

    def acquire(self) -> None:
        missing = []
        probe = self.out_dir
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        try:
            for directory in reversed(missing):
                try:
                    directory.mkdir()
                    self._created.append(directory)
                except FileExistsError:
                    pass
            if not missing and not os.path.lexists(self.path):
                st = self.out_dir.stat()
                self._before = (sorted(os.listdir(self.out_dir)), (st.st_atime_ns, st.st_mtime_ns))
            self._lock()
        except OSError as err:  # the disk filled up, the filesystem turned read-only...
            self._remove_created()
            why = os.strerror(err.errno) if err.errno else str(err)
            raise ConfigError(f"train.out_dir {str(self.out_dir)!r}: cannot create the run lock "
                              f"{str(self.path)!r} ({why})") from None
        except BaseException:
            self._remove_created()
            raise

    def _lock(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                self._remove_created()
                raise ConfigError(self._in_use(holder)) from None
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    os.close(fd)
                    raise
                holder = self._read(fd)  # no flock here: the record decides
                if holder and (holder.get("host") != socket.gethostname() or _pid_alive(holder.get("pid"))):
                    os.close(fd)
                    self._remove_created()
                    raise ConfigError(self._in_use(holder, checked=False)) from None
            # The previous holder may have removed the file between our open and flock:
            # then we hold a lock on a name no longer there, and must try again.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = self._read(fd)
        if previous:
            self.took_over = previous
            self.say(f"taking over the lock of a run that is no longer running ({_describe(previous)}) "
                     f"in {self.out_dir}")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _in_use(self, holder: dict, checked: bool = True) -> str:
        who = _describe(holder) if holder else "a process whose record is not written yet"
        how = ("" if checked else
               f" (this filesystem has no flock: delete {str(self.path)!r} if that run is gone)")
        return (f"train.out_dir {str(self.out_dir)!r} is in use by another run ({who}){how}; wait for it "
                f"to finish, or choose another train.out_dir")

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            record = json.loads(raw) if raw else {}
        except (OSError, ValueError):
            return {"pid": "?", "host": "?"}
        return record if isinstance(record, dict) else {"pid": "?", "host": "?"}

    def release(self, *, remove_created: bool = False, interrupted: bool = False) -> None:
        """Drop the lock and remove its file; ``remove_created`` also removes the
        directories ``acquire`` made, where they are still empty. ``interrupted`` (a run
        stopped by Ctrl-C at once): a directory this run created and that holds no
        committed checkpoint goes with everything the run had written into it."""
        if self._fd is None:
            return
        if interrupted and self.out_dir in self._created:
            from mindpipe_jax.train.checkpoint import committed_steps

            if not committed_steps(self.out_dir / "checkpoints"):
                shutil.rmtree(self.out_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
        if remove_created:
            self._remove_created()
            with contextlib.suppress(OSError):  # nothing else written: the lock file's traces go too
                if self._before is not None and sorted(os.listdir(self.out_dir)) == self._before[0]:
                    os.utime(self.out_dir, ns=self._before[1])

    def _remove_created(self) -> None:
        for directory in reversed(self._created):
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if empty
        self._created = []


@contextlib.contextmanager
def hold_run_dir(out_dir: str | Path, *, say=None):
    """``check_writable`` on every process, then ``RunDirLock`` on process 0 for the
    ``with`` block; in a multi-process run the processes agree on the outcome, so all
    of them stop (exit 2) when any cannot use the directory or process 0 cannot take the
    lock. An exception inside the block releases the lock and removes the directories it
    created (if still empty)."""
    import jax

    from mindpipe_jax.train.agreement import all_or_none

    lock = None
    try:
        with all_or_none("run"):
            out_dir = check_writable(out_dir)
            if jax.process_index() == 0:
                lock = RunDirLock(out_dir, say=say)
                lock.acquire()
    except BaseException:  # another process could not use the directory (a no-op where not held)
        if lock is not None:
            lock.release(remove_created=True)
        raise
    try:
        yield lock
    except BaseException as exc:
        if lock is not None:
            lock.release(remove_created=True, interrupted=isinstance(exc, KeyboardInterrupt))
        raise
    if lock is not None:
        lock.release()

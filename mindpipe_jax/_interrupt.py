"""Ctrl-C in the ``mindpipe`` command before it can catch ``KeyboardInterrupt``.

Importing the package (JAX, Flax, orbax) takes seconds, and a Ctrl-C then would
end the command with a Python traceback; so would one while the interpreter shuts
down. When this process is the command (``mindpipe ...`` or ``python -m
mindpipe_jax ...``; a program that imports the library is left alone), the package
imports this module first, and until ``cli.main`` takes over, Ctrl-C prints one
line and exits 130 at once: nothing has been written yet (or, at shutdown,
everything has).
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def is_command() -> bool:
    """Whether this process runs the ``mindpipe`` command."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] == "mindpipe_jax"
    return os.path.basename(sys.argv[0] if sys.argv else "") == "mindpipe"


def _exit_130(signum, frame) -> None:
    try:
        newline = "\n" if sys.stderr.isatty() else ""  # off the terminal's ^C line
        sys.stderr.write(f"{newline}mindpipe: interrupted\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(130)


def exit_on_interrupt() -> None:
    """From now on, Ctrl-C: one line on stderr, exit status 130, no clean-up."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_130)


def raise_on_interrupt() -> None:
    """While a command runs: Ctrl-C raises ``KeyboardInterrupt``, including one Python
    would swallow. Raised in a garbage-collector callback (JAX registers one), a
    ``__del__`` or a weakref callback, it was printed as "Exception ignored in ..."
    with a traceback and the command went on to the end, exit status 0. Such a report
    is dropped here and the signal sent again, to be raised where the command is."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = sys.unraisablehook

    def redeliver(info) -> None:
        if info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
            threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        previous(info)

    sys.unraisablehook = redeliver


def exit_now() -> None:
    """Exit 130 after flushing, skipping the interpreter's shutdown (which can crash in
    XLA's threads after an interrupted compile)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


if is_command():
    exit_on_interrupt()

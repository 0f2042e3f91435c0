"""Child processes that end with the command that started them, whatever the timing of a stop.

A command that does its work in a child process (the pack command's packer, the scaling runs of
`diagnose`) must decide how it ended from what it saw itself, never from the child's exit code:
a Ctrl-C reaches every process of the terminal's foreground group, and whether the child or the
command reacts first is a race. So `run_child` starts the child in a session of its own, which a
terminal's signals never reach; a stop signal (INT, TERM, HUP) reaches the command alone, which
ends the child's whole process group (the child and every process it started: TERM, then KILL
after a grace period) and raises `Stopped`; the command exits 128 + the signal's number after one
line. The child's stderr passes through the command until then, so what the dying processes
print (tracebacks, multiprocessing's leak warnings) never reaches the terminal.

On Linux a child dies with its command even when the command is killed outright (SIGKILL): the
kernel sends it SIGTERM (PR_SET_PDEATHSIG), and a child of this project that starts processes of
its own passes it to them with `end_group_on_term`.

Imports nothing heavy: a command installs `StopSignals` before anything slow happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_SECONDS = 10.0  # from TERM to KILL for a child's process group
POLL_SECONDS = 0.05
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Stopped(Exception):
    """A stop signal reached the command; it ends with `exit_code` after one line."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # a shell's status for a process ended by that signal


class StopSignals:
    """Remembers the first stop signal this process receives, instead of dying of it at a random
    point; `raise_if_stopped` turns it into `Stopped` where the command can act on it."""

    def __init__(self):
        self.signum: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def raise_if_stopped(self) -> None:
        if self.signum is not None:
            raise Stopped(self.signum)


def module_command(module: str, *args: str) -> tuple[list[str], dict]:
    """(command line, environment) that run `python -m module args` with this package importable
    however this process found it (installed, PYTHONPATH, or the current directory)."""
    source = str(Path(__file__).resolve().parents[2])  # the directory that holds the package
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    return [sys.executable, "-m", module, *args], env


def run_child(
    command: list[str], stop: StopSignals, env: dict | None = None, grace: float = GRACE_SECONDS, stdout=None
) -> int:
    """Run `command` in a session of its own and return its exit code; if `stop` catches a stop
    signal before the child has exited, end the child's process group and raise Stopped. Every
    process of the group has ended when this returns or raises (zombies aside)."""
    stop.raise_if_stopped()
    child = subprocess.Popen(
        command, env=env, stdout=stdout, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent
    )
    relay = StderrRelay(child.stderr)
    try:
        while child.poll() is None and stop.signum is None:
            time.sleep(POLL_SECONDS)
    finally:
        stopped = child.poll() is None
        if stopped:
            relay.mute()  # what the stopped processes print is not the user's business
        end_group(child, terminate=stopped, grace=grace)
        relay.join()
    if stopped:
        raise Stopped(stop.signum)
    return child.returncode


def end_group(child: subprocess.Popen, terminate: bool, grace: float) -> None:
    """Wait for every process of `child`'s group, after sending it TERM when `terminate`; KILL
    whatever is left after `grace` seconds."""
    if terminate:
        signal_group(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace)  # reaped: the group's leader is no longer counted below
    while group_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    signal_group(child.pid, signal.SIGKILL)
    child.wait()


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Zombies (ended, waiting for the init process
    to collect them, which some do only every second or so) do not count where /proc tells them."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]  # after "pid (command)"
        except (OSError, ValueError):
            continue  # ended meanwhile
        if int(group) == pgid and state != "Z":
            return True
    return False


class StderrRelay:
    """Copies a child's stderr to this process's as it comes (progress bars included), until muted."""

    def __init__(self, stream):
        self.stream, self.muted = stream, False
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def mute(self) -> None:
        self.muted = True

    def join(self) -> None:
        self.thread.join(timeout=GRACE_SECONDS)  # its end: every process of the group closed the pipe
        self.stream.close()

    def _copy(self) -> None:
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(self.stream.fileno(), 65536):
                if not self.muted and out is not None:
                    out.write(chunk)
                    out.flush()


def _die_with_parent() -> None:
    """In the child, before it starts: SIGTERM when the command that started it dies (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def end_group_on_term() -> None:
    """In a child started by run_child that starts processes of its own: a TERM (its command's
    stop, or its command's death) ends the whole group, not only this process."""

    def end_group_now(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(0, signal.SIGTERM)  # this process too, now that TERM is fatal again

    signal.signal(signal.SIGTERM, end_group_now)

"""processes.py: a command's child ends with it, and a stop is the command's to report, whatever
the timing. Tiny Python children (no torch): these run in a second."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PACKAGE, project_env

# the command: runs CHILD through run_child and reports a stop in one line, as pack does
COMMAND = f"""
import sys
from {PACKAGE}.base import processes
stop = processes.StopSignals()
try:
    code = processes.run_child([sys.executable, "-c", sys.argv[1]], stop)
except processes.Stopped as stopped:
    sys.stderr.write("stopped by " + str(stopped) + "\\n")
    sys.exit(stopped.exit_code)
sys.exit(code)
"""
# a child that starts a silent grandchild, then says it is ready and waits; a TERM ends both
CHILD = f"""
import subprocess, sys, time
from {PACKAGE}.base import processes
processes.end_group_on_term()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
time.sleep(60)
"""


def start(child: str, marker: str) -> subprocess.Popen:
    """The command in a process group of its own, as a terminal starts it."""
    return subprocess.Popen(
        [sys.executable, "-c", COMMAND, child],
        env=project_env(PROCESS_TEST=marker),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def alive(marker: str) -> list[int]:
    """The processes (zombies aside) whose environment holds the marker."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"PROCESS_TEST={marker}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def gone_within(marker: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(marker)


needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the process table in /proc")


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda sig: sig.name)
def test_a_stop_ends_the_child_and_all_it_started_and_the_command_reports_it_alone(sig):
    command = start(CHILD, marker=f"stop-{sig}")
    try:
        assert command.stdout.readline() == "ready\n"
        os.killpg(command.pid, sig)  # the terminal's group: the child, in a session of its own, is not in it
        _, stderr = command.communicate(timeout=30)
    finally:
        command.kill()
    assert command.returncode == 128 + sig and stderr == f"stopped by {signal.Signals(sig).name}\n"
    assert gone_within(f"stop-{sig}", 3)


@needs_proc
def test_a_command_killed_outright_takes_its_child_and_all_it_started_along():
    command = start(CHILD, marker="killed")
    try:
        assert command.stdout.readline() == "ready\n"
        os.killpg(command.pid, signal.SIGKILL)
        command.wait(timeout=30)
    finally:
        command.kill()
    assert gone_within("killed", 3)  # the grandchild is silent: only the kernel's word ends it


def test_a_child_that_fails_on_its_own_is_its_exit_code_with_its_output():
    failing = "import sys; sys.stderr.write('the reason\\n'); sys.exit(3)"
    result = subprocess.run(
        [sys.executable, "-c", COMMAND, failing], env=project_env(), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 3 and result.stderr == "the reason\n"

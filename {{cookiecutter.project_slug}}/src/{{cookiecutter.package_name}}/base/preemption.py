"""Preemption, end to end: how a stop request becomes a checkpoint and exit status 75.

    scheduler or user --TERM/INT/HUP/USR1--> node launcher (launch.Supervisor)
        --SIGUSR1--> every worker (PreemptionFlag) --> the loop agrees at its next check
        --> checkpoint --> report_preemption() --> the launcher exits 75 (130 on Ctrl-C)

SIGTERM keeps its default in the workers and ends a rank at once: torchrun sends it to the
survivors when a peer fails, and a rank that trapped it would run on until torchrun's SIGKILL
30 s later. torchrun itself ignores SIGUSR1 (SLURM hands it to every process of the step).
This module imports nothing heavy: the launcher uses it before torch is loaded.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL, "try again": checkpointed on a preemption, requeue to resume
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # a shell's status after Ctrl-C
MARKER_ENV = "PREEMPTION_MARKER"  # where the workers report a preemption to the launcher
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)  # what the launcher turns into a stop
WORKER_STOP_SIGNAL = signal.SIGUSR1  # what PreemptionFlag handles and torchrun ignores


class PreemptionFlag:
    """Set by WORKER_STOP_SIGNAL, the stop signal of the node launcher and of SLURM's warning;
    the loop checks it at a step boundary on all ranks together.

    `PreemptionFlag(signals=())` is never set: for runs that must not trap signals (smoke check).
    """

    def __init__(self, signals=(WORKER_STOP_SIGNAL,)):
        self.requested = False
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


def report_preemption() -> int:
    """The exit code of a rank stopped by a preemption request, after its checkpoint.

    Under the node launcher the rank reports the preemption in the launcher's marker file and
    exits 0: torchrun treats any other code as a failure and restarts the workers, and on a
    node that restarts, the workers wait for a rendezvous that the stopped nodes never join.
    The launcher then exits 75 itself. Launched any other way, the rank exits 75.
    """
    # done: a late stop signal must not kill the rank while Python shuts down and drops its handlers
    signal.signal(WORKER_STOP_SIGNAL, signal.SIG_IGN)
    marker = os.environ.get(MARKER_ENV)
    if not marker:
        return PREEMPTED_EXIT_CODE
    Path(marker).touch()
    return 0


def forget_earlier_preemption() -> None:
    """A new attempt has started (torchrun restarted the workers after a failure or a rejoin,
    perhaps after some of the old ones had checkpointed on a stop request and reported it):
    only this attempt's outcome decides whether the node launcher exits 75."""
    marker = os.environ.get(MARKER_ENV)
    if marker:
        Path(marker).unlink(missing_ok=True)


def quiet_loader_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: loader workers ignore the stop signal. SLURM delivers it to
    every process of the step, and a loader worker that dies of it crashes its rank's next
    batch; the rank itself handles it (PreemptionFlag)."""
    signal.signal(WORKER_STOP_SIGNAL, signal.SIG_IGN)


def exit_status(torchrun_status: int, stop_signal: int | None, preempted: bool) -> int:
    """The node launcher's exit status. Only workers that checkpointed on a stop request
    (`preempted`) make it 75 ("requeue me"), and not when the request was the user's Ctrl-C."""
    if preempted:
        return INTERRUPTED_EXIT_CODE if stop_signal == signal.SIGINT else PREEMPTED_EXIT_CODE
    return torchrun_status if torchrun_status >= 0 else 128 - torchrun_status  # killed by a signal


def handles(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: SigCgt in /proc; elsewhere assumed):
    a worker still starting would ignore, or die of, a stop signal sent too early."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return not Path("/proc/self/status").exists()
    caught = int(status.split("SigCgt:")[1].split()[0], 16)
    return bool(caught & (1 << (sig - 1)))

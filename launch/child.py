"""Entry point of the processes `pdserve serve` starts: the `pdserve` CLI, bound to die with its parent.

Each child runs in its own session (a terminal's Ctrl-C reaches `pdserve serve` alone, which stops
the children in order), so nothing else would end it when `pdserve serve` is killed with SIGKILL.
The kernel does: PR_SET_PDEATHSIG delivers SIGKILL to the child the moment the thread that
started it ends. The parent's pid comes in PDSERVE_PARENT_PID, to close the race of a parent that
died before the child asked.

    python -m pdserve.launch.child decode-worker --model ...   (as `pdserve decode-worker ...`)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PARENT_PID_ENV = "PDSERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when `parent_pid` (its parent) ends; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        raise OSError("pdserve serve needs Linux (its children die with it through prctl)")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def main() -> int:
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent:
        die_with_parent(int(parent))
    from pdserve.launch.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

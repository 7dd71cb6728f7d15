"""cli/signals.py records a SIGTERM even when another handler caught it and the exception was swallowed (CI: Prefect's
TerminationSignal, wrapped by pydantic, ended a `run data` with exit 1), and never records one sent to a forked child.

Each case runs in a fresh interpreter: install() changes the process's signal handlers and wakeup fd.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def received_in_fresh_process(body: str) -> str:
    code = "import os, signal, time\nfrom lmforge.cli import signals\nsignals.install()\n" + textwrap.dedent(body) + \
           "\nprint(signals.received())\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_sigterm_another_handler_caught_and_a_library_swallowed_is_still_received():
    assert received_in_fresh_process("""
        class TerminationSignal(BaseException):   # Prefect's, raised by the handler its flow engine installs
            pass

        def library_handler(signum, frame):
            raise TerminationSignal()

        signal.signal(signal.SIGTERM, library_handler)
        try:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except BaseException as e:   # what pydantic does in a serializer: wrap it in an error of its own
                raise ValueError(f"serializer failed: {e!r}") from None
        except ValueError:
            pass
    """) == "15"


def test_a_sigterm_sent_to_a_forked_child_is_not_the_commands():
    assert received_in_fresh_process("""
        pid = os.fork()
        if pid == 0:
            try:
                time.sleep(30)   # ended by the SIGTERM below, through its inherited handler
            finally:
                os._exit(0)      # no exit handlers: the child must not read the parent's record
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    """) == "None"


def test_nothing_received_when_no_signal_came():
    assert received_in_fresh_process("time.sleep(0.1)") == "None"

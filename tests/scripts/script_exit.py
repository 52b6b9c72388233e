"""How a rank of a test script ends once its results are written."""

import os
import sys


def exit_now() -> None:
    """Leave without the interpreter's teardown: there, the process group's native threads can
    abort a rank ("terminate called without an active exception", exit -6) after all its work
    and results are done, which the launcher reports as a failure. engine.worker ends the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

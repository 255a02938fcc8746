"""Allows `python -m pithtrain ...`."""

import os
import signal

if "PITHTRAIN_LAUNCHER" in os.environ:  # a worker of launch_local: a SIGINT held since its start, or one before
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # its mesh is up, ends it at once, without a traceback
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

from pithtrain.cli import main  # noqa: E402

main()

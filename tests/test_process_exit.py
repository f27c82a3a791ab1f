"""How an `fsd-chat` process ends (`fsd_chat.cli.app`): its objects are frozen at exit, so that the
interpreter's last garbage collections skip what torch and transformers made."""

from __future__ import annotations

import subprocess
import sys


def test_the_command_lines_process_freezes_its_objects_at_exit() -> None:
    # Registered before the command line's own handler, this one runs after it (last in, first out).
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
        "import fsd_chat.cli\n"
        "print('frozen before exit:', gc.get_freeze_count() > 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines() == ["frozen before exit: False", "frozen at exit: True"]

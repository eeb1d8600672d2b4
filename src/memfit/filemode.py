"""One permission mode for every file memfit writes: the one ``open(path, "w")`` gives, ``0o666`` less the umask.

Some writers create their file through a temporary one and rename it into place, which leaves it ``0o600``
(readable by its owner only): safetensors' ``save_file`` (0.8) does. :func:`give_default_mode` puts such a file
back to the mode of every other file of the run, checkpoint or export.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (``/proc/self/status``); elsewhere
    it is set and restored at once (``os.umask`` only reads by writing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666 & ~umask`` (``0o644`` under the usual ``022``)."""
    return 0o666 & ~current_umask()


def give_default_mode(path: str | Path) -> None:
    """Set the mode of the file ``path`` to :func:`default_file_mode` (call it before renaming into place)."""
    os.chmod(path, default_file_mode())

"""The one check for a directory that holds our IPC sockets (the server's run directory, a
node's compile-pool directory): a real directory (not a symlink), owned by this user, mode
exactly 0700. Another local user who made it, or can enter it, could bind a socket there
and answer for us."""
from __future__ import annotations

import os
import stat
from typing import Optional


def private_dir_problem(directory: str, what: str = "directory") -> Optional[str]:
    """None if ``directory`` is private to us; otherwise what is wrong, naming the path."""
    try:
        st = os.lstat(directory)  # lstat: a symlink is judged itself, never its target
    except OSError as e:
        return f"{what} {directory} cannot be read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{what} {directory} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {directory} is not a directory"
    if st.st_uid != os.getuid():
        return f"{what} {directory} is owned by uid {st.st_uid}, not {os.getuid()} (it must be ours, mode 0700)"
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"{what} {directory} has mode {stat.S_IMODE(st.st_mode):o}, not 0700"
    return None

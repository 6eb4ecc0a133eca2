"""A directory of this user's alone on this host, for what sparklm keeps outside a run directory (a round worker's
held weights, rank logs of a remote run, host-local locks).

The temp directory is shared by every user of a host, so a fixed name in it is whoever's makes it first: another
user who creates it open to all can swap the files in it (weights this user's next round loads), and one who
creates it closed makes every other user's run fail. So everything goes under one directory per user — the rule
the environment launcher (``spark/environment.py``) follows: ``<temp dir>/sparklm-<uid>``, used only when it is a
real directory (not a link) that this user owns, mode 0700, in a parent where no one else can rename it (owned by
this user or root, and sticky where others may write). The checks are made on the opened directory
(``O_NOFOLLOW``, then ``fstat``), not on a path looked up again between two tests, so a directory/link swap cannot
slip between them; once such an entry is ours, the sticky bit keeps it ours. Where the temp directory's entry is
another user's, ``~/.cache/sparklm/tmp`` under the same checks; neither: one line.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .errors import SparklmError


def host_dir(*parts: str, base: str | None = None) -> Path:
    """``<base>/sparklm-<uid>/<parts>`` (``base``: the temp directory), made if missing and this user's alone; a
    place another user holds is passed over for ``~/.cache/sparklm/tmp``."""
    uid = os.getuid()
    tried = []
    for root in (Path(base or tempfile.gettempdir()), Path.home() / ".cache" / "sparklm" / "tmp"):
        path = root / f"sparklm-{uid}"
        why = _own(path, root, uid)
        if why is None:
            out = path.joinpath(*parts)
            out.mkdir(mode=0o700, parents=True, exist_ok=True)  # inside a directory no one else may enter
            return out
        tried.append(f"{path} ({why})")
    raise SparklmError(f"no directory of this user's own for sparklm's temporary files: {'; '.join(tried)}",
                       hint="remove the one another user made, or set TMPDIR to a directory of yours")


def _own(path: Path, parent: Path, uid: int) -> str | None:
    """None where ``path`` is (now) a directory of ``uid``'s alone, else why not."""
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        pst = os.stat(parent)
    except OSError as e:
        return e.strerror or str(e)
    # in a parent another user owns, or may write without the sticky bit, our entry could be renamed away
    if pst.st_uid not in (uid, 0) or (pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX):
        return f"its parent {parent} lets another user replace it"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return e.strerror or str(e)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return "a link or not a directory"
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            return f"owned by uid {st.st_uid}"
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # ours: an earlier umask or version left it open
        return None
    finally:
        os.close(fd)

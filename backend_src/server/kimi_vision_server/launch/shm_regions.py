"""The Python backend's shared-memory regions of the servers this launcher starts.

Region names carry the launcher's pid and start time (:func:`shm_region_prefix`): the regions of a
stopped server are removed by name, and at every start those of launchers that no longer run
(a killed server's leftovers).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from pathlib import Path

from ..watch.stub_scan import process_start_ticks

SHM_DIR = Path("/dev/shm")
SHM_REGION_PREFIX = "kimi_prep_"
# kimi_prep_<launcher pid>-<its start time in ticks>-<server number>_<uuid the backend appends>
_OWNED_REGION = re.compile(rf"{SHM_REGION_PREFIX}(\d+)-(\d+)-\d+_")
_server_numbers = itertools.count()


def shm_region_prefix() -> str:
    """A region prefix naming this launcher (pid, start time) and a new server of it."""
    pid = os.getpid()
    return f"{SHM_REGION_PREFIX}{pid}-{process_start_ticks(pid) or 0}-{next(_server_numbers)}_"


def remove_shm_regions(prefix: str) -> list[str]:
    """Unlink the regions in ``/dev/shm`` named ``prefix*`` (those of one stopped server); their names."""
    removed = []
    for region in SHM_DIR.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            region.unlink()
            removed.append(region.name)
    return removed


def remove_stale_shm_regions() -> list[str]:
    """Unlink the regions whose launcher no longer runs (a killed server's leftovers); their names.

    Regions without an owner in their name (other prefixes, older launchers) are left alone.
    """
    removed = []
    for region in SHM_DIR.glob(f"{SHM_REGION_PREFIX}*"):
        owner = _OWNED_REGION.match(region.name)
        if owner and process_start_ticks(int(owner[1])) != int(owner[2]):
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
                removed.append(region.name)
    return removed

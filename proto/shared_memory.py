"""Shared-memory regions for same-host payloads: tensor bytes that skip gRPC.

A trainer on its pserver's host writes a push's encoded message (the same
PushChunk bytes :mod:`psproto.codec` would send) into a *region*: a memfd of
its own process, mapped in both. The gRPC call then carries only the region's
address (``ps.proto``'s ``SharedRegion``: pid, fd, name, size); the pserver
maps it through ``/proc/<pid>/fd/<fd>``, reads the push in place, and writes
its answer into a second region the trainer named. Every byte still crosses
once (into the region, then into its destination), but none goes through
gRPC's buffers, HTTP/2 framing and the socket, which cost gRPC Python about
as much CPU again as everything else a pserver does for a job S push.

Why a memfd named through ``/proc``: it has no path, so a trainer killed by
SIGKILL leaves nothing behind in ``/dev/shm`` (the memory goes with the last
mapping), and it needs no file descriptor passing. Opening another process's
``/proc/<pid>/fd/<fd>`` needs the same user (the pserver checks the owner)
and the same PID namespace; where either is missing, :func:`map_region`
refuses and the trainer goes back to sending bytes through gRPC.
"""

from __future__ import annotations

import mmap
import os
import secrets

# memfd names a pserver agrees to map: a trainer's regions and nothing else.
NAME_PREFIX = "psregion-"


class SharedMemoryError(Exception):
    """A region that cannot be mapped here (another host or PID namespace, another user, gone)."""


class Region:
    """One shared-memory region owned by this process: a memfd of ``size`` bytes, mapped read-write."""

    def __init__(self, size: int):
        self.name = NAME_PREFIX + secrets.token_hex(8)
        self.size = size
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)

    def address(self, message_type):
        """This region as a ``SharedRegion`` message (``message_type``) naming this process."""
        return message_type(pid=os.getpid(), fd=self.fd, name=self.name, size=self.size)

    def close(self) -> None:
        """Unmap and close here. A pserver that mapped the region keeps its memory until it unmaps."""
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a view of it still lives (a failed call's pieces): it goes with them
            pass
        os.close(self.fd)


def map_region(pid: int, fd: int, name: str, size: int) -> memoryview:
    """Map the region ``name`` that process ``pid`` holds as ``fd``; a read-write view of its ``size`` bytes.

    Raises :class:`SharedMemoryError` saying why when it is not a region of
    that process, not of this user, smaller than ``size``, or not reachable
    from here.
    """
    if not name.startswith(NAME_PREFIX) or pid <= 0 or fd < 0 or size <= 0:
        raise SharedMemoryError(f"not a shared region: pid {pid} fd {fd} name {name!r} size {size}")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            raise SharedMemoryError(f"process {pid} belongs to another user")
        opened = os.open(path, os.O_RDWR)
    except OSError as e:
        raise SharedMemoryError(
            f"cannot open {path} ({e.strerror}): a trainer on another host or in another PID namespace"
        ) from None
    try:
        # Checked on what was opened: a reused fd number names another file.
        if os.readlink(f"/proc/self/fd/{opened}") != f"/memfd:{name} (deleted)":
            raise SharedMemoryError(f"{path} is not the region {name!r}")
        if os.fstat(opened).st_size < size:
            raise SharedMemoryError(f"region {name!r} holds {os.fstat(opened).st_size} bytes, not {size}")
        return memoryview(mmap.mmap(opened, size))
    finally:
        os.close(opened)

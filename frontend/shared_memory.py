"""Triton's system shared-memory extension: tensors passed through POSIX shared memory on the frontend's host.

A client on the frontend's host creates a shared-memory object (``shm_open(key)``, as
``tritonclient.utils.shared_memory`` does), registers a region of it under a name
(SystemSharedMemoryRegister: key, offset, byte_size), and names that region in an input's or a
requested output's parameters (``shared_memory_region``, ``shared_memory_byte_size``,
``shared_memory_offset``) instead of sending the tensor's bytes. The frontend maps each registered
region once, reads inputs straight from the mapping into the request it sends a backend (the
client's request carries no tensor bytes, so a large input is neither copied into a gRPC message nor
parsed out of one), and writes outputs into it.

Contracts:
- Keys are as ``shm_open`` takes them on Linux: leading '/' optional, then one name of at most 255
  bytes without '/'; the object is ``/dev/shm/<name>``. It is opened read-write when registered
  (outputs are written to it), and must hold ``offset + byte_size`` bytes then.
- Every access checks the object still holds the region: an object truncated since would fault the
  frontend, and one re-created under the key since (the client destroyed it and created another)
  is not the memory the client now writes, so both are refused naming the region. An object
  unlinked after registration, and not re-created, keeps working, as in Triton: the mapping holds
  its memory.
- A request's inputs and outputs are checked against their regions before it runs: an unknown
  region or an offset and size past its end is refused without running the model.
- Unregistering an unknown name is no error (Triton's behaviour), an empty name unregisters all.
- Refusals raise :class:`frontend.requests.RequestError` with the gRPC status: INVALID_ARGUMENT for
  a bad key, size, offset or region name in a request, NOT_FOUND for a key with no object and for
  the status of an unknown region, ALREADY_EXISTS for a name registered twice, PERMISSION_DENIED
  for an object the frontend may not open.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import grpc

from frontend.requests import RequestError

SHM_DIR = "/dev/shm"           # where glibc's shm_open keeps POSIX shared-memory objects
NAME_MAX = 255


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def object_path(key: str) -> str:
    """The file of shared-memory object ``key``; RequestError when shm_open would refuse the key."""
    name = key.lstrip("/")
    if not name or "/" in name or len(name.encode()) > NAME_MAX or name in (".", "..") or "\0" in name:
        raise _invalid(f"shared memory key {key!r} is not a POSIX shared-memory name "
                       f"('/name': one name of 1-{NAME_MAX} bytes without '/')")
    return os.path.join(SHM_DIR, name)


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


class _Region:
    """A registered region: the object's descriptor and a mapping of its first offset + byte_size bytes."""

    def __init__(self, status: RegionStatus, fd: int, mapping: mmap.mmap) -> None:
        self.status, self.fd, self.mapping = status, fd, mapping
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)

    def check(self) -> None:
        """RequestError when the object no longer holds the region (accessing it would fault)."""
        s = self.status
        size = os.fstat(self.fd).st_size
        if size < s.offset + s.byte_size:
            raise _invalid(f"shared memory region {s.name!r}: object {s.key!r} shrank to {size} bytes since it was "
                           f"registered (offset {s.offset} + byte_size {s.byte_size}); register the region again")
        try:
            st = os.stat(object_path(s.key))
        except FileNotFoundError:           # unlinked: the mapping still holds the memory
            return
        if (st.st_dev, st.st_ino) != self.identity:
            raise _invalid(f"shared memory region {s.name!r}: object {s.key!r} was destroyed and created anew since "
                           f"the region was registered, so the frontend no longer sees what is written to it; "
                           f"unregister and register the region again")


class SharedMemoryRegistry:
    """The frontend's registered system shared-memory regions, by name (thread-safe)."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise _invalid("a shared memory region needs a name")
        path = object_path(key)
        if byte_size <= 0:
            raise _invalid(f"shared memory region {name!r}: byte_size must be positive, got {byte_size}")
        if offset < 0:
            raise _invalid(f"shared memory region {name!r}: offset must not be negative, got {offset}")
        with self._lock:
            if name in self._regions:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"shared memory region {name!r} is already registered (key "
                                   f"{self._regions[name].status.key!r}); unregister it first")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"shared memory region {name!r}: no shared-memory "
                                                          f"object with key {key!r} on the frontend's host") from None
        except PermissionError:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"shared memory region {name!r}: the frontend "
                                                                  f"may not open object {key!r} for reading and "
                                                                  f"writing") from None
        except OSError as exc:
            raise _invalid(f"shared memory region {name!r}: cannot open object {key!r}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise _invalid(f"shared memory region {name!r}: offset {offset} + byte_size {byte_size} runs past "
                               f"the end of object {key!r} ({size} bytes)")
            mapping = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        region = _Region(RegionStatus(name, key, offset, byte_size), fd, mapping)
        with self._lock:
            if name in self._regions:            # registered meanwhile by another call
                region.close()
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"shared memory region {name!r} is already "
                                                                   f"registered; unregister it first")
            self._regions[name] = region

    def unregister(self, name: str = "") -> None:
        """Unregister region ``name`` (empty: every region); an unknown name is no error."""
        with self._lock:
            names = list(self._regions) if not name else [name] if name in self._regions else []
            gone = [self._regions.pop(n) for n in names]
        for region in gone:
            region.close()

    def status(self, name: str = "") -> list[RegionStatus]:
        """Region ``name`` (empty: every region, by name); NOT_FOUND for an unknown one."""
        with self._lock:
            if not name:
                return [self._regions[n].status for n in sorted(self._regions)]
            region = self._regions.get(name)
        if region is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"no shared memory region {name!r} is registered")
        return [region.status]

    def locate(self, what: str, region_name: str, offset: int, byte_size: int) -> tuple[_Region, int, int]:
        """The region, start and end in its mapping of ``byte_size`` bytes at ``offset`` in region
        ``region_name``, for ``what`` (an input or output, in messages); RequestError when the region is
        unknown, too small, or no longer the client's (see the module's contracts)."""
        with self._lock:
            region = self._regions.get(region_name)
        if region is None:
            raise _invalid(f"{what}: no shared memory region {region_name!r} is registered")
        s = region.status
        if offset < 0 or byte_size < 0 or offset + byte_size > s.byte_size:
            raise _invalid(f"{what}: shared_memory_offset {offset} + shared_memory_byte_size {byte_size} run past "
                           f"the end of shared memory region {region_name!r} ({s.byte_size} bytes)")
        region.check()
        start = s.offset + offset
        return region, start, start + byte_size

    def read(self, what: str, region_name: str, offset: int, byte_size: int) -> bytes:
        """``byte_size`` bytes at ``offset`` in the region, for ``what`` (an input, in messages)."""
        region, start, end = self.locate(what, region_name, offset, byte_size)
        try:
            return region.mapping[start:end]
        except ValueError:          # unregistered (and unmapped) by another call meanwhile
            raise _invalid(f"{what}: shared memory region {region_name!r} was unregistered") from None

    def write(self, what: str, region_name: str, offset: int, byte_size: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` in the region, which gives it ``byte_size`` bytes."""
        if len(data) > byte_size:
            raise _invalid(f"{what}: shared_memory_byte_size {byte_size} of region {region_name!r} is too small "
                           f"for the {len(data)} bytes of the result")
        region, start, _ = self.locate(what, region_name, offset, byte_size)
        try:
            region.mapping[start:start + len(data)] = data
        except ValueError:
            raise _invalid(f"{what}: shared memory region {region_name!r} was unregistered") from None

    def close(self) -> None:
        self.unregister()

"""How one step's inputs get from rank 0 to the other tensor-parallel ranks.

Rank 0 builds a StepInputs once per step and sends it; every other rank receives it and runs
the same forward. Two channels, one interface (`send(obj)` on rank 0, `recv()` elsewhere):

- ShmChannel (one host, workers spawned by the engine): the pickled message is written once
  into a shared-memory slot and each worker gets a 9-byte header (slot, length) through its
  own pipe. The pipe is also the lifeline: when rank 0's process dies its end closes and an
  idle worker's `recv` sees EOF.
- BroadcastChannel (several hosts, under torchrun): a length then the pickled bytes, each as
  one `dist.broadcast` over a gloo group of its own (so its long idle timeout never applies to
  the model's collectives).

Two slots suffice for the ring: a worker unpickles step k before it joins step k's first
collective, and rank 0 writes step k+2 only after step k+1's collectives, so slot k % 2 is
free again by then. A message larger than a slot goes inline through the pipe.
"""

from __future__ import annotations

import pickle
import struct
from datetime import timedelta
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

_HEADER = struct.Struct("<bQ")  # slot (-1: payload follows inline), payload length
INLINE = -1


class ShmChannel:
    def __init__(self, num_readers: int, ctx, slot_bytes: int = 4 << 20):
        self.slot_bytes = slot_bytes
        self.shm = shared_memory.SharedMemory(create=True, size=2 * slot_bytes)
        pipes = [ctx.Pipe(duplex=False) for _ in range(num_readers)]
        self.readers = [r for r, _ in pipes]  # handed to the workers
        self.writers = [w for _, w in pipes]
        self.step = 0

    def reader(self, i: int) -> ShmReader:
        return ShmReader(self.shm.name, self.slot_bytes, self.readers[i])

    def started(self) -> None:
        """Drop rank 0's copies of the read ends once the workers hold theirs, so that a
        worker sees EOF when rank 0 goes away."""
        for r in self.readers:
            r.close()

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) <= self.slot_bytes:
            slot = self.step % 2
            self.step += 1
            off = slot * self.slot_bytes
            buf = self.shm.buf
            assert buf is not None  # None only once closed
            buf[off : off + len(data)] = data
            header = _HEADER.pack(slot, len(data))
            for w in self.writers:
                w.send_bytes(header)
        else:
            header = _HEADER.pack(INLINE, len(data))
            for w in self.writers:
                w.send_bytes(header + data)

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.writers = []
        try:
            self.shm.close()
            self.shm.unlink()
        except FileNotFoundError:
            pass


class ShmReader:
    """A worker's end of a ShmChannel (picklable: it attaches to the segment on first use)."""

    def __init__(self, shm_name: str, slot_bytes: int, conn):
        self.shm_name, self.slot_bytes, self.conn = shm_name, slot_bytes, conn
        self.shm: shared_memory.SharedMemory | None = None

    def recv(self):
        shm = self.shm
        if shm is None:
            # spawned workers share rank 0's resource tracker, so attaching registers nothing new;
            # rank 0 unlinks the segment when it closes
            shm = self.shm = shared_memory.SharedMemory(name=self.shm_name)
        msg = self.conn.recv_bytes()  # EOFError when rank 0 is gone
        slot, n = _HEADER.unpack_from(msg)
        if slot == INLINE:
            return pickle.loads(memoryview(msg)[_HEADER.size :])
        off = slot * self.slot_bytes
        buf = shm.buf
        assert buf is not None  # None only once closed
        return pickle.loads(buf[off : off + n])

    def close(self) -> None:
        self.conn.close()
        if self.shm is not None:
            self.shm.close()


class BroadcastChannel:
    """Rank 0 broadcasts to every rank of `group` (all ranks construct it, in the same order)."""

    def __init__(self, idle_timeout: timedelta = timedelta(days=7)):
        # idle workers wait here between requests: the timeout is how long a server may sit idle
        self.group = dist.new_group(backend="gloo", timeout=idle_timeout)

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def recv(self):
        n = torch.empty(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group)
        buf = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return pickle.loads(buf.numpy().data)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        pass

"""One host-to-device copy for a step's small input arrays.

A step's metadata is half a dozen small arrays (slot mapping, block tables, sequence lengths,
ids, positions); copied one by one, each costs a pinned allocation and a copy launch. Here they
are packed into one pinned buffer at aligned offsets, copied in one go into a device buffer, and
handed back as typed views of it. The buffers are used in turn (`SETS` of them): with async
scheduling a step is staged while the one before may still wait in the stream, and its event
says when a set's copy is done, before the host writes it again. A device set is rewritten only
by a copy queued after the kernels of the step that read it (one stream), so it needs no guard.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes: every view starts aligned for any dtype
SETS = 3


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    def __init__(self, device: torch.device, nbytes: int = 4 << 20):
        self.nbytes = nbytes
        self.host = [torch.empty(nbytes, dtype=torch.uint8).pin_memory() for _ in range(SETS)]
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(SETS)]
        self.done = [torch.cuda.Event() for _ in range(SETS)]
        self.turn = 0

    def fits(self, arrays: list[np.ndarray]) -> bool:
        return sum(_aligned(a.nbytes) for a in arrays) <= self.nbytes

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors equal to `arrays` (same dtypes and shapes), valid for this step."""
        assert self.fits(arrays)
        self.turn = (self.turn + 1) % SETS
        self.done[self.turn].synchronize()  # normally long done: SETS steps old
        host = self.host[self.turn].numpy()
        spans = []
        off = 0
        for a in arrays:
            a = np.ascontiguousarray(a)
            raw = a.reshape(-1).view(np.uint8)
            host[off : off + raw.size] = raw
            spans.append((off, a))
            off += _aligned(raw.size)
        dev = self.dev[self.turn]
        if off:
            dev[:off].copy_(self.host[self.turn][:off], non_blocking=True)
        self.done[self.turn].record()
        return [dev[o : o + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape) for o, a in spans]


def pad_to(a: np.ndarray, size: int, fill: int, dtype=np.int64) -> np.ndarray:
    """`a` followed by `fill` up to `size` entries (a graph's padding rows or sequences)."""
    out = np.full(size, fill, dtype=dtype)
    out[: len(a)] = a
    return out


class PackedInputs:
    """A CUDA graph's input buffers as views of one device buffer (`dev`: fixed addresses the graph
    reads), with numpy views of two pinned host copies used in turn (`next_host`, then `upload`).

    The layout puts the 1-D buffers first and the 2-D ones (tables of a row per sequence) after, so
    a step of B rows goes up in one copy: the 1-D region and the first table's first B rows, which
    follow it; each further table adds one copy of its first B rows. A decode step thus costs one
    copy launch and numpy writes into views made once, not a pinned tensor, a slice and a copy per
    array. A prefill graph's token buffers, sized for the largest step, go up as far as the step
    uses them instead (`upload`'s `entries`). With async scheduling a step is written while the one
    before may still wait in the stream: the set's event says when its copy is done."""

    def __init__(self, layout: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device):
        ndims = [len(shape) for _, _, shape in layout]
        assert ndims == sorted(ndims) and set(ndims) <= {1, 2}, "1-D buffers first, then tables"
        spans: list[tuple[str, int, torch.dtype, tuple[int, ...]]] = []
        off = 0
        for name, dtype, shape in layout:
            spans.append((name, off, dtype, shape))
            off += _aligned(int(np.prod(shape)) * dtype.itemsize)
        self.nbytes = off
        self._dev = torch.zeros(off, dtype=torch.uint8, device=device)
        cuda = device.type == "cuda"
        self._host = [torch.zeros(off, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.dev = {n: self._dev[o : o + int(np.prod(s)) * d.itemsize].view(d).view(s) for n, o, d, s in spans}
        np_dtype = {d: torch.empty(0, dtype=d).numpy().dtype for _, _, d, _ in spans}
        self.host = [
            {n: h.numpy()[o : o + int(np.prod(s)) * d.itemsize].view(np_dtype[d]).reshape(s) for n, o, d, s in spans}
            for h in self._host
        ]
        self._tables = [(o, s[1] * d.itemsize) for _, o, d, s in spans if len(s) == 2]  # (start, bytes a row)
        self._vectors = [
            (o, d.itemsize, s[0]) for _, o, d, s in spans if len(s) == 1
        ]  # (start, bytes an entry, entries)
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None  # per set: after its copy
        self.turn = 0

    def next_host(self) -> dict[str, np.ndarray]:
        """The host set to write this step's inputs into (its previous copy is done)."""
        self.turn ^= 1
        if self.copied is not None:
            self.copied[self.turn].synchronize()  # normally long done: two steps old
        return self.host[self.turn]

    def upload(self, rows: int, entries: int | None = None) -> None:
        """Queue the copy of the set `next_host` gave: each table's first `rows` rows, and every 1-D
        buffer whole or, given `entries`, its first `entries` entries (a copy each: for buffers
        much longer than a step uses, as a prefill graph's token buffers)."""
        src = self._host[self.turn]
        first = self._tables[0][0] if self._tables else self.nbytes  # where the 1-D region ends
        if entries is None:  # the first table follows the 1-D region: one copy for both
            spans = [(0, first + rows * self._tables[0][1])] if self._tables else [(0, self.nbytes)]
        else:
            spans = [(o, o + min(entries, n) * size) for o, size, n in self._vectors]
            spans += [(first, first + rows * self._tables[0][1])] if self._tables else []
        spans += [(o, o + rows * r) for o, r in self._tables[1:]]
        for a, b in spans:
            self._dev[a:b].copy_(src[a:b], non_blocking=True)
        if self.copied is not None:
            self.copied[self.turn].record()

"""A model's weights in one block of memory the kernel may back with 2 MiB pages.

A decode step reads every weight once, and on the CPU its time is how fast they stream
from memory. Read through 4 KiB pages, a stream crosses a page every few hundred
nanoseconds, and each crossing can miss the TLB and stops the hardware's prefetcher; in
2 MiB pages it crosses one every 512 of them. Linux backs an anonymous mapping with such
pages where it is advised to (MADV_HUGEPAGE, under transparent_hugepage's `madvise` or
`always`), so `gather` copies a model's tensors into one. On a host without them (another
OS, a kernel without transparent huge pages) the weights stay where they are.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

ALIGN = 64  # bytes: each storage starts on a cache line


def gather(model: nn.Module) -> nn.Module:
    """Move every CPU parameter's and buffer's storage into one anonymous mapping advised
    MADV_HUGEPAGE, in place: each tensor keeps its object, dtype, shape, strides and
    values, and tensors that shared a storage (a tied head, a view) still share it."""
    tensors = [t for t in (*model.parameters(), *model.buffers())
               if t is not None and t.device.type == "cpu" and t.layout == torch.strided
               and not t.is_quantized]
    # Each storage's size by its address, not the storage itself: a reference kept here
    # would hold every old storage until the end, the model twice whole.
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    if not sizes or not hasattr(mmap, "MADV_HUGEPAGE"):
        return model
    places, size = {}, 0  # where each storage goes, in bytes from the mapping's start
    for at, nbytes in sizes.items():
        places[at] = size
        size += -(-nbytes // ALIGN) * ALIGN
    arena = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages
        arena.close()
        return model
    memory = torch.frombuffer(arena, dtype=torch.uint8)  # its storage keeps the mapping
    copied = set()
    with torch.no_grad():
        for t in tensors:
            old = t.untyped_storage()
            start = places[old.data_ptr()]
            if old.data_ptr() not in copied:
                memory[start:start + old.nbytes()].copy_(
                    torch.empty(0, dtype=torch.uint8).set_(old))
                copied.add(old.data_ptr())
            # t's last reference to its old storage goes here, so a model is copied a
            # storage at a time, never held twice whole
            t.data = torch.empty(0, dtype=t.dtype).set_(
                memory.untyped_storage(), start // t.element_size() + t.storage_offset(),
                t.size(), t.stride())
    return model

"""PyTorch's CUDA caching allocator, simulated over a sequence of allocations and frees.

The rules are torch's ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``), the same from 2.2 to 2.11
in everything modelled here (docs/allocator-model.md lists them and the differences):

- a request is rounded up to 512 bytes (or to a power-of-two division, ``roundup_power2_divisions``);
- up to 1 MiB it is served from the small pool (new segments of 2 MiB), above from the large pool (20 MiB segments
  for requests under 10 MiB, the request rounded up to 2 MiB otherwise);
- a request takes the smallest cached block of its stream and pool that holds it (blocks ordered by stream, size,
  address), never a block of ``max_split_size`` or more for a smaller request, and an oversize one only within
  ``max_non_split_rounding`` (20 MiB) of its size;
- the block is split when the rest is at least 512 bytes (small pool, or any pool with expandable segments), else
  only when more than 1 MiB would remain and the request is under ``max_split_size``: otherwise it is handed out
  whole;
- a freed block merges with its free neighbours;
- when no cached block fits, a new segment is asked for; at the capacity, the allocator first frees cached oversize
  blocks that would cover the request (only with ``max_split_size``), then every cached segment with no block in use,
  then asks again (a retry) before it runs out of memory;
- with expandable segments, each stream and pool has one segment of address space that grows by mapping pages
  (2 MiB small, 20 MiB large) at the lowest address where the request fits, and releasing unmaps the free pages.

Addresses are the model's own; they decide only which of two equally sized cached blocks is taken (the lower one).
Where cudaMalloc puts a new segment depends on what the process mapped and freed before, not only on the allocator's
calls: the same first 368 calls gave descending addresses in one recorded run and ascending ones in another
(docs/allocator-model.md). The model takes the order that replays the recorded traces best, a fit and not the
driver's rule: segments up to ``DESCENDING_SEGMENT_BYTES`` each below the last, from the top of its address space;
larger ones each above the last, from the bottom. Sizes are bytes throughout.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from lightning_vram.prediction.allocator.settings import LARGE_BUFFER_BYTES, AllocatorSettings

MIN_BLOCK_BYTES = 512
"""``kMinBlockSize``: every size is rounded to a multiple of this."""
SMALL_REQUEST_BYTES = 1024 * 1024
"""``kSmallSize``: the largest request the small pool serves."""
SMALL_SEGMENT_BYTES = 2 * 1024 * 1024
"""``kSmallBuffer``: a small pool segment, and an expandable small segment's page."""
MIN_LARGE_ALLOC_BYTES = 10 * 1024 * 1024
"""``kMinLargeAlloc``: large requests below this get a 20 MiB segment."""
ROUND_LARGE_BYTES = 2 * 1024 * 1024
"""``kRoundLarge``: larger requests get a segment of their size rounded up to this."""
DESCENDING_SEGMENT_BYTES = 128 * 1024 * 1024
"""cudaMalloc segments up to this size are numbered downwards from ``_TOP_ADDRESS``, larger ones upwards from
``_BOTTOM_ADDRESS``; every threshold from 86 to 196 MiB replays the recorded traces alike (docs/allocator-model.md)."""
_TOP_ADDRESS = 1 << 60
"""Where segments up to ``DESCENDING_SEGMENT_BYTES`` are numbered down from."""
_BOTTOM_ADDRESS = 1 << 55
"""Where larger segments are numbered up from: far above the expandable segments' address spaces (from 2**40; they
never share a model with cudaMalloc's segments) and far below ``_TOP_ADDRESS``."""
UNLIMITED_ADDRESS_SPACE = 1 << 50
"""An expandable segment's address space when no capacity is given (torch reserves 1 1/8 of the device's memory)."""


class SimulatedOutOfMemory(Exception):
    """The simulated allocator could not serve a request at its capacity, after releasing its cache and retrying.

    Attributes:
        requested_bytes: the size asked for, before rounding.
        allocation_bytes: the device memory the allocator asked for (torch's "Tried to allocate").
        allocated_bytes: bytes in blocks handed out at that moment.
        reserved_bytes: bytes the allocator held at that moment (after releasing what it could).
        capacity_bytes: the capacity it ran against.
    """

    def __init__(
        self,
        requested_bytes: int,
        allocation_bytes: int,
        allocated_bytes: int,
        reserved_bytes: int,
        capacity_bytes: int,
    ) -> None:
        super().__init__(
            f"simulated out of memory: tried to allocate {allocation_bytes} B for a request of {requested_bytes} B"
            f" with {allocated_bytes} B allocated, {reserved_bytes} B reserved of a capacity of {capacity_bytes} B"
        )
        self.requested_bytes = requested_bytes
        self.allocation_bytes = allocation_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes


class _Expandable:
    """The address space of one expandable segment, mapped page by page (torch's ``ExpandableSegment``)."""

    __slots__ = ("address", "mapped", "page", "size")

    def __init__(self, address: int, page: int, size: int) -> None:
        self.address = address
        self.page = page
        self.size = size
        self.mapped: set[int] = set()


class _Block:
    """A run of device memory: handed out, cached (free, mapped) or, in an expandable segment, unmapped."""

    __slots__ = (
        "address",
        "allocated",
        "entry",
        "expandable",
        "gc_base",
        "mapped",
        "next",
        "prev",
        "size",
        "small",
        "stream",
    )

    def __init__(
        self, address: int, size: int, stream: int, small: bool, expandable: _Expandable | None = None
    ) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.small = small
        self.expandable = expandable
        self.allocated = False
        self.mapped = True
        self.gc_base = 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    entry: _Entry
    """Its place among cached blocks, set by :meth:`_Pool.insert` (a cached block's stream, size and address do not
    change until it is taken out of the pool)."""

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


_Entry = tuple[int, int, int, _Block]
"""A cached block's place in its pool, (stream, size, address, block): torch's ``BlockComparatorSize`` (stream, size,
address) and the block (never compared: no two cached blocks share an address)."""


class _Pool:
    """Cached blocks of one pool, ordered as torch orders them, and its unmapped expandable ranges."""

    __slots__ = ("entries", "searches", "small", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.entries: list[_Entry] = []
        """The cached blocks, in torch's order."""
        self.unmapped: list[_Block] = []
        self.searches = 0
        """``get_free_blocks_call_count``: searches of this pool while garbage collection is on (a block's age)."""

    def insert(self, block: _Block) -> None:
        block.gc_base = self.searches
        entry = block.entry = (block.stream, block.size, block.address, block)
        insort(self.entries, entry)

    def remove(self, block: _Block) -> None:
        entries = self.entries
        del entries[bisect_left(entries, block.entry)]

    def add_unmapped(self, block: _Block) -> None:
        self.unmapped.append(block)
        self.unmapped.sort(key=lambda unmapped: (unmapped.stream, unmapped.address))


class CachingAllocatorModel:
    """One device's caching allocator: ``malloc`` and ``free`` by block id, its counters as torch keeps them.

    ``capacity_bytes`` is the device memory the allocator may hold (None: no limit): a new segment or page past it
    fails as cudaMalloc would, and the allocator releases its cache and retries before raising
    :class:`SimulatedOutOfMemory`. ``memory_fraction_bytes`` is the share ``torch.cuda.set_per_process_memory_fraction``
    allows (its fraction of the device's total, in bytes): a new segment past it fails before asking the device, and
    only with it does ``garbage_collection_threshold`` act, as in torch.

    >>> model = CachingAllocatorModel()
    >>> model.malloc(1, 1000)  # 1024 B from a new 2 MiB small segment
    >>> model.malloc(2, 3 * 1024 * 1024)  # a new 20 MiB large segment, split
    >>> model.allocated_bytes, model.reserved_bytes, model.segments
    (3146752, 23068672, 2)
    >>> model.free(2); model.empty_cache(); model.reserved_bytes
    2097152
    """

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        capacity_bytes: int | None = None,
        memory_fraction_bytes: int | None = None,
    ) -> None:
        self.settings = AllocatorSettings() if settings is None else settings
        if self.settings.backend != "native":
            raise ValueError(
                f"settings.backend must be 'native' (the caching allocator), got {self.settings.backend!r}"
            )
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or capacity_bytes <= 0):
            raise ValueError(f"capacity_bytes must be a positive number of bytes or None, got {capacity_bytes!r}")
        if memory_fraction_bytes is not None and (
            isinstance(memory_fraction_bytes, bool) or memory_fraction_bytes <= 0
        ):
            raise ValueError(
                f"memory_fraction_bytes must be a positive number of bytes or None, got {memory_fraction_bytes!r}"
            )
        self.capacity_bytes = capacity_bytes
        self.memory_fraction_bytes = memory_fraction_bytes
        threshold = self.settings.garbage_collection_threshold
        self._gc_bytes = (
            None if threshold is None or memory_fraction_bytes is None else int(threshold * memory_fraction_bytes)
        )
        self._max_split = self.settings.max_split_size_bytes
        self._plain_rounding = all(divisions <= 1 for divisions in self.settings.roundup_power2_divisions)
        """Whether every request is rounded to 512 bytes only (no power-of-two divisions, torch's default)."""
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[int, _Block] = {}
        self._empty: set[int] = set()
        self._next_address = 1 << 40
        """Where the next expandable segment's address space starts (they grow upwards)."""
        self._top_address = _TOP_ADDRESS
        """Where the last cudaMalloc segment up to ``DESCENDING_SEGMENT_BYTES`` starts (they go downwards)."""
        self._bottom_address = _BOTTOM_ADDRESS
        """Where the next larger cudaMalloc segment starts (they go upwards)."""
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._segments = 0
        self._retries = 0
        self._device_allocs = 0
        self._device_frees = 0
        self._refusals = 0

    # The counters, as torch.cuda.memory_stats names them ("all" pools).
    @property
    def allocated_bytes(self) -> int:
        """``allocated_bytes.all.current``: bytes in blocks handed out (rounded sizes)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """``reserved_bytes.all.current``: bytes of device memory held (segments, or mapped pages)."""
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        """``allocated_bytes.all.peak`` since the start or the last :meth:`reset_peaks`."""
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """``reserved_bytes.all.peak`` since the start or the last :meth:`reset_peaks`."""
        return self._peak_reserved

    @property
    def segments(self) -> int:
        """``segment.all.current``: segments from cudaMalloc (mapping expandable pages counts none, as in torch)."""
        return self._segments

    @property
    def alloc_retries(self) -> int:
        """``num_alloc_retries``: requests that asked for memory again after releasing the whole cache."""
        return self._retries

    @property
    def device_allocs(self) -> int:
        """``num_device_alloc``: cudaMalloc calls and page mappings."""
        return self._device_allocs

    @property
    def device_frees(self) -> int:
        """``num_device_free``: cudaFree calls and page unmappings."""
        return self._device_frees

    @property
    def refusals(self) -> int:
        """Requests for device memory (segments, pages) the capacity or the memory fraction refused (the model's own).

        Where there were none, without expandable segments or a memory fraction, the same calls run alike at any
        capacity at least :attr:`peak_reserved_bytes`: there a capacity only refuses. With expandable segments it also
        sizes a segment's address space, and so how large a cached block at the mapped end counts (a recorded ResNet-50
        step took another block at 1.1 times its peak).
        """
        return self._refusals

    def reset_peaks(self) -> None:
        """Restart the peaks from the current values, as ``torch.cuda.reset_peak_memory_stats``."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def round_size(self, size: int) -> int:
        """The block size torch gives a request of ``size`` bytes (``round_size``).

        >>> CachingAllocatorModel().round_size(1), CachingAllocatorModel().round_size(1025)
        (512, 1536)
        """
        if size < MIN_BLOCK_BYTES:
            return MIN_BLOCK_BYTES
        divisions = self.settings.divisions(size)
        if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
            return _next_division(size, divisions)
        return -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES

    def malloc(self, block: int, size: int, stream: int = 0) -> None:
        """Hand out ``size`` bytes (as requested, before rounding) on ``stream`` as ``block``.

        A request of 0 bytes holds nothing (torch does not call its allocator for it). Raises
        :class:`SimulatedOutOfMemory` where torch would run out of memory; ValueError for a block already live.
        """
        if block in self._live or block in self._empty:
            raise ValueError(f"block {block!r} is already allocated")
        if size <= 0:
            if size < 0:
                raise ValueError(f"size must be a number of bytes >= 0, got {size!r}")
            self._empty.add(block)
            return
        # round_size, inline where it is 512-byte rounding alone (the simulator's hot path)
        rounded = -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES if self._plain_rounding else self.round_size(size)
        pool = self._small if rounded <= SMALL_REQUEST_BYTES else self._large
        found = self._get_free_block(pool, rounded, stream)
        if found is None:
            if self._gc_bytes is not None:
                self._garbage_collect(self._gc_bytes)
            found = self._alloc_with_retries(pool, size, rounded, stream)
        if found.size - rounded >= MIN_BLOCK_BYTES and self._should_split(found, rounded):  # no call for a whole fit
            remaining = found
            found = _Block(remaining.address, rounded, stream, pool.small, remaining.expandable)
            found.prev = remaining.prev
            if found.prev is not None:
                found.prev.next = found
            found.next = remaining
            remaining.prev = found
            remaining.address += rounded
            remaining.size -= rounded
            pool.insert(remaining)
        found.allocated = True
        self._live[block] = found
        self._allocated += found.size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated

    def free(self, block: int) -> None:
        """Return ``block`` to the cache, merged with its free neighbours. ValueError for a block not live."""
        freed = self._live.pop(block, None)
        if freed is None:  # a block is live or empty (0 bytes), never both
            if block not in self._empty:
                raise ValueError(f"block {block!r} is not allocated")
            self._empty.discard(block)
            return
        freed.allocated = False
        self._allocated -= freed.size
        pool = self._small if freed.small else self._large
        before, after = freed.prev, freed.next
        if before is not None and not before.allocated:
            self._merge(freed, before, pool)
        if after is not None and not after.allocated:
            self._merge(freed, after, pool)
        pool.insert(freed)

    def empty_cache(self) -> None:
        """Release every cached segment with no block in use (unmap every free page), as ``torch.cuda.empty_cache``."""
        self._release_cached_blocks()

    # torch's malloc path
    def _alloc_with_retries(self, pool: _Pool, size: int, rounded: int, stream: int) -> _Block:
        allocation = _allocation_size(rounded)
        found = self._alloc_block(pool, rounded, allocation, stream)
        if found is None and self._release_available_cached_blocks(pool, rounded, stream):
            found = self._alloc_block(pool, rounded, allocation, stream)
        if found is None:
            self._release_cached_blocks()
            self._retries += 1
            found = self._alloc_block(pool, rounded, allocation, stream)
        if found is None:
            limit = self.memory_fraction_bytes if self.capacity_bytes is None else self.capacity_bytes
            assert limit is not None  # without a limit every allocation succeeds
            raise SimulatedOutOfMemory(size, allocation, self._allocated, self._reserved, limit)
        return found

    def _get_free_block(self, pool: _Pool, rounded: int, stream: int) -> _Block | None:
        """The cached block torch's ``get_free_block`` takes, removed from the pool; None when none fits."""
        if self._gc_bytes is not None:
            pool.searches += 1
        entries = pool.entries
        index = bisect_left(entries, (stream, rounded, -1))
        if index == len(entries):
            return None
        entry = entries[index]
        if entry[0] != stream:
            return None
        candidate = entry[3]
        # A block at the mapped end of an expandable segment counts as large as it could grow: prefer one that is not.
        while candidate.expandable is not None and index + 1 < len(entries) and entries[index + 1][0] == stream:
            following = entries[index + 1][3]
            if _expandable_size(following) >= _expandable_size(candidate):
                break
            index += 1
            candidate = following
        max_split = self._max_split
        if max_split is not None:
            if rounded < max_split <= candidate.size:
                return None
            if rounded >= max_split and candidate.size >= rounded + self.settings.max_non_split_rounding_bytes:
                return None
        del entries[index]  # pool.remove(candidate), at the index the search found it
        return candidate

    def _should_split(self, block: _Block, rounded: int) -> bool:
        remaining = block.size - rounded
        if block.small or self.settings.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return (self._max_split is None or rounded < self._max_split) and remaining > SMALL_REQUEST_BYTES

    def _alloc_block(self, pool: _Pool, rounded: int, allocation: int, stream: int) -> _Block | None:
        """A new segment of ``allocation`` bytes (cudaMalloc), or the expandable block grown to hold the request."""
        fraction = self.memory_fraction_bytes
        if fraction is not None and self._reserved + allocation > fraction:
            self._refusals += 1
            return None
        if self.settings.expandable_segments:
            return self._allocate_expandable(pool, rounded, stream)
        if self.capacity_bytes is not None and self._reserved + allocation > self.capacity_bytes:
            self._refusals += 1
            return None
        if allocation <= DESCENDING_SEGMENT_BYTES:
            self._top_address -= allocation
            address = self._top_address
        else:
            address = self._bottom_address
            self._bottom_address += allocation
        self._reserved += allocation
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        self._segments += 1
        self._device_allocs += 1
        return _Block(address, allocation, stream, pool.small)

    def _garbage_collect(self, threshold_bytes: int) -> None:
        """Torch's ``garbage_collect_cached_blocks``, above the threshold.

        Whole cached large segments are freed, those at least as old as the average (searches of the pool since
        they were cached) each round, until the excess over the threshold is reclaimed.
        """
        if self._reserved <= threshold_bytes:
            return
        target = self._reserved - threshold_bytes
        pool = self._large
        freeable = [entry[3] for entry in pool.entries if not entry[3].is_split() and entry[3].expandable is None]
        total_age = sum(pool.searches - block.gc_base for block in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for *_, block in list(pool.entries):
                age = pool.searches - block.gc_base
                if not block.is_split() and block.expandable is None and age >= threshold_age:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(pool, block)

    def _release_available_cached_blocks(self, pool: _Pool, rounded: int, stream: int) -> bool:
        """Free cached oversize blocks enough for the request (only with ``max_split_size``); True when it did."""
        max_split = self._max_split
        if max_split is None:
            return False
        wanted = max(rounded, max_split)
        entries = pool.entries
        index = bisect_left(entries, (stream, wanted, -1))
        if index < len(entries) and entries[index][0] == stream:
            return self._release_block(pool, entries[index][3])
        if index == 0:
            return False
        released = 0
        index -= 1
        while released < wanted and index >= 0:
            block = entries[index][3]
            if block.size < max_split or block.stream != stream or not self._release_block(pool, block):
                break
            released += block.size
            index -= 1
        return released >= wanted

    def _release_block(self, pool: _Pool, block: _Block) -> bool:
        """Free a whole cached segment (cudaFree); False (nothing freed) for a split block or an expandable one."""
        if block.is_split() or block.expandable is not None:
            return False
        pool.remove(block)
        self._reserved -= block.size
        self._segments -= 1
        self._device_frees += 1
        return True

    def _release_cached_blocks(self) -> None:
        """Torch's ``release_cached_blocks``: every whole cached segment freed, every free expandable page unmapped."""
        for pool in (self._large, self._small):
            to_unmap: list[_Block] = []
            for *_, block in list(pool.entries):
                if block.expandable is not None:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(pool, block)
            for block in to_unmap:
                self._unmap_block(pool, block)
                if block.prev is None and block.next is None and not block.mapped:
                    pool.unmapped.remove(block)

    # merging
    def _merge(self, block: _Block, neighbour: _Block | None, pool: _Pool) -> None:
        """``try_merge_blocks``: ``block`` takes in a free neighbour of the same mapping (not in the pool itself)."""
        if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
            return
        if neighbour.mapped:
            pool.remove(neighbour)
        else:
            pool.unmapped.remove(neighbour)
        if block.prev is neighbour:
            block.address = neighbour.address
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size

    # expandable segments
    def _allocate_expandable(self, pool: _Pool, rounded: int, stream: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest address where the request fits."""
        candidate = self._find_expandable_block(pool, rounded, stream)
        if not candidate.mapped and not self._map_block(pool, candidate, min(candidate.size, rounded)):
            return None
        while candidate.size < rounded:
            following = candidate.next
            assert following is not None  # the search found room for the request
            if not self._map_block(pool, following, min(rounded - candidate.size, following.size)):
                return None
            candidate = following
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, rounded: int, stream: int) -> _Block:
        """The lowest-addressed free or unmapped run with room for the request, or a new segment's whole range."""
        for unmapped in pool.unmapped:
            if unmapped.stream != stream:
                continue
            start = unmapped
            if unmapped.prev is not None and not unmapped.prev.allocated:
                start = unmapped.prev
            room = 0
            walked: _Block | None = start
            while room < rounded and walked is not None and not walked.allocated:
                room += walked.size
                walked = walked.next
            if room >= rounded:
                return start
        page = SMALL_SEGMENT_BYTES if pool.small else LARGE_BUFFER_BYTES
        if self.capacity_bytes is None:
            size = UNLIMITED_ADDRESS_SPACE
        else:
            capacity = self.capacity_bytes + self.capacity_bytes // 8
            size = -(-capacity // page) * page
        address = -(-self._next_address // page) * page
        self._next_address = address + size
        segment = _Expandable(address, page, size)
        whole = _Block(address, size, stream, pool.small, segment)
        whole.mapped = False
        pool.add_unmapped(whole)
        return whole

    def _map_block(self, pool: _Pool, block: _Block, size: int) -> bool:
        """Map the pages under the first ``size`` bytes of the unmapped ``block``; False where the capacity refuses."""
        segment = block.expandable
        assert segment is not None
        begin = (block.address - segment.address) // segment.page
        end = -(-(block.address + size - segment.address) // segment.page)
        mapped = (end - begin) * segment.page
        if self.capacity_bytes is not None and self._reserved + mapped > self.capacity_bytes:
            self._refusals += 1
            return False
        segment.mapped.update(range(begin, end))
        pool.unmapped.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, block.stream, block.small, segment)
            rest.mapped = False
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.add_unmapped(rest)
            block.size = mapped
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)
        self._reserved += mapped
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self._device_allocs += 1
        return True

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside the free ``block``; the partial pages stay free blocks."""
        segment = block.expandable
        assert segment is not None
        begin = -(-(block.address - segment.address) // segment.page)
        end = (block.address + block.size - segment.address) // segment.page
        if begin >= end:
            return
        pool.remove(block)
        start = segment.address + begin * segment.page
        size = (end - begin) * segment.page
        before = start - block.address
        if before > 0:
            piece = _Block(block.address, before, block.stream, block.small, segment)
            piece.prev = block.prev
            piece.next = block
            if block.prev is not None:
                block.prev.next = piece
            block.prev = piece
            pool.insert(piece)
        after = block.size - before - size
        if after > 0:
            piece = _Block(start + size, after, block.stream, block.small, segment)
            piece.prev = block
            piece.next = block.next
            if block.next is not None:
                block.next.prev = piece
            block.next = piece
            pool.insert(piece)
        block.address = start
        block.size = size
        block.mapped = False
        segment.mapped.difference_update(range(begin, end))
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.add_unmapped(block)
        self._reserved -= size
        self._device_frees += 1


def _expandable_size(block: _Block) -> int:
    """A cached block's size with the unmapped range after it, as ``get_free_block`` weighs expandable blocks."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def _allocation_size(rounded: int) -> int:
    """The segment torch asks cudaMalloc for when no cached block serves a request (``get_allocation_size``).

    >>> _allocation_size(512), _allocation_size(1024 * 1024 + 512), _allocation_size(10 * 1024 * 1024 + 512)
    (2097152, 20971520, 12582912)
    """
    if rounded <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-rounded // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def _next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` rounded up to one of ``divisions`` steps between powers of two.

    >>> _next_division(1200, 4)
    1280
    """
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded_down = size & ~(step - 1)
    return size if rounded_down == size else rounded_down + step

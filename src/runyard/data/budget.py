"""How the data stage spends `data.memory_limit`: every buffer's size is derived here, from the limit and
the number of processes, never from the corpus size. So the peak memory of a preparation stays under the
limit whether the corpus is 100 MB or 1 TB; a larger corpus takes more passes over smaller pieces, not
more memory.

The limit covers the whole process tree on one machine: the preparing (main) process and its workers
together. While workers run, the main process only waits; while the main process works (deduplication,
tokenizer training, shard assembly), no worker runs. So:

    limit = PROCESS_BASE * (workers + 1) + workers * task_buffers      (parallel steps)
    limit = PROCESS_BASE * (workers + 1) + main_buffers                (the main process's steps)

with PROCESS_BASE the resident size of an idle interpreter that has imported numpy, tokenizers and
pyarrow (measured at ~90 MiB; counted high, since every process's resident pages count in full even
where a forked worker shares them with its parent). On Slurm each array task is its own machine's
concern, and gets the whole limit less one interpreter.

The factors below are measured peaks of the steps' working memory per byte of their input, with room
to spare; `tests/data/test_memory.py` checks the resulting peak against the limit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from runyard.data.errors import MemoryBudgetTooSmall

MIB = 1 << 20
PROCESS_BASE = 128 * MIB

# Working bytes per byte of text (measured: normalise + filters ~6, MinHash ~40 over a batch's bytes).
CLEAN_BYTES_PER_TEXT_BYTE = 64
# encode_batch's Encoding objects and the token arrays, per byte of text encoded at once (measured: ~30
# over a batch of source files; ~110 for one 4 MB document of short tokens, a JSON blob).
TOKENIZE_BYTES_PER_TEXT_BYTE = 128
# Sorting a block of fixed-size records in memory: the block, the sort order and a reordered copy.
SORT_BYTES_PER_RECORD_BYTE = 4

# Larger batches are no faster (measured on the stdlib: MinHash 4.2 MB/s at 0.25-1 MB, 3.2 MB/s at 4 MB;
# encode_batch 1.6 MB/s at 1 MB, 0.9 MB/s at 4 MB) and hold more: their intermediates leave the cache.
MAX_MINHASH_BATCH = 1 << 20
MAX_ENCODE_BATCH = 1 << 20
MAX_IO_BLOCK = 64 * MIB
# The main process's sorts and reads: a larger block is no faster (the merge reads every run a window
# at a time either way) but only a larger corpus fills it, so sized from the limit alone (208 MiB under
# 2 GiB) the dedup peak grew with the corpus until the corpus filled it (measured, near dedup's process
# at 1 GB: ~310 MiB; capped: 204). Capped, it is the same for every corpus that fills one block.
MAX_SORT_BLOCK = 32 * MIB
MAX_TEXT_BLOCK = 4 * MIB
MIN_TASK_BUFFERS = 48 * MIB

try:  # glibc: malloc_trim hands freed heap pages back to the system
    _LIBC = ctypes.CDLL("libc.so.6")
    _malloc_trim = _LIBC.malloc_trim
except (OSError, AttributeError):  # another C library: freed memory stays with the process
    _malloc_trim = None


def release_freed_memory() -> None:
    """Give the memory a finished step freed back to the system. glibc keeps freed heap pages in the
    process (and tokenizers' Rust allocations use the same heap), so without this a process's resident
    size is the sum of its steps' peaks, not the largest of them: a task run in the main process (one
    worker) followed by deduplication and tokenizer training would pass the limit."""
    if _malloc_trim is not None:
        _malloc_trim(0)


@dataclass(frozen=True)
class MemoryBudget:
    """The data stage's share of memory for `workers` worker processes under `limit` bytes."""

    limit: int
    workers: int

    @classmethod
    def for_local(cls, limit: int, workers: int) -> MemoryBudget:
        """A budget for the main process and `workers` local workers; refuses a limit too small for them."""
        budget = cls(limit, workers)
        if budget.task_buffers < MIN_TASK_BUFFERS:
            need = PROCESS_BASE * (workers + 1) + workers * MIN_TASK_BUFFERS
            raise MemoryBudgetTooSmall(
                f"data.memory_limit ({limit / MIB:.0f} MiB) is too small for {workers} worker process(es): "
                f"each needs {PROCESS_BASE // MIB} MiB for its interpreter and at least "
                f"{MIN_TASK_BUFFERS // MIB} MiB to work in, plus {PROCESS_BASE // MIB} MiB for the main "
                f"process: {need / MIB:.0f} MiB in all. Raise data.memory_limit or lower data.workers"
            )
        return budget

    @classmethod
    def for_array_task(cls, limit: int) -> MemoryBudget:
        """A budget for one task alone in its process (a Slurm array task, a Ray task)."""
        return cls(limit + PROCESS_BASE, 1)

    @property
    def task_buffers(self) -> int:
        """Working memory of one task in a worker, beyond its interpreter."""
        return (self.limit - PROCESS_BASE * (self.workers + 1)) // max(1, self.workers)

    @property
    def task_limit(self) -> int:
        """What one worker process may reach in all (its interpreter and its buffers)."""
        return PROCESS_BASE + self.task_buffers

    @property
    def main_buffers(self) -> int:
        """Working memory of the main process while no worker runs (the idle workers' interpreters and
        the main one counted)."""
        return self.limit - PROCESS_BASE * (self.workers + 1)

    # -- what each step may hold at once ------------------------------------------------------------------
    @property
    def max_document_bytes(self) -> int:
        """The largest single document a worker can clean and tokenize (it is held whole, MinHashed whole
        and encoded whole)."""
        return self.task_buffers // max(CLEAN_BYTES_PER_TEXT_BYTE, TOKENIZE_BYTES_PER_TEXT_BYTE)

    @property
    def minhash_batch_bytes(self) -> int:
        """Text MinHashed at once; a document larger than this is a batch of its own."""
        return max(1 << 16, min(MAX_MINHASH_BATCH, self.task_buffers // (2 * CLEAN_BYTES_PER_TEXT_BYTE)))

    @property
    def encode_batch_bytes(self) -> int:
        """Text given to one encode_batch call."""
        return max(1 << 16, min(MAX_ENCODE_BATCH, self.task_buffers // (2 * TOKENIZE_BYTES_PER_TEXT_BYTE)))

    def chunk_bytes(self, asked: int) -> int:
        """The tokenization chunk actually used: `data.chunk_bytes`, or less when a worker's share cannot
        hold a chunk's tokens (8 bytes per text byte at most, with their lengths) twice over."""
        return max(1, min(asked, self.task_buffers // 16))

    @property
    def io_block_bytes(self) -> int:
        """Bytes read from or written to a file at once by a worker."""
        return max(1 << 16, min(MAX_IO_BLOCK, self.task_buffers // 8))

    @property
    def sort_block_bytes(self) -> int:
        """Bytes of fixed-size records the main process sorts in memory at once (one spill bucket)."""
        return max(64 << 10, min(MAX_SORT_BLOCK, self.main_buffers // (2 * SORT_BYTES_PER_RECORD_BYTE)))

    @property
    def text_block_bytes(self) -> int:
        """Text the main process reads from a part at once (the tokenizer trainer's input, streamed)."""
        return max(64 << 10, min(MAX_TEXT_BLOCK, self.main_buffers // 16))

    @property
    def cluster_bytes(self) -> int:
        """Memory for the near-duplicate graph's nodes (the documents in some near-duplicate pair)."""
        return self.main_buffers // 2

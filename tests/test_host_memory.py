"""The host memory a run holds: the CPU device's pool of buffers, bounded by the device's peak whatever sizes a
step asks for and however many steps run."""
from __future__ import annotations

import torch

from streamer.runtime.transport import BufferPool


def test_a_pool_reuses_a_buffer_for_a_smaller_or_nearby_size():
    pool = BufferPool()
    embedding = 6 * 2**20 - 1000  # bf16 weights; the buffer's capacity is rounded up to BufferPool.GRANULE
    weights = pool.take(embedding, torch.bfloat16)
    address = weights.data_ptr()
    pool.give_back(weights)
    head = pool.take(embedding + 512, torch.bfloat16)  # a tied head's weights: the embedding's and its norm's
    assert head.data_ptr() == address and head.numel() == embedding + 512
    pool.give_back(head)
    tail = pool.take(2 * 2**20 + 5, torch.float32)  # a chunk shorter than the last one
    assert tail.data_ptr() == address and tail.numel() == 2 * 2**20 + 5 and tail.dtype == torch.float32
    pool.give_back(tail)
    assert pool.take(2**20, torch.float32).data_ptr() != address  # more than twice its size: not taken


def test_a_pool_keeps_no_more_than_the_device_has_held_at_once():
    held = [0]  # the ledger's bytes in use
    pool = BufferPool(lambda: held[0])
    sizes = [2**20, 3 * 2**20, 5 * 2**20, 7 * 2**20]  # in bytes, each held alone, one after the other
    for step in range(3):
        for nbytes in sizes:
            held[0] = nbytes
            buffer = pool.take(nbytes // 4, torch.float32)
            held[0] = 0
            pool.give_back(buffer)
            assert pool.free_bytes <= max(sizes)
    held[0] = 6 * 2**20  # bytes the pool did not hand out (autograd's) push idle buffers out
    pool.trim()
    assert pool.free_bytes + held[0] <= max(sizes)


def test_a_piece_of_a_tensor_is_not_taken_in():
    pool, whole = BufferPool(), torch.empty(2**20)
    pool.give_back(whole[16:])
    assert pool.free_bytes == 0

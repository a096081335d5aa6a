"""What torch.cuda.max_memory_allocated counts beyond the tensors' own bytes: the caching allocator's blocks and
cuBLAS's workspaces. The rules are torch's (c10/cuda/CUDACachingAllocator.cpp, aten/src/ATen/cuda/
CublasHandlePool.cpp); allocated bytes count each tensor's block, not the segment it was cut from.
"""
from __future__ import annotations

MiB = 2**20
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = MiB  # kSmallSize: larger requests come from the large pool
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: smaller large requests get a 20 MiB segment (kLargeBuffer)
LARGE_BUFFER = 20 * MiB  # kLargeBuffer
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests get a segment of their size rounded up to it
CUBLASLT_WORKSPACE = MiB  # CUBLASLT_WORKSPACE_SIZE's default (1024 KiB), one more per handle and stream
# The CUDA compute capabilities whose cuBLAS workspace torch sizes at 32 MiB (Hopper); others get 8 MiB + 128 KiB.
HOPPER = ("sm90",)


def cuda_block_bytes(nbytes: int) -> int:
    """The block a request of `nbytes` takes from a fresh segment: rounded up to 512 B; a large request (over
    1 MiB) keeps its whole segment unless more than 1 MiB would be left to split off (`should_split`), so
    20 MiB below 10 MiB, else its size rounded up to 2 MiB. Nothing for an empty tensor."""
    if nbytes == 0:
        return 0
    size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
    if size <= SMALL_SIZE:
        return size
    segment = LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE
    return size if segment - size > SMALL_SIZE else segment


def cublas_workspace_blocks(arch: str, config: str | None = None) -> tuple[int, int]:
    """cuBLAS's and cuBLASLt's workspaces for one handle and stream, as torch allocates them through the caching
    allocator: CUBLAS_WORKSPACE_CONFIG's `:SIZE:COUNT` pairs (KiB) where set, else 32 MiB on Hopper (sm90) and
    4096 KiB x 2 + 16 KiB x 8 elsewhere; and cuBLASLt's own 1 MiB."""
    pairs = [] if config is None else [p for p in config.split(":") if p]
    if pairs and len(pairs) % 2 == 0 and all(p.isdigit() for p in pairs):
        cublas = sum(int(size) * 1024 * int(count) for size, count in zip(pairs[::2], pairs[1::2], strict=True))
    else:
        cublas = 32 * MiB if arch in HOPPER else 4096 * 1024 * 2 + 16 * 1024 * 8
    return cublas, CUBLASLT_WORKSPACE


# A step's matmuls run on two threads, each with its own cuBLAS handle (torch's pool reserves one per thread):
# the forward and the recompute on the caller's, the backward on autograd's device thread.
MATMUL_THREADS = 2


def workspace_blocks(arch: str, config: str | None = None) -> tuple[int, ...]:
    """The cuBLAS workspaces a training step keeps on a CUDA device of compute capability `arch` ("sm90") for
    the whole run, one allocation each: a pair per matmul thread (`MATMUL_THREADS`); none without torch's CUDA
    allocator (arch "")."""
    return cublas_workspace_blocks(arch, config) * MATMUL_THREADS if arch else ()


def workspace_bytes(arch: str, config: str | None = None) -> int:
    """What `workspace_blocks` take on the device."""
    return sum(cuda_block_bytes(n) for n in workspace_blocks(arch, config))

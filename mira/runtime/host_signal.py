"""A CUDA stream that waits for a host thread, with no host thread waiting for the stream.

`HostSignal.hold(stream)` enqueues a CUDA host function (`cuLaunchHostFunc`) that is libc's
`sem_wait` on a counting semaphore: CUDA's callback thread runs it in stream order, so the
stream's later work starts only once some thread has called `post()` as many times as holds
were enqueued so far. The callback is C, not Python: it needs no GIL and waits on no thread that
might hold it. The caller goes on enqueueing work meanwhile. Each hold must be matched by exactly
one post, or the stream stalls for good; a post that no hold will match is taken back with `take`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

import torch

SEM_T_BYTES = 64  # glibc's sem_t is 32 bytes on 64-bit Linux; room to spare


def _libc() -> ctypes.PyDLL:
    """libc, called with the GIL held: `post` then never waits to take the GIL back."""
    libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    libc.sem_post.argtypes = [ctypes.c_void_p]
    libc.sem_trywait.argtypes = [ctypes.c_void_p]
    return libc


def launch_host_func():
    """The driver's cuLaunchHostFunc(CUstream, CUhostFn, void *userData), returning its CUresult."""
    cuda = ctypes.CDLL("libcuda.so.1")
    launch = cuda.cuLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # CUstream, CUhostFn, void *userData
    launch.restype = ctypes.c_int  # CUresult
    return launch


class HostSignal:
    """A semaphore that CUDA streams wait on (`hold`) and host threads release (`post`)."""

    def __init__(self) -> None:
        self._libc = _libc()
        self._launch = None  # cuLaunchHostFunc, loaded by the first hold (the semaphore alone needs no GPU)
        self._sem = ctypes.create_string_buffer(SEM_T_BYTES)
        if self._libc.sem_init(self._sem, 0, 0):
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._wait = ctypes.cast(self._libc.sem_wait, ctypes.c_void_p)  # int sem_wait(sem_t *) as a CUhostFn

    def hold(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue on `stream` (default: the current one) a wait for the next unmatched `post`."""
        stream = stream or torch.cuda.current_stream()
        if self._launch is None:
            self._launch = launch_host_func()
        status = self._launch(ctypes.c_void_p(stream.cuda_stream), self._wait, ctypes.cast(self._sem, ctypes.c_void_p))
        if status:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {status}")

    def post(self) -> None:
        """Release one hold (from any thread)."""
        if self._libc.sem_post(self._sem):
            raise OSError(ctypes.get_errno(), "sem_post failed")

    def take(self) -> None:
        """Take back one post that has been made and that no hold was enqueued for (without waiting:
        this thread holds the GIL, which the posting thread may need).

        Raises:
            RuntimeError: no post is left to take (every one is matched by a hold).
        """
        if self._libc.sem_trywait(self._sem):
            error = ctypes.get_errno()
            if error == errno.EAGAIN:
                raise RuntimeError("no post is left to take back: every post has its hold")
            raise OSError(error, "sem_trywait failed")

"""A CUDA stream that waits for a host thread, with no host thread waiting for the stream.

`HostSignal.hold(stream)` enqueues a CUDA host function (`cuLaunchHostFunc`) that is libc's
`sem_wait` on a counting semaphore: CUDA's callback thread runs it in stream order, so the
stream's later work starts only once some thread has called `post()` as many times as holds
were enqueued so far. The callback is C, not Python: it needs no GIL and waits on no thread that
might hold it. The caller goes on enqueueing work meanwhile. Each hold must be matched by exactly
one post, or the stream stalls for good; a post that no hold will match is taken back with `take`.
The other way round, `post_behind(stream)` posts when the stream reaches it, for a thread that
`wait`s.

The semaphore lives in memory another process can map (mira.store.host_memory): a process that
makes `HostSignal(memory)` on its mapping of `memory` posts and waits on the same semaphore.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

import torch

from mira.store.host_memory import host_buffer

SEM_T_BYTES = 64  # glibc's sem_t is 32 bytes on 64-bit Linux; room to spare


def _libc(dll: type[ctypes.CDLL]) -> ctypes.CDLL:
    """libc's semaphores; a PyDLL is called with the GIL held (`post` then never waits to take the GIL
    back), a CDLL lets it go (for `wait`)."""
    libc = dll(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for name in ("sem_post", "sem_trywait", "sem_wait"):
        getattr(libc, name).argtypes = [ctypes.c_void_p]
    libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    return libc


def launch_host_func():
    """The driver's cuLaunchHostFunc(CUstream, CUhostFn, void *userData), returning its CUresult."""
    cuda = ctypes.CDLL("libcuda.so.1")
    launch = cuda.cuLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # CUstream, CUhostFn, void *userData
    launch.restype = ctypes.c_int  # CUresult
    return launch


class HostSignal:
    """A semaphore that CUDA streams wait on (`hold`) and host threads release (`post`), or the other
    way round (`post_behind`, `wait`).

    Args:
        memory: uint8 [SEM_T_BYTES], another process's `HostSignal.memory` mapped here: the same
            semaphore; None: a new one (count 0) in memory of its own.
    """

    def __init__(self, memory: torch.Tensor | None = None) -> None:
        self._libc = _libc(ctypes.PyDLL)
        self._blocking = _libc(ctypes.CDLL)
        self._launch = None  # cuLaunchHostFunc, loaded by the first hold (the semaphore alone needs no GPU)
        made = memory is None
        self.memory = host_buffer((SEM_T_BYTES,)) if made else memory
        self._sem = ctypes.c_void_p(self.memory.data_ptr())
        if made and self._libc.sem_init(self._sem, 1, 0):  # 1: shared between processes
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def hold(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue on `stream` (default: the current one) a wait for the next unmatched `post`."""
        self._enqueue(self._libc.sem_wait, stream)

    def post_behind(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue on `stream` (default: the current one) a post, made when the stream reaches it."""
        self._enqueue(self._libc.sem_post, stream)

    def wait(self) -> None:
        """Wait (the GIL let go) for a post and take it."""
        while self._blocking.sem_wait(self._sem):
            error = ctypes.get_errno()
            if error != errno.EINTR:
                raise OSError(error, "sem_wait failed")

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

    def _enqueue(self, function, stream: torch.cuda.Stream | None) -> None:
        """Enqueue `function(sem)` (a libc function) as a host function on `stream`."""
        stream = stream or torch.cuda.current_stream()
        if self._launch is None:
            self._launch = launch_host_func()
        status = self._launch(ctypes.c_void_p(stream.cuda_stream), ctypes.cast(function, ctypes.c_void_p), self._sem)
        if status:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {status}")

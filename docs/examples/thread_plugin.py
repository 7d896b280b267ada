"""A blocking plugin whose library must be called from one thread of its own.

Some C libraries (GPU runtimes, vendor SDKs) bind their handles to the thread
that created them. The plugin owns a single-thread executor; its loader is a
plain function, so the broker runs it in a worker thread, which hands the call
to the library's thread and waits; its releaser does the same through
``anyio.to_thread``. Nothing blocks the event loop.

    python docs/examples/thread_plugin.py
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import anyio
import anyio.to_thread

import cachebroker

MiB = 2**20


class ThreadBoundLibrary:
    """Stands in for a C library: every call must come from the thread that opened it."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.handles: dict[int, bytearray] = {}
        self.calls = 0

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self.thread is None:
            self.thread = me
        if me != self.thread:
            raise RuntimeError("called from a thread that does not own the library")
        self.calls += 1

    def load(self, name: str, size: int) -> int:
        self._check_thread()
        handle = self.calls  # unique: one per call
        self.handles[handle] = bytearray(size)
        return handle

    def free(self, handle: int) -> None:
        self._check_thread()
        del self.handles[handle]


class LibraryPlugin:
    """The Releaser: every call into the library goes through its own thread."""

    def __init__(self, library: ThreadBoundLibrary) -> None:
        self.library = library
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vendor-lib")

    def load_blocking(self, name: str, size: int) -> int:
        # A plain function: the broker calls it in a worker thread, which waits
        # here while the library's own thread does the work.
        return self.thread.submit(self.library.load, name, size).result()

    async def release(self, name: str, handle: int) -> None:
        future = self.thread.submit(self.library.free, handle)
        await anyio.to_thread.run_sync(future.result)

    def close(self) -> None:
        self.thread.shutdown(wait=True)


async def main() -> ThreadBoundLibrary:
    library = ThreadBoundLibrary()
    plugin = LibraryPlugin(library)
    try:
        async with cachebroker.Broker(budget="20MiB") as broker:
            async with broker.cache("vendor", plugin) as cache:
                async with anyio.create_task_group() as tg:
                    for name in ["a", "b", "c", "a", "d", "b"]:
                        tg.start_soon(use, cache, plugin, name)
                assert (await broker.stats()).evictions > 0
        assert not library.handles, "every handle was freed on the library's thread"
    finally:
        plugin.close()
    return library


async def use(cache: cachebroker.Cache, plugin: LibraryPlugin, name: str) -> None:
    size = 8 * MiB
    async with cache.acquire(name, load=lambda: plugin.load_blocking(name, size), size=size):
        await anyio.sleep(0.01)


if __name__ == "__main__":
    finished = anyio.run(main)
    print(f"{finished.calls} library calls, all on its own thread; nothing left allocated")

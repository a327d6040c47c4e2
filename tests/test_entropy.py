"""Random bytes read ahead from the kernel: never handed out twice, not even
across a fork."""

from __future__ import annotations

import os
import threading

from stateful_responses.entropy import POOL_SIZE, random_bytes


def test_bytes_are_handed_out_once_whatever_the_sizes_asked():
    taken = [random_bytes(n) for n in (8, 12, POOL_SIZE, 1, POOL_SIZE + 1, 16) * 50]
    assert [len(b) for b in taken] == [8, 12, POOL_SIZE, 1, POOL_SIZE + 1, 16] * 50
    long_enough = [b for b in taken if len(b) >= 8]
    assert len(set(long_enough)) == len(long_enough)


def test_threads_taking_at_once_never_get_the_same_bytes():
    taken: list[bytes] = []

    def take() -> None:
        taken.extend(random_bytes(12) for _ in range(2000))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(taken)) == len(taken) == 8000


def test_a_forked_child_never_gets_its_parents_next_bytes():
    random_bytes(8)  # the pool holds bytes the parent has not handed out yet
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, random_bytes(64))
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    in_child = os.read(read, 64)
    os.close(read)
    assert len(in_child) == 64
    assert in_child != random_bytes(64)

"""bench/zmq_io_thread.py: its hand-written side speaks ZeroMQ's wire format, so that what
it measures against libzmq's I/O thread is the same messages reaching the same libzmq
socket on the host.

Here its server runs on this machine, in a thread, with a real libzmq client (the
comparison with gVisor is the script's run, docs/benchmarks.md)."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import zmq


@pytest.fixture(scope="module")
def bench(bench_script: Callable[[str], ModuleType]) -> ModuleType:
    return bench_script("zmq_io_thread")


@contextmanager
def running_server(bench: ModuleType, folder: Path) -> Iterator[Any]:
    """The script's server in a thread of this process, and its client; stopped after."""
    ended: list[int] = []
    server = threading.Thread(target=lambda: ended.append(bench.serve(str(folder), 0.0)), daemon=True)
    server.start()
    for _ in range(500):
        if (folder / "ready").exists():
            break
        server.join(0.01)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    made = bench.Client(context, str(folder))
    for way in made.out.values():
        way.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        yield made
    finally:
        made.stop()
        server.join(10)
        context.destroy(linger=0)
    assert ended == [0], "the server did not stop when asked"


@pytest.fixture
def client(bench: ModuleType, tmp_path: Path) -> Iterator[Any]:
    with running_server(bench, tmp_path) as made:
        yield made


def test_the_hand_written_frames_reach_a_libzmq_socket_whole(bench: ModuleType, client: Any) -> None:
    for way_in in ("libzmq", "own"):
        if way_in == "libzmq":
            client.zmq_in.send(bench.OUT["own"])
        else:
            client.own_in.sendall(bench.frame(bench.OUT["own"], 0))
        got = [client.out["own"].recv_multipart() for _ in range(bench.MESSAGES)]
        assert got == [list(bench.FRAMES)] * bench.MESSAGES


def test_every_way_in_and_out_answers_with_all_its_messages(bench: ModuleType, client: Any) -> None:
    for way_in, way_out in bench.WAYS:
        assert client.sample(way_in, way_out) > 0
    client.zmq_in.send(bench.OUT["libzmq"])
    got = [client.out["libzmq"].recv_multipart() for _ in range(bench.MESSAGES)]
    assert got == [list(bench.FRAMES)] * bench.MESSAGES


def test_a_frame_of_256_bytes_or_more_has_a_long_size(bench: ModuleType) -> None:
    assert bench.frame(b"x" * 255, 0)[:2] == bytes([0, 255])
    long = bench.frame(b"x" * 256, 1)
    assert long[0] == 0x03
    assert int.from_bytes(long[1:9], "big") == 256


def test_the_server_and_its_client_close_every_socket_they_open(bench: ModuleType, tmp_path: Path) -> None:
    """Unclosed sockets warn when collected, in whatever code runs then (a later test's).
    Earlier tests' garbage is collected first, and only warnings naming this test's
    sockets (their paths) count."""
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with running_server(bench, tmp_path) as client:
            for way_in, way_out in bench.WAYS:
                client.sample(way_in, way_out)
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert [text for text in unclosed if str(tmp_path) in text] == []

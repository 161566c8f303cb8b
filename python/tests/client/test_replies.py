"""Every request gets an answer the client recognises, or the client gives up:
against a daemon that never answers, one that answers with id 0 (an older
daemon that could not read a request's id), and the real daemon refusing a
request it cannot decode."""

import array
import errno
import json
import os
import socket
import tempfile
import threading
import time

import pytest

import gpushm


class FakeDaemon:
    """Listens on a socket, answers the hello of the one connection it
    accepts, then hands the connection to serve(conn) in a thread."""

    def __init__(self, serve):
        self.dir = tempfile.mkdtemp(prefix="gpushm-fake-")
        self.socket = os.path.join(self.dir, "s.sock")
        self.ln = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ln.bind(self.socket)
        self.ln.listen(1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(serve,), daemon=True)
        self.thread.start()

    def _run(self, serve):
        conn, _ = self.ln.accept()
        with conn:
            hello = json.loads(conn.recv(65536))
            page = os.memfd_create("epoch", os.MFD_CLOEXEC)
            os.ftruncate(page, 4096)
            rep = {"id": hello["id"], "version": 1, "backend": "host", "epoch": True}
            conn.sendmsg([json.dumps(rep).encode()],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [page]))])
            os.close(page)
            serve(conn, self.stop)

    def close(self):
        self.stop.set()
        self.ln.close()
        self.thread.join(10)
        os.unlink(self.socket)
        os.rmdir(self.dir)


@pytest.fixture
def fake():
    daemons = []

    def start(serve):
        d = FakeDaemon(serve)
        daemons.append(d)
        return d
    yield start
    for d in daemons:
        d.close()


def test_gives_up_on_a_daemon_that_does_not_answer(fake):
    def serve(conn, stop):
        conn.recv(65536)  # and never answer
        stop.wait(30)
    d = fake(serve)
    c = gpushm.connect(d.socket, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer within 0.2s"):
        c.stat("x")
    assert time.monotonic() - start >= 0.2
    # The reply stream cannot be trusted after that: the client says so.
    with pytest.raises(ConnectionError):
        c.stat("x")
    c.close()


def test_default_timeout_comes_from_the_environment(fake, monkeypatch):
    def serve(conn, stop):
        conn.recv(65536)
        stop.wait(30)
    d = fake(serve)
    monkeypatch.setenv("GPUSHM_TIMEOUT", "150ms")
    c = gpushm.connect(d.socket)
    with pytest.raises(TimeoutError):
        c.stat("x")
    c.close()


def test_takes_an_error_with_id_zero_as_its_answer(fake):
    def serve(conn, stop):
        conn.recv(65536)
        conn.send(json.dumps({"id": 0, "error": {"code": "EPROTO", "message": "unknown field"}}).encode())
        req = json.loads(conn.recv(65536))
        conn.send(json.dumps({"id": req["id"], "error": {"code": "ENOENT", "message": "no such segment"}}).encode())
        stop.wait(30)
    d = fake(serve)
    # No timeout: only recognising the reply can end the wait; the
    # daemon's thread ends the test if it hangs.
    c = gpushm.connect(d.socket, timeout=0)
    result = []

    def calls():
        for name in ("x", "y"):
            try:
                c.stat(name)
            except OSError as e:
                result.append(e)
    t = threading.Thread(target=calls, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the client skipped the reply with id 0 and waits for ever"
    # EPROTO for the first request, then the second one's own answer.
    assert [e.code for e in result] == ["EPROTO", "ENOENT"], result
    c.close()


def test_a_request_the_daemon_refuses_is_answered(client):
    # An unknown field and a field stat does not use: the daemon answers
    # with the request's id, so the client raises instead of waiting.
    for fields in ({"name": "x", "nmae": "y"}, {"name": "x", "size": 4096}):
        with pytest.raises(OSError) as e:
            client._call("stat", **fields)
        assert e.value.errno == errno.EPROTO, e.value
    assert client.list() is not None  # the connection is still in step


def test_a_waiting_open_waits_past_the_timeout(daemon):
    # The daemon answers an open with wait when the wait ends: the client's
    # timeout starts after it.
    name = f"wait-{os.getpid()}"
    writer = gpushm.connect(daemon.socket)
    reader = gpushm.connect(daemon.socket, timeout=0.3)
    seg = writer.create(name, 4096, uncommitted=True)
    later = threading.Timer(1.0, seg.commit)
    later.start()
    try:
        start = time.monotonic()
        got = reader.open(name, wait=30)
        assert time.monotonic() - start >= 0.3
        assert got.info.id == seg.info.id
        got.close()
    finally:
        later.join()
        writer.unlink(name)
        writer.close()
        reader.close()

"""The control block's version 2 (docs/protocol.md, "Channels"): the
sleeping words that let a hand-off skip the wake of an end that polls,
what a hostile end can do with them, and ends of another version."""

import threading
import time

import pytest

import gpushm
from gpushm import _channel


@pytest.fixture
def channels(daemon):
    made = []

    def connect():
        c = gpushm.connect(daemon.socket)
        made.append(c)
        return c
    yield connect
    for c in made:
        c.close()


def _word(ch, off):
    return _channel._u32(ch._ctl + off)


def _asleep(ch, off):
    """Waits until the end that sleeps on the event word says so in its
    sleeping word at off."""
    w = _word(ch, off)
    deadline = time.monotonic() + 10
    while not w.value:
        assert time.monotonic() < deadline, "the waiter never said that it sleeps"
        time.sleep(0.001)


class Waiter(threading.Thread):
    """Calls fn in a thread; .result is what it returned or raised."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result = fn, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except Exception as e:
            self.result = e


def test_a_waiter_says_it_sleeps_and_is_woken(channels, name):
    tx = channels().channel(name, nbytes=8, slots=1, spin_us=0)
    rx = channels().channel(name, spin_us=0)
    w = Waiter(lambda: rx.recv(timeout=30))
    _asleep(rx, _channel._OFF_RX_SLEEP)
    with tx.send() as t:
        t[:] = 5
    w.join(10)
    assert isinstance(w.result, gpushm.Message), w.result
    assert _word(rx, _channel._OFF_RX_SLEEP).value == 0, "the word outlived the wait"
    with w.result as t:
        assert bytes(t) == bytes([5]) * 8
    # The producer sleeps on a full slot, and the release wakes it.
    with tx.send() as t:
        t[:] = 6
    w = Waiter(lambda: tx.send(timeout=30))
    _asleep(tx, _channel._OFF_TX_SLEEP)
    with rx.recv(timeout=5):
        pass
    w.join(10)
    assert isinstance(w.result, gpushm.Message), w.result
    assert _word(tx, _channel._OFF_TX_SLEEP).value == 0
    w.result.done()


@pytest.mark.parametrize("word", [0, 0xFFFFFFFF])
def test_a_hostile_sleeping_word_delays_never_hangs(channels, name, word):
    """The sleeping words are the ends' to write, a hostile end's too: one
    that clears its peer's word (so that no wake comes) or fills it with
    garbage delays the peer (a sleep lasts 100 ms at most), never hangs it;
    the daemon never reads them."""
    tx = channels().channel(name, nbytes=8, slots=1, spin_us=0)
    rx = channels().channel(name, spin_us=0)
    w = Waiter(lambda: rx.recv())  # no timeout: only a wake or the tick ends its sleeps
    _asleep(rx, _channel._OFF_RX_SLEEP)
    _word(rx, _channel._OFF_RX_SLEEP).value = word
    with tx.send() as t:
        t[:] = 1
    w.join(10)
    assert isinstance(w.result, gpushm.Message), w.result
    w.result.done()
    tx.close()
    with pytest.raises(EOFError):
        rx.recv(timeout=10)


def test_ends_of_another_version_are_refused_and_an_idle_block_upgraded(channels, name):
    """An end refuses a block of another version, saying so, and keeps
    nothing (its role is free again); the daemon brings a block of version
    1 (one made before it was upgraded) to version 2 once no end holds it."""
    tx = channels().channel(name, nbytes=8)
    version = _word(tx, _channel._OFF_VERSION)
    version.value = 1  # as a daemon of version 1 made it
    c = channels()
    with pytest.raises(gpushm.Error, match=r"control block is version 1, this client's is 2: the daemon or the "
                                           r"channel's other end runs another gpushm version") as e:
        c.channel(name)
    assert e.value.code == "EPROTO"
    version.value = 2
    rx = c.channel(name)  # the role was not kept
    rx.close()
    version.value = 1
    tx.close()
    tx = channels().channel(name, nbytes=8)  # nobody holds it: upgraded
    assert _word(tx, _channel._OFF_VERSION).value == 2
    rx = channels().channel(name)
    with tx.send() as t:
        t[:] = 3
    with rx.recv(timeout=5) as t:
        assert bytes(t) == bytes([3]) * 8

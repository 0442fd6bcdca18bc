"""The relay from the device thread to the event loop: every item once and in order, batched at most
once per interval, the first at once, and at once again on a flush; with a hand-made token sequence
streamed through the server's incremental decoder."""

import asyncio
import random
import threading
import time

from transformers import AutoTokenizer

from mira.runtime.engine import BUNDLED_MODEL
from mira.runtime.generate import TextStream
from mira.serve.relay import Relay

END = object()  # the producer's last item
TIMER_SLACK_S = 0.002  # how early an asyncio timer may fire, at most
LONG_S = 60.0  # an interval no test waits out


def _consume(interval_s: float, produce, wakes: list | None = None) -> list[tuple[float, list]]:
    """Run `produce(relay, taken)` in a thread and take batches until END; each batch with its loop
    time as the take returned (not when this loop next ran: on a busy machine that is later).
    `taken` is a semaphore released after each take, for producers that wait for one; `wakes`
    gets an entry for each call the producer made into the loop."""

    async def main():
        loop = asyncio.get_running_loop()
        if wakes is not None:
            call = loop.call_soon_threadsafe
            loop.call_soon_threadsafe = lambda *args: wakes.append(args) or call(*args)  # this loop only
        relay = Relay(loop, interval_s)
        taken = threading.Semaphore(0)
        thread = threading.Thread(target=produce, args=(relay, taken))
        thread.start()
        async def timed_take():  # the loop time right as the take returns, before any other task runs
            items = await relay.take()
            return loop.time(), items

        batches = []
        while not batches or batches[-1][1][-1] is not END:
            batches.append(await asyncio.wait_for(timed_take(), LONG_S))  # a missed wake fails, not hangs
            taken.release()
        thread.join()
        return batches

    return asyncio.run(main())


def test_coalesced_text_is_every_token_s_text_once_and_in_order():
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    text = "Hash maps: 𝑂(1) lookups — dict() in Python. Café ☕, naïve 😀 emoji!\n" * 8
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces = []  # what the decoder emitted, in the producer's order
    rng = random.Random(0)

    def produce(relay, taken):
        def emit(piece):
            pieces.append(piece)
            relay.put(piece)

        stream = TextStream(tokenizer, [], emit)
        for token in ids:
            stream.add([token])
            time.sleep(rng.choice([0, 0, 0.001, 0.004]))  # steps of uneven length
        stream.finish()
        relay.put(END)
        relay.flush()

    interval = 0.05
    wakes = []
    batches = _consume(interval, produce, wakes)
    taken = [item for _, items in batches for item in items]
    assert taken[:-1] == pieces and taken[-1] is END
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(batches) < len(pieces)  # coalesced: a batch carries several pieces
    assert len(wakes) <= len(batches) + 1  # the producer calls into the loop per batch (and its flush), not per piece
    times = [when for when, _ in batches]
    assert all(b - a >= interval - TIMER_SLACK_S for a, b in zip(times[:-2], times[1:-1]))  # the last was flushed


def test_the_first_item_goes_at_once_and_later_ones_wait_for_the_interval():
    interval = 0.3

    def produce(relay, taken):
        relay.put("first")
        assert taken.acquire(timeout=LONG_S)
        relay.put("second")  # within the interval after "first" was taken: no wake
        relay.put(END)  # no flush: goes with "second" when the interval is over

    batches = _consume(interval, produce)
    assert [items for _, items in batches] == [["first"], ["second", END]]
    (first, _), (second, _) = batches
    assert second - first >= interval - TIMER_SLACK_S


def test_a_flush_ends_the_interval_at_once():
    def produce(relay, taken):
        relay.put("first")
        assert taken.acquire(timeout=LONG_S)  # the consumer took "first" and now waits out its interval
        relay.put(END)
        relay.flush()

    started = time.monotonic()
    batches = _consume(LONG_S, produce)
    assert [items for _, items in batches] == [["first"], [END]]
    assert time.monotonic() - started < LONG_S / 2


def test_a_cancelled_take_loses_nothing():
    async def main():
        relay = Relay(asyncio.get_running_loop(), 0)
        for _ in range(3):  # as a non-streaming request polls for its client between waits
            try:
                await asyncio.wait_for(relay.take(), 0.01)
            except TimeoutError:
                pass
        relay.put("late")  # no waiter any more: nothing is woken, nothing is lost
        relay.flush()
        return await asyncio.wait_for(relay.take(), LONG_S)

    assert asyncio.run(main()) == ["late"]


def test_an_interval_of_zero_wakes_on_every_put():
    def produce(relay, taken):
        for i in range(5):
            relay.put(i)
            assert taken.acquire(timeout=LONG_S)  # the next is put while the consumer waits for it
        relay.put(END)

    batches = _consume(0, produce)
    assert [items for _, items in batches] == [[0], [1], [2], [3], [4], [END]]

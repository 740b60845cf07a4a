"""``until_changed``: what wakes a long-poll, and what a wait leaves behind once it ends.

Ten thousand held joins or heartbeats wait on one job's ``changed`` future. Each wait
must end on the change, on its own hang-up, or at its timeout, and take nothing of its
own along with the future once it ends: a wait that left a callback on the shared
future would make every later one's clean-up O(waiters) (asyncio.wait's, which cost
1.1 s of CPU for 10,000 timed-out joins in one round).
"""

from __future__ import annotations

import asyncio

from rallypoint.service import _driver as driver


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_a_change_wakes_every_waiter_at_once() -> None:
    async def main() -> None:
        changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waits = [asyncio.ensure_future(driver.until_changed(changed, 60)) for _ in range(100)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waits)
        changed.set_result(None)
        done, pending = await asyncio.wait(waits, timeout=5)
        assert len(done) == 100 and not pending

    run(main())


def test_a_wait_that_times_out_leaves_nothing_behind() -> None:
    async def main() -> None:
        changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await asyncio.gather(*(driver.until_changed(changed, 0.01) for _ in range(100)))
        assert not changed.done()
        assert driver._waiters_of(changed) == set()

    run(main())


def test_another_future_wakes_its_own_waiter_alone() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        changed: asyncio.Future[None] = loop.create_future()
        gone: asyncio.Future[None] = loop.create_future()
        mine = asyncio.ensure_future(driver.until_changed(changed, 60, gone))
        theirs = asyncio.ensure_future(driver.until_changed(changed, 60))
        await asyncio.sleep(0)
        gone.cancel()  # a hang-up task ends cancelled: it wakes the wait as well
        await asyncio.wait_for(mine, 5)
        assert not theirs.done()
        assert len(driver._waiters_of(changed)) == 1
        theirs.cancel()

    run(main())


def test_a_cancelled_wait_leaves_nothing_behind() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        changed: asyncio.Future[None] = loop.create_future()
        gone: asyncio.Future[None] = loop.create_future()
        wait = asyncio.ensure_future(driver.until_changed(changed, 60, gone))
        await asyncio.sleep(0)
        wait.cancel()
        await asyncio.gather(wait, return_exceptions=True)
        assert driver._waiters_of(changed) == set()
        gone.set_result(None)  # its callback was taken back: nothing runs for the wait

    run(main())


def test_a_future_already_done_returns_at_once() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        changed: asyncio.Future[None] = loop.create_future()
        changed.set_result(None)
        await asyncio.wait_for(driver.until_changed(changed, 60), 1)
        fresh: asyncio.Future[None] = loop.create_future()
        other: asyncio.Future[None] = loop.create_future()
        other.set_result(None)
        await asyncio.wait_for(driver.until_changed(fresh, 60, other), 1)

    run(main())

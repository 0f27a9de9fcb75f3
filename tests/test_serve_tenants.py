"""Tenant admission (keys, concurrency, queue, tokens per minute) and engine-failure delivery."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from keel.errors import ConfigError
from keel.serve.async_engine import AsyncEngine, EngineDeadError
from keel.serve.openai.errors import APIError
from keel.serve.openai.tenants import KeyEntry, Tenants, load_keys_file


def tenants(**limits) -> Tenants:
    return Tenants([KeyEntry(key="k", tenant="t", **limits)])


def test_authentication():
    t = tenants()
    assert t.authenticate("Bearer k").name == "t"
    for bad in (None, "", "Bearer", "Bearer x", "Basic k", "k"):
        with pytest.raises(APIError) as e:
            t.authenticate(bad)
        assert e.value.status == 401
    assert Tenants([]).authenticate(None).name == "anonymous"  # no keys: open


def test_concurrency_queue_and_release():
    async def main():
        t = tenants(max_concurrent=1, max_queued=1)
        state = t.authenticate("Bearer k")
        first = await t.admit(state, 10, None)
        waiter = asyncio.create_task(t.admit(state, 10, None))  # queued behind the first
        await asyncio.sleep(0.01)
        assert not waiter.done() and t.num_queued == 1
        with pytest.raises(APIError) as e:  # the queue (1) is full
            await t.admit(state, 10, None)
        assert e.value.status == 429 and e.value.retry_after == 1
        first.release()
        second = await asyncio.wait_for(waiter, 1)
        assert state.active == 1 and t.num_queued == 0
        second.release()
        second.release()  # idempotent
        assert state.active == 0
        dropped = await t.admit(state, 10, None)
        assert state.active == 1
        del dropped  # never released: the garbage collector gives the slot back
        assert state.active == 0

    asyncio.run(main())


def test_queue_wait_respects_deadline():
    async def main():
        t = tenants(max_concurrent=1, max_queued=4)
        state = t.authenticate("Bearer k")
        held = await t.admit(state, 1, None)  # keep it: a dropped Admission gives its slot back
        loop_time = asyncio.get_running_loop().time
        start = loop_time()
        import time

        with pytest.raises(APIError) as e:
            await t.admit(state, 1, time.monotonic() + 0.2)
        assert e.value.status == 504 and 0.15 < loop_time() - start < 2 and t.num_queued == 0
        held.release()

    asyncio.run(main())


def test_tokens_per_minute_bucket_and_refund():
    async def main():
        t = tenants(tokens_per_minute=600)  # 10 tokens per second
        state = t.authenticate("Bearer k")
        with pytest.raises(APIError) as e:
            await t.admit(state, 601, None)  # larger than the whole budget
        assert e.value.status == 429
        a = await t.admit(state, 500, None)
        with pytest.raises(APIError) as e:
            await t.admit(state, 200, None)
        assert e.value.status == 429 and 9 <= e.value.retry_after <= 11  # 100 missing at 10/s
        a.release(unused_tokens=400)  # generated only 100 of its reservation: 400 come back
        b = await t.admit(state, 200, None)
        b.release()

    asyncio.run(main())


def test_keys_file_validation(tmp_path):
    good = tmp_path / "keys.toml"
    good.write_text('[[keys]]\nkey = "a"\ntenant = "x"\nmax_concurrent = 2\n[[keys]]\nkey = "b"\ntenant = "y"\n')
    assert [e.tenant for e in load_keys_file(good)] == ["x", "y"]
    cases = {
        "keys.toml": ('[[keys]]\nkey = "a"\ntenant = "x"\nmax_concurent = 2\n', "keys.0.max_concurent"),
        "neg.toml": ('[[keys]]\nkey = "a"\ntenant = "x"\ntokens_per_minute = 0\n', "tokens_per_minute"),
        "bad.json": ('{"keys": [{"key": "a"}]}', "keys.0.tenant"),
        "syntax.toml": ("[[keys]\n", "not valid TOML"),
        "clash.toml": ('[[keys]]\nkey="a"\ntenant="x"\nmax_queued=1\n[[keys]]\nkey="b"\ntenant="x"\n', "different"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / f"bad-{name}"
        path.write_text(text)
        with pytest.raises(ConfigError, match=expected):
            load_keys_file(path)
    r = subprocess.run(
        [sys.executable, "-m", "keel.cli", "serve", "x", "--api-keys-file", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.startswith("keel: error:") and "Traceback" not in r.stderr


class _FailingEngine:
    """Fails on its second step: every waiting client must get the error, none may hang."""

    tokenizer = None

    def __init__(self) -> None:
        self.steps = 0
        self.requests: list[str] = []

    def add_request(self, prompt, params=None, request_id=None, priority=0):
        self.requests.append(request_id)
        return request_id

    def abort_request(self, request_id):
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        self.steps += 1
        raise RuntimeError("device lost")

    def stats(self):
        return {"num_requests_waiting": 0}


def test_engine_failure_reaches_every_client():
    engine = AsyncEngine(_FailingEngine())

    async def consume():
        async for _ in engine.generate([1, 2], None):
            pass

    async def main():
        return await asyncio.wait_for(asyncio.gather(consume(), consume(), return_exceptions=True), 10)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
    assert not engine.alive
    with pytest.raises(EngineDeadError):
        asyncio.run(consume())

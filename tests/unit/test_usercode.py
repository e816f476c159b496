"""Where user code runs (rl_core.usercode) and the env.command record (rl_core.envs.service), on
real threads, loops, sockets and processes: a stuck call is named and does not hold the
interpreter's exit; a cancelled agent coroutine says where it awaited and is cancelled on its own
loop; an environment service that never answers misses the default-on episode deadline; a pid
file is acted on only for the processes it provably recorded. (The whole-run cases, through
`rl-core train`: tests/integration/test_user_code_hangs.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rl_core.envs.service import clean_up_left_behind, pid_file, session_members
from rl_core.errors import RecipeError
from rl_core.resilience import FailureKind, classify, with_deadline
from rl_core.usercode import DaemonPool, Heartbeat, UserLoop, mailbox, run_on, stuck_at

ROOT = Path(__file__).resolve().parents[2]


def test_a_stuck_pool_call_is_named_abandoned_and_replaced():
    release = threading.Event()
    pool = DaemonPool(1, "test-pool")

    def slow_judge():
        return release.wait()  # the judge never answers

    stuck = pool.submit(slow_judge)
    deadline = time.monotonic() + 5
    while pool.thread_of(stuck) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    thread = pool.thread_of(stuck)
    assert thread is not None and all(t.daemon for t in threading.enumerate() if t.ident == thread)
    where = stuck_at(thread)  # the user's frame, not the pool's or threading's
    assert where is not None and where.startswith(f"{__name__}.slow_judge (")
    assert where.endswith(": `return release.wait()  # the judge never answers`)"), where
    pool.abandon(stuck)
    assert pool.submit(lambda: 7).result(timeout=5) == 7  # a fresh thread took the stuck one's place
    release.set()
    assert stuck.result(timeout=5) is True


def test_a_call_that_never_returns_does_not_hold_the_exit():
    code = ("import time; from rl_core.usercode import DaemonPool; p = DaemonPool(1, 'x'); "
            "p.submit(time.sleep, 3600); time.sleep(0.2); print('done')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr


def test_a_cancelled_agent_says_where_it_awaited_and_is_cancelled_on_its_loop():
    loop = UserLoop("agent test")
    cancelled = threading.Event()

    async def agent():
        try:
            await asyncio.Event().wait()  # the agent awaits forever here
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        with pytest.raises(TimeoutError) as err:
            await with_deadline(loop.run(agent()), 0.3, "agent episode e1")
        return err.value

    try:
        exc = asyncio.run(main())
        assert str(exc).startswith(f"agent episode e1 missed its 0.3s deadline (it is stuck at {__name__}.agent (")
        assert "`await asyncio.Event().wait()  # the agent awaits forever here`" in str(exc)
        assert classify(exc) is FailureKind.INFRA and exc.stuck_at in str(exc)
        assert cancelled.wait(5)  # cancelled there, on the agents' loop
        assert asyncio.run(loop.run(asyncio.sleep(0, result=3))) == 3  # the loop serves the next episode
    finally:
        loop.close()


def test_run_on_crosses_loops_both_ways_and_a_burst_costs_one_wakeup():
    """`run_on`: results, errors and cancellation cross between two threads' loops; the calls a
    loop posts to another in one turn reach it in one wakeup (`Mailbox`), in the order posted."""
    loop = UserLoop("run_on test")
    there = loop.loop
    started, cancelled = threading.Event(), threading.Event()

    async def where_am_i(i):
        await asyncio.sleep(0)
        return i, asyncio.get_running_loop() is there

    async def fails():
        raise KeyError("from the other loop")

    async def hangs():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        box = mailbox(there)
        drains, wakeups = [], []
        real_drain, real_call = box._drain, there.call_soon_threadsafe

        def counted_drain():
            drains.append(len(box._calls))
            real_drain()

        def counted_call(*args):
            wakeups.append(args[0])
            return real_call(*args)

        gate = threading.Event()
        there.call_soon_threadsafe(gate.wait, 5)  # that loop is busy while the 50 calls are posted
        box._drain, there.call_soon_threadsafe = counted_drain, counted_call
        try:
            calls = [asyncio.ensure_future(run_on(there, where_am_i(i))) for i in range(50)]
            await asyncio.sleep(0)  # each call posted and waits
            gate.set()
            results = await asyncio.gather(*calls)
        finally:
            del box._drain, there.call_soon_threadsafe
        assert results == [(i, True) for i in range(50)]
        assert drains[0] == 50 and len(wakeups) == 1, (drains, len(wakeups))  # 50 posts, one wakeup
        with pytest.raises(KeyError, match="from the other loop"):
            await run_on(there, fails())
        task = asyncio.ensure_future(run_on(there, hangs()))
        assert await asyncio.to_thread(started.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(cancelled.wait, 5)  # cancelled there too
        assert await run_on(asyncio.get_running_loop(), where_am_i(7)) == (7, False)  # its own loop: awaited

    try:
        asyncio.run(main())
    finally:
        loop.close()


def test_a_blocked_loop_is_measured_and_named_from_another_thread():
    loop = UserLoop("blocking agent")
    try:
        beat = loop.heartbeat
        assert beat.poke() == 0.0
        time.sleep(0.1)
        assert beat.poke() == 0.0  # the loop ran the beat

        async def blocking():
            time.sleep(1.0)  # blocks its loop

        asyncio.run_coroutine_threadsafe(blocking(), loop.loop)
        time.sleep(0.2)
        beat.poke()
        time.sleep(0.5)
        blocked = beat.poke()
        where = stuck_at(beat.thread_id)
        assert 0.4 < blocked < 1.0, blocked
        assert where is not None and where.startswith(f"{__name__}.blocking (") and \
            where.endswith(": `time.sleep(1.0)  # blocks its loop`)"), where
    finally:
        loop.close()
    assert Heartbeat(asyncio.new_event_loop()).poke() == 0.0


class _NeverAnswers(BaseHTTPRequestHandler):
    release = threading.Event()

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        self.release.wait(30)

    def log_message(self, *args):
        pass


def test_an_http_service_that_never_answers_misses_the_episode_deadline(monkeypatch):
    from rl_core.envs.agent import HttpServiceEnv
    from rl_core.launch.preflight import load_recipe
    from tests.helpers.fakes import FakeChatTokenizer

    monkeypatch.chdir(ROOT)
    assert load_recipe("recipes/tiny-addition.yaml", ["env.type=http", "env.url=http://127.0.0.1:8765"]) \
        .env.episode_timeout_s == 300.0  # on by default
    assert load_recipe("recipes/tiny-addition.yaml", ["env.type=agent", "env.target=examples.agents.chain_agent:"
                                                      "chain_agent"]).env.episode_timeout_s == 300.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NeverAnswers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        cfg = load_recipe("recipes/tiny-addition.yaml", ["env.type=http", f"env.url={url}", "env.episode_timeout_s=1"])
        env = HttpServiceEnv(cfg.env, FakeChatTokenizer())

        async def episode():
            try:
                return await env.run_agent("http://127.0.0.1:1/sessions/x/v1", "key", {"prompt": "1+1="})
            finally:
                await env.aclose()

        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=f"environment service {url}: ReadTimeout") as err:
            asyncio.run(episode())
        assert time.monotonic() - t0 < 5 and classify(err.value) is FailureKind.INFRA
    finally:
        _NeverAnswers.release.set()
        server.shutdown()
        server.server_close()


def _record(proc: subprocess.Popen, url: str, controller: dict | None = None) -> dict:
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    start = int(stat[stat.rindex(")") + 2:].split()[19])
    cmdline = [a for a in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0") if a]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"pid": proc.pid, "start": start, "boot": boot, "cmdline": cmdline, "command": cmdline, "url": url,
            "controller": controller or {}}


def test_a_pid_file_is_acted_on_only_for_what_it_recorded(tmp_path):
    url = "http://127.0.0.1:1"  # a port no service uses: this test's own record
    path = pid_file(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        record = _record(sleeper, url)
        assert session_members(record) == [sleeper.pid]
        assert session_members({**record, "start": record["start"] - 1}) == []  # another process has the pid now
        assert session_members({**record, "cmdline": ["other"]}) == []
        assert session_members({**record, "boot": "another-boot"}) == []
        # the recorded controller still runs: the rerun refuses, naming env.url, and stops nothing
        live = {"pid": sleeper.pid, "start": record["start"]}
        path.write_text(json.dumps(_record(sleeper, url, controller=live)))
        with pytest.raises(RecipeError, match="env.url"):
            clean_up_left_behind(url, record["command"])
        assert sleeper.poll() is None and path.exists()
        # a record whose pid is now another process: nothing stopped, the stale record removed
        path.write_text(json.dumps({**record, "start": record["start"] - 1}))
        clean_up_left_behind(url, record["command"])
        assert sleeper.poll() is None and not path.exists()
        # the recorded service, its controller gone: stopped
        path.write_text(json.dumps(record))
        clean_up_left_behind(url, record["command"])
        assert sleeper.wait(15) is not None and not path.exists()
    finally:
        if sleeper.poll() is None:  # stop what this test started, by PID
            sleeper.kill()
            sleeper.wait()
        path.unlink(missing_ok=True)

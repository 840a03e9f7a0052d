"""The backend's framed execute server (backend/framed_exec.py) in process, with a short hello timeout:
a connection that says nothing is closed, one that said hello is not."""

from __future__ import annotations

import asyncio

from backend.framed_exec import start_framed_exec
from common.exec_frames import FrameKind, FrameReader, HEADER, hello
from common.security import Credentials


class NoExecutor:
    """Nothing here runs a request: these connections never send one."""

    engine = None
    in_flight = 0

    def work(self, item, now, done):
        raise AssertionError("no request was sent")


async def _frames_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> list:
    frames, parse = [], FrameReader()
    while True:
        data = await asyncio.wait_for(reader.read(65536), timeout_s)
        if not data:
            return frames
        frames += parse.feed(data)


def test_a_connection_without_a_hello_is_closed_and_one_with_it_is_kept():
    async def main():
        server = await start_framed_exec(NoExecutor(), "127.0.0.1", 0, Credentials(token="t"), hello_timeout_s=0.2)
        try:
            silent_r, silent_w = await asyncio.open_connection("127.0.0.1", server.port)
            frames = await _frames_until_closed(silent_r, 10)
            assert frames == [(FrameKind.DENIED, b"no hello in time")]
            silent_w.close()

            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(HEADER.pack(len(hello("t")), FrameKind.HELLO) + hello("t"))
            await asyncio.sleep(0.5)                       # past the hello timeout
            w.write(HEADER.pack(0, FrameKind.PING))
            parse, got = FrameReader(), []
            while len(got) < 2:
                got += parse.feed(await asyncio.wait_for(r.read(65536), 10))
            assert [k for k, _ in got] == [FrameKind.ACCEPTED, FrameKind.PONG]
            w.close()
        finally:
            server.close()

    asyncio.run(main())

"""A TCP proxy to a real server that moves at most BYTES_PER_S each way on each connection: a slow
network link, for real (the reload-or-recompute test reaches Redis through it).

    python throttle_proxy.py LISTEN_PORT TARGET_HOST TARGET_PORT BYTES_PER_S

Prints "ready" once it listens; runs until killed."""

from __future__ import annotations

import asyncio
import sys

_PIECE = 16384


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float) -> None:
    try:
        while data := await reader.read(_PIECE):
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(len(data) / rate)
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main(port: int, host: str, target_port: int, rate: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(host, target_port)
        await asyncio.gather(_pipe(client_r, server_w, rate), _pipe(server_r, client_w, rate))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))

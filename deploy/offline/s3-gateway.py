"""The offline stack's S3 endpoint: runs the SeaweedFS command given after ``--`` with every port on the
container's loopback, and forwards ``0.0.0.0:LISTEN`` to its S3 gateway on ``127.0.0.1:TARGET``.

SeaweedFS binds its S3 gateway's gRPC port (identity and policy updates, no credentials asked) to the
gateway's own address: other containers must reach the S3 API only. Exits with SeaweedFS's status when it
exits, and passes SIGTERM on to it.

    python3 s3-gateway.py LISTEN TARGET -- weed server ...
"""

import asyncio
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _forward(target: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target)
    except OSError:  # the gateway is not up yet: the client sees a closed connection and retries
        client_w.close()
        return
    await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))


async def main(listen: int, target: int, command: list[str]) -> int:
    weed = await asyncio.create_subprocess_exec(*command)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, weed.terminate)
    server = await asyncio.start_server(lambda r, w: _forward(target, r, w), "0.0.0.0", listen)
    async with server:
        return await weed.wait()


if __name__ == "__main__":
    listen, target, separator, *command = sys.argv[1:]
    if separator != "--" or not command:
        sys.exit(__doc__)
    sys.exit(asyncio.run(main(int(listen), int(target), command)))

"""Idle HTTP connections close on the client before the server closes them: a request sent on
a connection the server is closing fails with "Server disconnected" and counts as an
infrastructure error (seen once in CI: `generation/infra_errors` 1 in a clean run)."""

from __future__ import annotations

import asyncio
import inspect

import uvicorn

from rl_core.generation.http.fleet import CLIENT_KEEPALIVE_S, FleetPolicy, ServerFleet
from rl_core.launch import serve


def test_client_expiry_is_below_every_server_timeout():
    uvicorn_default = uvicorn.Config(app=None).timeout_keep_alive  # vLLM and plain OpenAI servers
    assert CLIENT_KEEPALIVE_S < uvicorn_default < serve.SERVER_KEEPALIVE_S
    # rl-core serve hands its timeout to uvicorn
    assert "timeout_keep_alive=SERVER_KEEPALIVE_S" in inspect.getsource(serve)


def test_fleet_client_uses_the_short_expiry_and_no_connection_cap():
    async def main():
        fleet = ServerFleet([], FleetPolicy(), {})
        fleet.open(api_key=None)  # an aiohttp session: opened on the running loop
        connector = fleet.client.connector
        try:
            return connector._keepalive_timeout, connector.limit
        finally:
            await fleet.close()

    expiry, limit = asyncio.run(main())
    assert expiry == CLIENT_KEEPALIVE_S and limit == 0  # 0: no cap (aiohttp's default would be 100)

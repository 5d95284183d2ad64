"""A reward service that misbehaves on purpose, chosen by each sample's response text (tests of the
remote client): ``python bad_server.py`` binds a free port on 127.0.0.1 and prints its URL.

Single form (the response text of the sample): ``500`` -> HTTP 500; ``junk`` -> non-JSON; ``shape``
-> ``{"score": 1}``; ``nan`` -> ``NaN``; ``string`` -> ``"0.5"``; ``slow`` -> answers after 3 s;
``flaky-503`` / ``flaky-drop`` -> the first two requests of that text get a 503 / a dropped
connection, then 0.75; ``endless`` -> a 200 whose body never ends (64 KiB chunks of spaces);
``trickle`` -> a 200 whose body comes one byte per 0.2 s; ``redirect`` -> HTTP 307 to ``/elsewhere``
(which would answer 1.0); anything else: ``{"reward": len(response)}``. Batched form: the list's first
response ``short-list`` -> a list one short; ``object`` -> an object instead of a list; ``errors``
-> ``{"error": ...}`` for every other entry; ``huge-values`` -> entry 1 a 401-digit integer, entry 2
``1e300``, entry 3 ``true``, the others ``len(response)``. The Authorization header seen last is kept for /seen.

``POST /mode/M`` applies one behaviour to every request (whole runs, whose responses are the
model's): ``M`` one of the single-form texts above (``500``, ``junk``, ``nan``, ...), ``alternate``
(every second request answers HTTP 500, the others ``len(response)``), ``delay`` (answers
``len(response)`` after 0.1 s) or ``alternate-delay`` (both: every answer after 0.1 s).
"""
import asyncio
import collections
import json
import socket
import sys

from aiohttp import web

COUNTS = collections.Counter()
SEEN = {"authorization": None}


def one(resp: str):
    if resp == "500":
        return web.Response(status=500, text="Internal Server Error: model crashed")
    if resp == "junk":
        return web.Response(text="<html>oops</html>", content_type="text/html")
    if resp == "shape":
        return web.json_response({"score": 1})
    if resp == "nan":
        return web.Response(text="NaN", content_type="application/json")
    if resp == "string":
        return web.json_response("0.5")
    return web.json_response({"reward": float(len(resp))})


async def endless(request, delay: float, chunk: bytes):
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    while True:  # until the client goes away
        await resp.write(chunk)
        await asyncio.sleep(delay)


async def reward(request):
    SEEN["authorization"] = request.headers.get("Authorization")
    body = json.loads(await request.read())
    if isinstance(body, list):
        first = body[0]["response"] if body else ""
        if first == "short-list":
            return web.json_response([1.0] * (len(body) - 1))
        if first == "object":
            return web.json_response({"rewards": [1.0] * len(body)})
        if first == "huge-values":
            entries = ["9" * 401, "1e300", "true"] + [str(len(b["response"])) for b in body[4:]]
            return web.Response(text="[" + ", ".join([str(len(body[0]["response"]))] + entries[:len(body) - 1]) + "]",
                                content_type="application/json")
        if first == "errors":
            return web.json_response([{"error": "cannot score"} if k % 2 else float(k) for k in range(len(body))])
        return web.json_response([float(len(b["response"])) for b in body])
    resp = body["response"]
    if resp == "slow":
        await asyncio.sleep(3)
    if resp in ("endless", "trickle"):
        return await endless(request, 0.0 if resp == "endless" else 0.2, b" " * (1 << 16) if resp == "endless" else b" ")
    if resp == "redirect":
        raise web.HTTPTemporaryRedirect("/elsewhere")
    if resp.startswith("flaky-"):
        COUNTS[resp] += 1
        if COUNTS[resp] <= 2:
            if resp == "flaky-503":
                return web.Response(status=503, text="warming up")
            request.transport.close()  # the connection drops without an answer
            return web.Response(text="")
        return web.json_response(0.75)
    return one(resp)


async def mode(request):
    m = request.match_info["mode"]
    body = json.loads(await request.read())
    resp = body["response"]
    if m.endswith("delay"):
        await asyncio.sleep(0.1)
    if m.startswith("alternate"):
        COUNTS["alternate"] += 1
        return one("500" if COUNTS["alternate"] % 2 == 0 else resp)
    if m == "delay":
        return one(resp)
    if m == "slow":
        await asyncio.sleep(3)
    return one(m)


async def elsewhere(request):
    return web.json_response({"reward": 1.0})


async def seen(request):
    return web.json_response(SEEN)


async def main():
    app = web.Application()
    app.router.add_post("/", reward)
    app.router.add_post("/elsewhere", elsewhere)
    app.router.add_post("/mode/{mode}", mode)
    app.router.add_get("/seen", seen)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}/", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)

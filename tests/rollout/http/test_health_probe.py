"""The health check at the start of every step (megaforge.rollout.http.recovery) asks the engine kind's
probe: SGLang's ``/server_info`` (a round trip to its scheduler; SGLang 0.5.16's ``/health_generate``
sleeps 1 s before it first looks, a second of every step), megaforge's embedded server's
``/health_generate``. Against the SGLang double (tests/sglang_double.py); the real server answers it
at every step of the GPU recipe (tools/gpu/h200_session.sh gsm_start)."""
import pytest
from aiohttp import web
from sglang_double import SGLangDouble

from megaforge.rollout.http import embedded_server, sglang
from megaforge.rollout.http.engine import HTTPEngine
from megaforge.rollout.http.recovery import EngineFailure


class Probed(SGLangDouble):
    """The double with the GET probes it answered recorded; ``/server_info`` answers 503 when ``down``."""

    def __init__(self):
        super().__init__()
        self.gets: list[str] = []
        self.down = False

    async def _server_info(self, request):
        self.gets.append(request.path)
        if self.down:
            return web.Response(status=503, text="scheduler not answering")
        return await super()._server_info(request)

    async def _health(self, request):
        self.gets.append(request.path)
        return await super()._health(request)


@pytest.fixture
def double():
    d = Probed().start()
    yield d
    d.stop()


def engine_of(d, servers=None):
    kw = {} if servers is None else {"health_probe": servers.health_probe}
    engine = HTTPEngine([d.url], health_timeout_s=5.0, **kw)
    d.gets.clear()  # the engine read /server_info once to learn the server's version
    return engine


def test_sglang_step_check_asks_server_info(double):
    engine = engine_of(double, sglang.SERVERS)
    try:
        engine.ensure_healthy()
        assert double.gets == ["/server_info"]
        double.down = True
        with pytest.raises(EngineFailure, match=r"health check: /server_info answered HTTP 503: scheduler not answering"):
            engine.ensure_healthy()
    finally:
        engine.shutdown()


def test_embedded_server_and_default_ask_health_generate(double):
    assert embedded_server.SERVERS.health_probe == "/health_generate"
    for servers in (embedded_server.SERVERS, None):
        engine = engine_of(double, servers)
        try:
            engine.ensure_healthy()
        finally:
            engine.shutdown()
        assert double.gets == ["/health_generate"]

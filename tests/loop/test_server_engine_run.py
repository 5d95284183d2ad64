"""The demo through the embedded engine's HTTP server (rollout.engine: embedded_server, the SGLang
protocol over real HTTP) runs the same RL steps as the in-process embedded engine: every
non-timing metric of every step is equal (same samples, same updates)."""
import pytest

from loop_helpers import launch, stable


@pytest.mark.slow
def test_embedded_server_run_equals_embedded_run(tmp_path):
    out = str(tmp_path)
    common = ["--max_steps", "3", "--deterministic", "true", "--rollout.device", "cpu"]
    direct = launch(out, "embedded", *common)
    served = launch(out, "server", *common, "--rollout.engine", "embedded_server")
    assert [r["step"] for r in served] == [1, 2, 3]
    assert all(r["health/engine_restarts"] == 0 for r in served)
    drop = ("time/", "throughput/", "health/engine_restarts")
    assert stable(served, drop) == stable(direct, drop)
    assert len(stable(direct, drop)[0]) >= 20  # the comparison covers the run's metrics, not a few keys

"""Whole CPU demo runs with a remote reward: the math reward served by python -m
megaforge.rewards.serve gives the same metrics as the local one on the same seed; a service down for a
step stops the run naming it; a service failing half its requests is counted and logged by URL; a
slow service streamed while generation continues shows the overlap in time/reward. The runs run in the
test's process (run_helpers.run_in_process); the services are processes of their own."""
import os
import socket

import pytest

from run_helpers import completed_in_process, lines, stable
from service_helpers import ROOT, bad_server, serve

DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
QUICK = ["--sft.max_steps", "0", "--rollout.batch_size", "4", "--grpo.n_samples", "2", "--rollout.max_new_tokens", "8",
         "--max_steps", "2"]


def launch(out, name, *args, ok=True):
    p = completed_in_process("grpo", ["--config", DEMO, "--metrics.progress", "false", "--metrics.tensorboard", "false",
                                      "--metrics.log_samples", "0", "--output_dir", str(out), "--run_name", name, *args])
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p, lines(os.path.join(out, name, "metrics.jsonl"))


def remote(url, **kw):
    extra = "".join(f", {k}: {v}" for k, v in kw.items())
    return f"[{{name: remote, label: math, url: '{url}', weight: 0.9{extra}}}, {{name: thinking, weight: 0.1}}]"


@pytest.mark.slow
def test_the_demo_with_its_math_reward_served_remotely_equals_the_local_one(tmp_path):
    """60 SFT steps (the model then answers some sums right) and 3 RL steps, twice: every metric but
    wall times is equal, reward/mean included (rewards are exact: 0.9 x {0, 1} + 0.1 x {0, 1})."""
    short = ["--sft.max_steps", "60", "--rollout.batch_size", "8", "--max_steps", "3"]
    _, local = launch(tmp_path, "local", *short)
    with serve("--fn", "math") as (url, _):
        _, served = launch(tmp_path, "served", *short, "--rewards.functions", remote(url, batch_size=4))
    print("\nreward/mean local ", [r["reward/mean"] for r in local], "\nreward/mean remote", [r["reward/mean"] for r in served])
    assert [r["reward/mean"] for r in served] == [r["reward/mean"] for r in local]
    assert stable(served) == stable(local)
    assert sum(r["reward/math"] for r in local) > 0 and all(r["reward/errors"] == 0 for r in served)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/"


def test_a_service_down_for_a_whole_step_stops_the_run_naming_it(tmp_path):
    url = dead_url()
    p, recs = launch(tmp_path, "down", *QUICK, "--rewards.functions", remote(url, retries=1, backoff_s=0.05), ok=False)
    assert p.returncode == 1 and not recs, p.stderr[-3000:]
    assert "reward 'math' failed on every sample of step 1 (8 calls" in p.stderr, p.stderr[-3000:]
    assert (f"failed on sample 7: RewardServiceError: {url}: unreachable after 2 attempt(s): ClientConnectorError"
            in p.stderr)
    assert "Traceback" not in p.stderr


def test_a_slow_service_failing_half_its_requests_counted_logged_and_overlapping_generation(tmp_path):
    """Each request takes 0.1 s, one at a time, and every second one answers HTTP 500: the failures
    are counted and logged by URL, the run goes on; streamed per prompt, most of the rewards' span
    lies inside the generation of the later prompts (time/reward - time/reward_wait)."""
    with bad_server() as (bad, _):
        url = bad + "mode/alternate-delay"
        p, recs = launch(tmp_path, "slow", "--sft.max_steps", "0", "--rollout.batch_size", "4", "--grpo.n_samples", "4",
                         "--rollout.max_new_tokens", "24", "--max_steps", "2", "--rewards.stream_prompts", "1",
                         "--rewards.workers", "1", "--rewards.functions", remote(url, max_concurrency=1))
    assert [r["step"] for r in recs] == [1, 2]
    out = p.stdout + p.stderr
    assert "[megaforge] step 1: reward 'math' (remote) failed on sample" in out
    assert f"RewardServiceError: {url}: HTTP 500: Internal Server Error: model crashed" in out
    for r in recs:
        assert r["reward/errors"] == 8 and r["reward/timeouts"] == 0, r
        # 16 requests of >= 0.1 s, one at a time: the span is at least 1.6 s
        assert r["time/reward"] >= 1.6 * 0.95, r  # 5%: timer slack
        overlap = r["time/reward"] - r["time/reward_wait"]
        # the span starts when the first prompt's samples are generated, the wait when the fourth's
        # are: the overlap is the generation of the last three prompts, about 3/4 of time/rollout
        assert overlap > 0.5 * r["time/rollout"], r

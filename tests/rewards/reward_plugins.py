"""Rewards used by tests/rewards (imported by the reward workers through their sys.path)."""
from __future__ import annotations

import math
import time

from megaforge.rewards import REWARDS


class BatchSize:
    """Batched: each value is the size of the batch it was scored in (so a test sees the batching);
    ``BAD`` responses fail alone (an Exception in the list), ``NAN`` ones return NaN."""

    def __init__(self, batch_size: int = 4, sleep_s: float = 0.0):
        self.batch_size, self.sleep_s = batch_size, sleep_s

    def __call__(self, prompt, response, target):
        return self.score_batch([prompt], [response], [target])[0]

    def score_batch(self, prompts, responses, targets):
        if any("HANG" in r for r in responses):
            time.sleep(3600)
        time.sleep(self.sleep_s)
        out = []
        for r in responses:
            if "BAD" in r:
                out.append(KeyError("bad sample"))
            elif "NAN" in r:
                out.append(math.nan)
            else:
                out.append(float(len(responses)))
        return out


class WrongLength(BatchSize):
    def score_batch(self, prompts, responses, targets):
        return [1.0] * (len(responses) + 1)


def length_rank(prompt, responses, target):
    """Group-level: the rank (0 = shortest) of each response's length within its group."""
    order = sorted(range(len(responses)), key=lambda i: (len(responses[i]), i))
    ranks = [0.0] * len(responses)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def group_wrong_length(prompt, responses, target):
    return [1.0]


def times_out(prompt, response, target):
    raise TimeoutError("service did not answer within 0.1 s")


def length(prompt, response, target):
    return float(len(response))


def slow_length(prompt, response, target):
    time.sleep(0.15)
    return float(len(response))


REWARDS.register("test_length_rank", length_rank, level="group")
REWARDS.register("test_group_wrong_length", group_wrong_length, level="group")
REWARDS.register("test_batch_size", BatchSize)


def raises_on_marker(prompt, response, target):
    if "RAISE" in response:
        raise ArithmeticError("cannot score this one")
    if "INF" in response:
        return math.inf
    return float(len(response))


def group_mean_centered(prompt, responses, target):
    """Group-level through its attribute (a package.module:callable plug-in has no registry entry):
    each response's length minus the group's mean length."""
    lens = [float(len(r)) for r in responses]
    return [x - sum(lens) / len(lens) for x in lens]


group_mean_centered.reward_level = "group"


def hang_or_length(prompt, response, target):
    """Hangs for good (as a stuck C call would) on responses with HANG, after writing its pid to the
    file ``target`` when that is a path; else the response's length."""
    if "HANG" in response:
        if isinstance(target, str) and target.startswith("/"):
            import os

            with open(target + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(target + ".tmp", target)
        while True:
            time.sleep(3600)
    return float(len(response))


def leaves_a_daemon(prompt, response, target):
    """Starts a daemon the classic way (fork, setsid, fork again, the middle one exits): it writes
    its pid to the file ``target`` and keeps writing there; the call returns once the file is there."""
    import os

    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            with open(target + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(target + ".tmp", target)
            while True:
                with open(target + ".beat", "a") as f:
                    f.write("x")
                time.sleep(0.2)
        os._exit(0)
    os.waitpid(pid, 0)
    while not os.path.exists(target):
        time.sleep(0.01)
    return 1.0


VALUES = {"str": "0.75", "bool": True, "none": None, "big": 1e300, "hugeint": 10 ** 400, "inf": math.inf,
          "int": 3, "negative": -2.5, "bound": 1e6}


def value_of(prompt, response, target):
    """Returns VALUES[response] (numpy.float32(0.5) for 'numpy'): the kinds of value a reward may return."""
    if response == "numpy":
        import numpy

        return numpy.float32(0.5)
    return VALUES[response]


class CrashOnRebuild:
    """hang_or_length, whose second build (a replacement worker's) crashes: exit status 3."""

    def __init__(self, marker: str):
        import os

        if os.path.exists(marker):
            os._exit(3)
        open(marker, "w").close()

    def __call__(self, prompt, response, target):
        return hang_or_length(prompt, response, target)

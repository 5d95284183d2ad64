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

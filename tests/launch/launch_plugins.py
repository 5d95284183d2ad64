"""A policy loss plug-in that raises on one rank mid-run (the rank-failure test): the real loss
(``ppo_clip``) until call ``MEGAFORGE_TEST_FAIL_CALL`` on rank ``MEGAFORGE_TEST_FAIL_RANK``."""
import os

from megaforge.algorithms.core import POLICY_LOSSES

_calls = 0


def fail_on_rank(*args, **kwargs):
    global _calls
    _calls += 1
    rank = int(os.environ.get("RANK", "0"))
    if rank == int(os.environ.get("MEGAFORGE_TEST_FAIL_RANK", "1")) and _calls >= int(os.environ.get("MEGAFORGE_TEST_FAIL_CALL", "2")):
        raise RuntimeError(f"injected failure on rank {rank} (loss call {_calls})")
    return POLICY_LOSSES.get("ppo_clip")(*args, **kwargs)


def slow_reward(prompt, response, target, delay_s: float = 0.3):
    """A reward that takes ``delay_s`` per sample (so a short run has steps long enough to be
    interrupted mid-run); scores like the math reward."""
    import time

    from megaforge.rewards import REWARDS

    time.sleep(delay_s)
    global _math
    if "_math" not in globals():
        _math = REWARDS.get("math")()
    return _math(prompt, response, target)

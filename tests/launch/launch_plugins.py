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

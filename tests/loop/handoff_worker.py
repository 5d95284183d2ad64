"""One rank of tests/loop/test_handoff.py: the step's training data path (megaforge.driver.steps.train_share)
on a fixed batch that the main rank builds, for three configs (GRPO: advantages on the main rank before
the hand-off; REINFORCE++-baseline with the KL in the reward, and PPO's gae with the critic: every rank
computes its share's advantages from its own old / reference log-probs or values, with the group and
whitening statistics of the whole batch). Writes what it received, held and computed to
``OUT/rank{R}.pt``.

argv: MODEL_DIR OUT"""
import os
import sys

import torch

from megaforge import collective
from megaforge.config import config_from_dict
from megaforge.data.batch import per_token_bytes, share_rows
from megaforge.driver.handoff import BatchHandOff
from megaforge.build import RunBuilder
from megaforge.driver.steps import train_share
from megaforge.trainer.torch_backend import TorchTrainer
from megaforge.types import Sample

B, PROMPT, RESPONSE, MINI_BATCHES = 8, 4, 6, 2  # every row is PROMPT + RESPONSE = 10 tokens long
CONFIGS = {
    "grpo": {"grpo": {"beta": 0.01}},
    "kl_in_reward": {"grpo": {"beta": 0.01}, "algo": {"advantage": "reinforce_pp_baseline", "kl_in_reward": True}},
    "gae": {"grpo": {"beta": 0.01}, "algo": {"advantage": "gae", "gamma": 0.9, "lam": 0.8}, "critic": {"lr": 1e-3}},
}


def config(model_dir: str, over: dict):
    d = {"model": {"path": model_dir, "dtype": "float32"}, "seed": 0, "max_steps": 0,
         "trainer": {"backend": "torch", "device": "cpu", "lr": 1e-3, "micro_batch_size": 2,
                     "mini_batches": MINI_BATCHES, "grad_clip": 1.0}}
    for sec, kv in over.items():
        d.setdefault(sec, {}).update(kv)
    return config_from_dict(d)


def whole_batch():
    """The main rank's batch: B samples in 2 groups, fixed by a seed (the same for every world size)."""
    from megaforge.data.batch import samples_to_batch

    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(B):
        ids = torch.randint(3, 500, (PROMPT + RESPONSE,), generator=g).tolist()
        lps = (-torch.rand(RESPONSE, generator=g)).tolist()
        samples.append(Sample(prompt_ids=ids[:PROMPT], response_ids=ids[PROMPT:], rollout_logprobs=lps,
                              group_id=i // 4, reward=float(i % 3)))
    return samples_to_batch(samples, pad_id=0)


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    collective.init_from_env("cpu", timeout_s=120)
    res = {}
    for name, over in CONFIGS.items():
        cfg = config(model_dir, over)
        torch.manual_seed(0)
        tr = TorchTrainer(RunBuilder(cfg).trainer_spec())
        tr.snapshot_reference()
        tr.reset_optimizer(cfg.trainer.lr, 1)
        if cfg.critic_enabled:
            tr.init_critic()
            with torch.no_grad():  # values that differ by token (a fresh head gives 0 everywhere)
                tr.critic.net.head.weight.normal_(0.0, 0.5)
        handoff = BatchHandOff(*tr.data_parallel(), cfg.trainer.mini_batches)
        m: dict = {}
        share = train_share(tr, handoff, whole_batch() if collective.is_main() else None,
                            RunBuilder(cfg).step_settings(), m)
        res[name] = {
            "received": handoff.received, "sent": handoff.sent, "per_token_bytes": per_token_bytes(share),
            "shape": tuple(share.tokens.shape), "metrics": m,
            "rows": share_rows(B, MINI_BATCHES, collective.rank(), collective.world()),
            "old_logprobs": share.old_logprobs, "ref_logprobs": share.ref_logprobs, "advantages": share.advantages,
            "values": share.values, "returns": share.returns,
        }
    # a batch too small for the ranks: every rank gets the same error (none waits in a collective)
    handoff = BatchHandOff(collective.rank(), collective.world(), MINI_BATCHES)
    small = whole_batch().select(slice(0, 2 * collective.world() - 1)) if collective.is_main() else None
    try:
        handoff.share(small)
        res["too_small"] = None
    except ValueError as e:
        res["too_small"] = str(e)
    # model-parallel peers (pairs of ranks as one DP rank): a sum over the DP ranks counts each once
    dp_rank, dp_size = (collective.rank() // 2, collective.world() // 2) if collective.world() > 1 else (0, 1)
    peers = BatchHandOff(dp_rank, dp_size, MINI_BATCHES)
    res["peer_sums"] = peers.batch_sum(torch.tensor([1.0, float(dp_rank)], dtype=torch.float64)).tolist()
    torch.save(res, os.path.join(out, f"rank{collective.rank()}.pt"))
    collective.barrier()


if __name__ == "__main__":
    main()

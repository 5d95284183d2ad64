"""Helpers of the algorithm tests: small hand-made tensors and tiny in-process runs of the CPU demo."""
from __future__ import annotations

import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

# the smallest settings that still exercise every part of an RL step on the CPU demo
SMOKE = ["--max_steps", "2", "--sft.max_steps", "2", "--sft.batch_size", "8", "--rollout.batch_size", "2",
         "--grpo.n_samples", "4", "--rollout.max_new_tokens", "16", "--trainer.micro_batch_size", "8",
         "--metrics.progress", "false", "--metrics.tensorboard", "false", "--metrics.log_samples", "0",
         "--checkpoint.interval", "0"]


def padded_batch():
    """A TrainBatch of 4 random rows of lengths 9, 6, 8, 4 (pad 0), loss on positions 3..len-1, zero
    advantages and rollout logprobs."""
    from megaforge.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 6, 8, 4])
    tokens = torch.randint(3, 500, (4, 9), generator=g)
    mask = torch.zeros(4, 9)
    for b, n in enumerate(lengths.tolist()):
        tokens[b, n:] = 0
        mask[b, 3:n] = 1
    b = TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=torch.zeros(4, 9),
                   rollout_logprobs=torch.zeros(4, 9))
    b.num_tokens, b.num_seqs = int(mask.sum()), 4
    return b


def lp_for_ratio(ratios, old):
    """Leaf logprobs with gradient such that exp(logp - old) == ratios."""
    old = torch.as_tensor(old, dtype=torch.float64)
    return (old + torch.log(torch.as_tensor(ratios, dtype=torch.float64))).clone().requires_grad_(True)


def params(**kw):
    """ObjectiveParams from flat values named like the config keys (``clip_low``, ``sapo_tau_pos``, ...)."""
    from megaforge.algorithms import ObjectiveParams

    return ObjectiveParams.of_values(**kw)


def run_launcher(mode: str, argv: list[str], out_dir: str, run_name: str) -> str:
    """Run a launcher in this process (exactly what launchers/*.py do); returns the run directory."""
    from megaforge.launch import main

    main(mode, argv + ["--output_dir", out_dir, "--run_name", run_name])
    return os.path.join(out_dir, run_name)


def read_metrics(run_dir: str, name: str = "metrics.jsonl") -> list[dict]:
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(line) for line in f]


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def length_reward(prompt: str, response: str, target) -> float:
    """A reward plug-in that is never constant on the random demo model (so every step has a
    policy gradient): the response length in characters / 100."""
    return len(response) / 100.0


# every algorithm run uses it, so that losses, gradients and the critic are not trivially zero
VARIED_REWARD = ["--rewards.functions", "[{name: 'algo_helpers:length_reward'}]"]


TINY_TORCH = ["--config", f"{ROOT}/configs/demo_cpu.yaml", "--model.config", f"{ROOT}/configs/models/tiny-qwen2",
              "--model.tokenizer", f"{ROOT}/assets/tiny-tokenizer", "--trainer.device", "cpu", "--grpo.temperature", "0.8"]


def tiny_torch_trainer(*extra):
    """A TorchTrainer of the demo's tiny Qwen2 on the CPU (no engine), with ``extra`` flags."""
    from megaforge.config import load_config
    from megaforge.build import RunBuilder
    from megaforge.trainer.torch_backend import TorchTrainer

    return TorchTrainer(RunBuilder(load_config(TINY_TORCH + list(extra))).trainer_spec(), None)


def rl_batch(B: int = 8, seed: int = 0):
    """B rows of lengths 5..20 in no order, prompts of 2-5 tokens, loss on the response, random
    advantages, pi_old / reference / rollout log-probs near -4."""
    from megaforge.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 21, (B,), generator=g)
    prompt = torch.randint(2, 5, (B,), generator=g)
    T = int(lengths.max())
    t = torch.arange(T)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(3, 500, (B, T), generator=g), 0)
    mask = ((t >= prompt[:, None]) & (t < lengths[:, None])).float()

    def near(scale):
        return (-4.0 + scale * torch.randn(B, T, generator=g)) * mask

    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask,
                      advantages=torch.randn(B, 1, generator=g) * mask, rollout_logprobs=near(0.3),
                      old_logprobs=near(0.3), ref_logprobs=near(0.5),
                      num_tokens=int(mask.sum()), num_seqs=int((mask.sum(-1) > 0).sum()))

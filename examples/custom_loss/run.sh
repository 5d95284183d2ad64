#!/usr/bin/env bash
# Two RL steps of the CPU demo (after a 2-step SFT warm start) with the seed's custom loss,
# registered by name from examples/custom_loss/seed_loss.py. Run from the repository root;
# extra arguments are passed on (e.g. --run_name other --max_steps 30).
set -euo pipefail
python launchers/grpo.py --config configs/demo_cpu.yaml --run_name custom_loss \
  --algo.plugins '[examples.custom_loss.seed_loss]' --algo.loss seed_custom \
  --algo.plugin_kwargs '{clip_range: 0.2}' --grpo.beta 0.1 --algo.kl_estimator k1 \
  --max_steps 2 --sft.max_steps 2 "$@"

#!/usr/bin/env bash
# Two RL steps of the CPU demo (after a 2-step SFT warm start) with torchforge's custom loss of
# examples/custom_loss/seed_loss.py, configured by seed_loss.yaml. Run from the repository root;
# extra arguments are passed on (e.g. --run_name other --max_steps 30 --algo.seed_custom_clip_range 0.1).
set -euo pipefail
python launchers/grpo.py --config examples/custom_loss/seed_loss.yaml "$@"

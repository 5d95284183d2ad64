"""GRPO (and every other RL algorithm) entry point.

    python launchers/grpo.py --config configs/demo_cpu.yaml [--key value ...]           # one process
    torchrun --nproc_per_node N launchers/grpo.py --config X.yaml [--key value ...]     # N ranks

``--help`` lists every config key. Run under torchrun (or plain python for one process).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaforge.launch import main  # noqa: E402

if __name__ == "__main__":
    main("grpo")

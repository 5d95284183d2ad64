"""GRPO (and every other RL algorithm) entry point.

    torchrun --nproc_per_node 1 launchers/grpo.py --config configs/demo_cpu.yaml [--key value ...]

``--help`` lists every config key. Run under torchrun (or plain python for one process).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaforge.launch import main  # noqa: E402

if __name__ == "__main__":
    main("grpo")

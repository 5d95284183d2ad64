"""Supervised fine-tuning entry point (the same code as the GRPO demo's warm start).

    torchrun --nproc_per_node 1 launchers/sft.py --config configs/sft_cpu.yaml [--key value ...]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaforge.launch import main  # noqa: E402

if __name__ == "__main__":
    main("sft")

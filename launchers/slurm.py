"""SLURM jobs (and local ones) through submitit: one torchrun per node, checkpoint + requeue on
preemption or time-out (megaforge.slurm has the details).

    python launchers/slurm.py --nodes 1 --gpus_per_node 8 --partition P --account A --time 24:00:00 \
        --config configs/grpo_gsm8k_qwen3_1.7b.yaml [--qos Q] [--launcher sft] [--key value ...]
    python launchers/slurm.py --cluster local --nodes 1 --gpus_per_node 1 --time 00:30:00 \
        --config configs/demo_cpu.yaml      # submitit's local executor: the same path, on this machine

``--print_sbatch`` prints the sbatch script instead of submitting; ``--wait`` waits for the job.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaforge.slurm import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

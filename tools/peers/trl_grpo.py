#!/usr/bin/env python
"""TRL 1.16.0's GRPOTrainer on megaforge's recipe: the mapped GRPOConfig (tools/peers/mapping.py), megaforge's
prompts in megaforge's order (tools/peers/peer_data.py's train.jsonl) and megaforge's math reward
(tools/peers/peer_reward.py), with one schema line per megaforge-sized step (tools/peers/schema.py).

    python tools/peers/trl_grpo.py --config configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml --data D/train.jsonl --steps 20 \
        --out_dir O --run hold2-mapped [--use_vllm] [--variant defaults] [--save_every 10] [--model.path M ...any megaforge override]

Writes ``O/trl_steps.jsonl``: a ``startup`` record (process start, or ``--launch_t``, to the first step's
start) and a ``step`` record each ``trainer.mini_batches`` optimizer steps (= one generation of
``rollout.batch_size x grpo.n_samples`` samples: one megaforge step). Phases, timed by wrapping the
trainer's own methods (device synchronised before each clock read on CUDA):

* ``rollout_s``: ``_generate`` (HF ``generate``, or vLLM colocate: then its weight load is ``sync_s``,
  timed around ``vllm_generation.sync_weights``, and taken out of ``rollout_s``)
* ``reward_s``: ``_calculate_rewards``
* ``pi_old_s``: ``_get_per_token_logps_and_entropies`` called without gradients (the old policy's
  log-probs, recomputed since gradient_accumulation_steps % steps_per_generation != 0)
* ``update_s``: the rest of the step outside ``_generate_and_score_completions`` (forward + backward of
  every micro-batch, the optimizer steps); ``other_s``: tokenisation, padding and advantages (inside
  ``_generate_and_score_completions``, outside the above)
* ``tokens``: prompt + completion tokens of the generation (its masks)
* ``rows_in_order``: the generation's prompts were rows ``(step - 1) x batch .. step x batch - 1`` of the
  file, i.e. the prompts megaforge's step ``step`` trains on (``rows``: the first and last)

Checkpoints (HF folders, ``save_only_model``) every ``--save_every`` megaforge steps under
``O/checkpoint-<4 x step>``, for tools/evaluate.py. Without ``model.path`` the model is megaforge's
seeded random init of ``model.config`` (a tiny model on a CPU: the smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, ROOT]


def _process_start() -> float:
    try:
        import psutil
        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil missing: the script's first line is close enough
        return time.time()


class PhaseTimer:
    """Wraps a GRPOTrainer's methods to time its phases and writes one schema record per megaforge step.
    ``updates`` optimizer steps make one megaforge step."""

    def __init__(self, trainer, updates: int, out_path: str, run: str, launch_t: float, batch: int, n_gpus: int = 1):
        import torch
        from transformers import TrainerCallback
        self.trainer, self.updates, self.out_path, self.run = trainer, updates, out_path, run
        self.launch_t, self.n_gpus = launch_t, n_gpus
        self.cuda = torch.cuda.is_available()
        self.torch = torch
        self.opt_steps, self.step, self.wall, self.start = 0, 0, 0.0, None
        self.rows: list[int] = []  # dataset rows of the current step's generation
        self.batch = batch
        self.cur = self._fresh()
        self._wrap("_generate", "rollout_s")
        self._wrap("_calculate_rewards", "reward_s")
        self._wrap("_get_per_token_logps_and_entropies", "pi_old_s", only=lambda: not torch.is_grad_enabled())
        self._wrap("_generate_and_score_completions", "gen_score_s", only=lambda: trainer.model.training,
                   post=self._count_tokens, pre=self._note_rows)
        vg = getattr(trainer, "vllm_generation", None)
        if vg is not None and hasattr(vg, "sync_weights"):
            self._wrap("sync_weights", "sync_s", obj=vg)
        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer.on_step_begin()

            def on_step_end(self, args, state, control, **kw):
                timer.on_step_end()

        trainer.add_callback(_Callback())
        open(out_path, "w").close()

    @staticmethod
    def _fresh() -> dict:
        return {"rollout_s": 0.0, "reward_s": 0.0, "pi_old_s": 0.0, "gen_score_s": 0.0, "sync_s": 0.0, "tokens": 0.0}

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def _wrap(self, name: str, key: str, only=None, post=None, obj=None, pre=None):
        obj = obj if obj is not None else self.trainer
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if only is not None and not only():
                return fn(*args, **kwargs)
            if pre is not None:
                pre(*args, **kwargs)
            t0 = self.now()
            out = fn(*args, **kwargs)
            self.cur[key] += self.now() - t0
            if post is not None:
                post(out)
            return out

        setattr(obj, name, timed)

    def _note_rows(self, inputs, *args, **kwargs) -> None:
        """The dataset rows (``index`` column) the generation was given, each once, in order."""
        for x in inputs:
            i = x.get("index") if isinstance(x, dict) else None
            if i is not None and (not self.rows or self.rows[-1] != i):
                self.rows.append(int(i))

    def _count_tokens(self, out) -> None:
        for k in ("prompt_mask", "completion_mask"):
            if isinstance(out, dict) and k in out:
                self.cur["tokens"] += float(out[k].sum())

    def _emit(self, rec: dict) -> None:
        with open(self.out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print("[trl_grpo] " + json.dumps(rec), flush=True)

    def on_step_begin(self) -> None:
        if self.start is None:
            self.start = self.now()
            if self.step == 0:
                self._emit({"kind": "startup", "system": "trl", "run": self.run,
                            "startup_s": max(time.time() - self.launch_t, 0.0), "includes": "model load, trainer set-up"})

    def on_step_end(self) -> None:
        from schema import step_record
        self.opt_steps += 1
        if self.opt_steps % self.updates:
            return
        c, step_s = self.cur, self.now() - self.start
        self.step += 1
        self.wall += step_s
        rollout = c["rollout_s"] - c["sync_s"]  # vLLM's weight load runs inside _generate
        other = max(c["gen_score_s"] - c["rollout_s"] - c["reward_s"] - c["pi_old_s"], 0.0)
        rec = step_record("trl", self.run, self.step, step_s=step_s, n_gpus=self.n_gpus, rollout_s=rollout,
                          reward_s=c["reward_s"], pi_old_s=c["pi_old_s"], update_s=max(step_s - c["gen_score_s"], 0.0),
                          sync_s=c["sync_s"], tokens=c["tokens"], first=self.step == 1, train_wall_s=self.wall,
                          other_s=other, optimizer_steps=self.opt_steps, rows=[self.rows[0], self.rows[-1]] if self.rows else None,
                          rows_in_order=self.rows == list(range((self.step - 1) * self.batch, self.step * self.batch)))
        self._emit(rec)
        self.cur, self.start, self.rows = self._fresh(), None, []


def read_rows(path: str, n: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                r = json.loads(line)
                if "prompt" not in r or "answer" not in r:
                    raise ValueError(f"{path}:{i}: a row needs 'prompt' and 'answer' (tools/peers/peer_data.py writes them)")
                rows.append({"prompt": r["prompt"], "answer": str(r["answer"]), "index": len(rows)})
            if len(rows) == n:
                break
    if len(rows) < n:
        raise ValueError(f"{path}: {len(rows)} rows, the run needs {n} (steps x rollout.batch_size): write more with "
                         f"peer_data.py --steps")
    return rows


def main(argv=None) -> int:
    launch_default = _process_start()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="train.jsonl of tools/peers/peer_data.py")
    p.add_argument("--steps", type=int, required=True, help="megaforge steps (each = trainer.mini_batches TRL optimizer steps)")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--run", default="trl")
    p.add_argument("--save_every", type=int, default=10, help="megaforge steps between HF checkpoints (0: none)")
    p.add_argument("--use_vllm", action="store_true", help="vLLM colocate generation (needs vllm 0.22-0.31)")
    p.add_argument("--variant", default="mapped", choices=["mapped", "defaults"],
                   help="defaults: TRL's own gradient checkpointing (on) and micro-batch (8 rows) (tools/peers/mapping.py)")
    p.add_argument("--launch_t", type=float, default=launch_default, help="epoch seconds of the launch")
    a, rest = p.parse_known_args(argv)
    try:
        import datasets
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"megaforge: error: TRL is not importable ({e}): pip install --target DIR trl==1.16.0 --no-deps and put "
              f"DIR on PYTHONPATH", file=sys.stderr)
        return 2
    import torch
    from mapping import MappingError, geometry, trl_kwargs
    from megaforge.config import ConfigError, load_config
    from megaforge.hf import load_hf_model, load_tokenizer
    from peer_reward import trl_math_reward
    try:
        cfg = load_config(rest)
        g = geometry(cfg)
        rows = read_rows(a.data, a.steps * cfg.rollout.batch_size)
    except (ConfigError, MappingError) as e:
        print(f"megaforge: config error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"megaforge: error: {e}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    os.makedirs(a.out_dir, exist_ok=True)
    tok = load_tokenizer(cfg.model)
    kw = trl_kwargs(cfg, a.steps, a.out_dir, a.use_vllm, a.save_every, bf16=cuda, variant=a.variant)
    if not cuda:
        kw["use_cpu"] = True
    if cfg.model.path:
        model = cfg.model.path
        kw["model_init_kwargs"] = {"dtype": torch.float32, "attn_implementation": cfg.model.attn_implementation}
    else:  # megaforge's seeded random init of model.config (the CPU smoke test)
        model = load_hf_model(cfg.model, torch.device("cuda" if cuda else "cpu"), torch.float32)
    args = GRPOConfig(**kw)
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_math_reward], args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    out_path = os.path.join(a.out_dir, "trl_steps.jsonl")
    PhaseTimer(trainer, g["updates"], out_path, a.run, a.launch_t, cfg.rollout.batch_size)
    print(f"[trl_grpo] trl {trl.__version__}, {len(rows)} prompts, {a.steps} steps = {kw['max_steps']} optimizer steps, "
          f"generation {g['samples']} samples, micro-batch {kw['per_device_train_batch_size']}, accumulation "
          f"{kw['gradient_accumulation_steps']}, use_vllm {a.use_vllm}", flush=True)
    trainer.train()
    print(f"[trl_grpo] done: {out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

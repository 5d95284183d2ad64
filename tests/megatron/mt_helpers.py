"""Helpers of the Megatron backend tests: tiny HF models, a shared batch, multi-process launches.

Imported by ``conftest.py`` (fixtures), the test modules and ``worker.py`` (the spawned ranks).

Multi-rank checks run ``tests/megatron/worker.py`` in N fresh processes joined by a gloo process
group on 127.0.0.1 (a free port per launch, OMP_NUM_THREADS=1, a hard timeout); several checks share
one launch to amortise start-up. Workers write their results with ``torch.save``; the test process
computes the references (Hugging Face transformers) and compares.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "megatron", "worker.py")
VOCAB = 250  # not a multiple of 128: Megatron pads it


def _shared():
    """tests/conftest.py (make_tiny_model, free_port), loaded by path: every test directory has a
    module named ``conftest``."""
    if "_megaforge_tests_conftest" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_megaforge_tests_conftest", os.path.join(ROOT, "tests", "conftest.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["_megaforge_tests_conftest"] = mod
    return sys.modules["_megaforge_tests_conftest"]


def run_ranks(argv: list[str], nprocs: int, workdir, name: str, timeout: float = 300.0) -> tuple[list[int], list[str]]:
    """Run ``python argv...`` as ``nprocs`` ranks of one gloo world (torchrun's environment variables,
    a free port, OMP_NUM_THREADS=1). Stops every rank on the first failure or at ``timeout``.
    Returns (exit codes, log texts); raises with the logs' tails on a timeout."""
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    port = _shared().free_port()
    procs, paths = [], []
    for r in range(nprocs):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nprocs),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
        paths.append(os.path.join(workdir, f"{name}.rank{r}.log"))
        with open(paths[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable] + argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    deadline = time.time() + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the peers notice; then stop them
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = []
    for path in paths:
        with open(path) as f:
            logs.append(f.read())
    if timed_out:
        raise AssertionError(f"{name} on {nprocs} ranks timed out after {timeout:.0f} s\n" + tails(logs))
    return [p.returncode for p in procs], logs


def tails(logs: list[str], n: int = 40) -> str:
    return "\n".join(f"--- rank {r} ---\n" + "\n".join(t.splitlines()[-n:]) for r, t in enumerate(logs))


def run_workers(scenario: str, nprocs: int, spec: dict, workdir, timeout: float = 300.0, worker: str = WORKER) -> list:
    """Run ``worker scenario`` (default ``worker.py``) on ``nprocs`` ranks; returns each rank's result object."""
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    spec_file = os.path.join(workdir, f"{scenario}.json")
    with open(spec_file, "w") as f:
        json.dump(spec, f)
    codes, logs = run_ranks([worker, scenario, spec_file, workdir], nprocs, workdir, scenario, timeout)
    if any(codes):
        raise AssertionError(f"{scenario} on {nprocs} ranks: exit codes {codes}\n" + tails(logs))
    return [torch.load(os.path.join(workdir, f"{scenario}.rank{r}.pt"), weights_only=False) for r in range(nprocs)]


def save_rank_result(res, outdir: str, name: str) -> None:
    """In a worker rank: save ``res`` as ``<outdir>/<name>.rank<RANK>.pt`` (what :func:`run_workers`
    reads), wait for the other ranks and leave the process group."""
    rank = int(os.environ["RANK"])
    torch.save(res, os.path.join(outdir, f"{name}.rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def worker_main(scenarios: dict) -> None:
    """A worker rank's entry point: ``argv`` = scenario name, spec JSON file, output folder; runs
    ``scenarios[name](spec, res)`` (or ``(spec, res, outdir)`` where it takes three) and saves ``res``."""
    import inspect
    import json
    import sys

    name, spec_file, outdir = sys.argv[1:4]
    with open(spec_file) as f:
        spec = json.load(f)
    res: dict = {}
    fn = scenarios[name]
    fn(spec, res, outdir) if len(inspect.signature(fn).parameters) == 3 else fn(spec, res)
    save_rank_result(res, outdir, name)


def make_tiny(kind: str, path: str, tied: bool = False) -> str:
    """A 4-layer random HF model of family ``kind`` (tests/conftest.make_tiny_model, vocabulary
    250, Qwen3 with head_dim 24 != hidden / heads), norms and biases perturbed so they matter."""
    import transformers

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    kw = dict(vocab=VOCAB, tie=tied, num_hidden_layers=4, intermediate_size=96, max_position_embeddings=128,
              rms_norm_eps=1e-6, seed={"llama": 1, "qwen2": 2, "qwen3": 3}[kind])
    if kind == "qwen3":
        kw["head_dim"] = 24
    _shared().make_tiny_model(path, kind, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(kw["seed"])
    with torch.no_grad():  # HF inits norms to ones and biases to zero
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


MODELS = {"llama_tied": ("llama", True), "qwen2": ("qwen2", False), "qwen3": ("qwen3", False)}


def make_batch(B: int = 5, T: int = 20, seed: int = 0, lengths=(20, 7, 13, 3, 17), vocab: int = VOCAB):
    """A right-padded RL TrainBatch of token ids below ``vocab``: prompt of 2..4 tokens, the rest
    trained; random advantages, rollout / old logprobs near plausible values."""
    from megaforge.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths[:B])
    tokens = torch.randint(0, vocab, (B, T), generator=g)
    t = torch.arange(T)[None]
    tokens = torch.where(t < lengths[:, None], tokens, 0)
    prompt = torch.randint(1, 4, (B,), generator=g).clamp(max=lengths - 1)
    loss_mask = ((t >= prompt[:, None]) & (t < lengths[:, None])).float()
    adv = torch.randn(B, generator=g)[:, None].expand(B, T) * loss_mask
    rollout = (-5.5 + 0.3 * torch.randn(B, T, generator=g)) * loss_mask
    old = (-5.5 + 0.3 * torch.randn(B, T, generator=g)) * loss_mask
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=loss_mask, advantages=adv.contiguous(),
                      rollout_logprobs=rollout, old_logprobs=old,
                      num_tokens=int(loss_mask.sum()), num_seqs=int((loss_mask.sum(-1) > 0).sum()))


def hf_logprobs(path: str, batch, temperature: float = 1.0) -> torch.Tensor:
    """Token-aligned logprobs [B, T] of the HF model, each row run unpadded (megaforge's
    ``token_logprobs`` oracle), float32."""
    import transformers

    return model_logprobs(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), batch, temperature)


def model_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """Token-aligned logprobs [B, T] of an HF-style ``model`` (``model(ids).logits``), each row run unpadded."""
    from megaforge.trainer.logprobs import token_logprobs

    out = torch.zeros(batch.tokens.shape)
    with torch.no_grad():
        for b in range(batch.batch_size):
            n = int(batch.lengths[b])
            logits = model(batch.tokens[b:b + 1, :n]).logits
            out[b, :n] = token_logprobs(logits, batch.tokens[b:b + 1, :n], batch.lengths[b:b + 1], temperature)[0][0]
    return out


def trainer_cfg(model_path: str, backend: str = "megatron", layout: dict | None = None, dtype: str = "float32",
                **trainer):
    """The megaforge Config of these tests (fp32, temperature 0.8, Adam eps 1e-6: with eps 1e-8,
    parameters whose gradient is ~1e-8 (e.g. k_proj under q/k norm) move by lr * g / (|g| + eps),
    which float32 rounding of g alone changes by ~1e-4, for any two implementations)."""
    from megaforge.config import config_from_dict

    layout = layout or {}
    t = dict(backend=backend, device="cpu", lr=1e-3, eps=1e-6, micro_batch_size=2, grad_clip=1.0)
    if backend == "megatron":
        t.update(layer_spec="torch", tensor_parallel=layout.get("tp", 1), pipeline_parallel=layout.get("pp", 1),
                 context_parallel=layout.get("cp", 1), sequence_parallel=layout.get("sp", False),
                 distributed_optimizer=layout.get("dist_opt", True))
    t.update(trainer)
    return config_from_dict({"model": {"path": model_path, "dtype": dtype}, "trainer": t,
                             "grpo": {"temperature": 0.8}, "max_steps": 0, "seed": 0})


def torch_backend_reference(model_path: str, batch, steps, **trainer):
    """The torch backend (single process) on the same batch: ``steps`` is a list of "rl" / "sft";
    returns ([metrics], [HF state dict after each step])."""
    from megaforge.build import RunBuilder
    from megaforge.trainer.torch_backend import TorchTrainer

    tr = TorchTrainer(RunBuilder(trainer_cfg(model_path, "torch", **trainer)).trainer_spec())
    metrics, states = [], []
    for kind in steps:
        metrics.append(tr.train_step(batch) if kind == "rl" else tr.sft_step(batch))
        states.append({k: v.detach().clone() for k, v in tr.model.state_dict().items()})
    return metrics, states

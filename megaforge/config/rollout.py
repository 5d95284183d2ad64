"""Config section of the rollout engines and sampling (``rollout:``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megaforge.configtree import bounded
from megaforge.engine_kinds import engine_kind_names


@dataclass
class RolloutConfig:
    engine: str = field(default="embedded", metadata={"choices": engine_kind_names})
    """Rollout engine: HF transformers in-process (embedded), the same behind HTTP
    (embedded_server), or SGLang servers (the kinds registered in megaforge.engine_kinds)."""
    batch_size: int = 16
    """Prompts per RL step (each sampled grpo.n_samples times)."""
    max_new_tokens: int = 128
    """Maximum response length."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (in addition to the tokenizer's end-of-turn / EOS tokens)."""
    device: str = "auto"
    """Device of the embedded engine: auto | cpu | cuda | cuda:N."""
    engine_batch_size: int = 256
    """Maximum sequences the embedded engine decodes at once."""
    fast: Literal["auto", "on", "off"] = "auto"
    """Fast decode path of the embedded engine (static KV cache, continuous refill, CUDA graphs;
    megaforge/rollout/embedded/fast): auto = on CUDA devices for Llama / Qwen2 / Qwen3, on = always (CPU: no
    graphs), off = the simple HF DynamicCache loop."""
    fast_compile: Literal["auto", "inductor", "off"] = "auto"
    """torch.compile of the fast path's per-layer decode pieces (norms, projections, rotary, MLP; the
    graphs replay the compiled kernels): auto = inductor on CUDA (1.3-1.5x the tokens/s on the H200,
    docs/benchmarks; a one-off compilation of ~10 s per process), off on the CPU; off = the HF modules."""
    fast_attention: Literal["auto", "sdpa", "matmul"] = "auto"
    """Decode attention of the fast path: sdpa (``scaled_dot_product_attention``), matmul (two batched
    matmuls around a float32 softmax); auto = matmul when a KV head serves at most 2 query heads
    (Qwen3-1.7B: 1.06x vs 0.97x SGLang at batch 256), else sdpa (Qwen2-0.5B, 7 per KV head)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter and compute dtype of the embedded engine (embedded / embedded_server); auto =
    model.dtype; also SGLang's --dtype. The trainer's weights are cast to it at each sync. The PPO ratio's
    pi_old is the trainer's own (its log-probs, detached, for one update per batch; recomputed before
    several, but for the first update's rows: its own forward, detached), so the engine's other
    numerics show only in ``train_rollout_logprob_abs_diff``."""
    tensor_parallel: int = 1
    """Engine tensor-parallel size (sglang)."""
    num_engines: int = 1
    """Number of engines (sglang)."""
    num_gpus: int = 0
    """GPUs reserved for rollout when disaggregated (0: colocated with the trainer)."""
    mem_fraction: float = bounded(0.5, gt=0, le=1)
    """Fraction of GPU memory the engine may use (sglang --mem-fraction-static)."""
    router: bool = False
    """Put the SGLang router in front of several engines."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed through to each engine server, as ``--flag [value ...]`` or
    ``--flag=value`` items (read by :func:`server_flags`: a value before any ``--flag`` is an error)."""
    engine_python: str = ""
    """Python interpreter that runs the SGLang servers and router (empty: this process's). Point it at
    another virtualenv's ``bin/python`` when SGLang is installed apart from the trainer (its pins, e.g.
    of transformers, differ). Its sglang release is checked before any work."""
    engine_env: dict = field(default_factory=dict)
    """Environment variables of the engine servers and router, set on top of this process's environment
    (minus torchrun's rendezvous variables, which servers never inherit), e.g.
    ``{PYTHONPATH: /opt/sglang/site}`` for an SGLang installed into a folder; its ``PYTHONPATH``
    replaces this process's. Each engine's ``CUDA_VISIBLE_DEVICES`` is set over it: the GPUs the
    placement gives that engine."""
    host: str = "127.0.0.1"
    """Interface engine servers bind to."""
    api_key: str = ""
    """Token required by engine admin endpoints when bound beyond loopback."""
    weight_roots: list[str] = field(default_factory=list)
    """Directories an embedded server bound beyond loopback (rollout.host) may read weights from with
    /update_weights_from_disk (its --weight-root); nothing else is readable. megaforge adds the folders
    it writes weights to itself: rollout.snapshot_dir, else the temporary folder (default snapshots,
    sync.transport disk). Loopback servers read any directory."""
    startup_timeout_s: float = bounded(600.0, gt=0)
    """Seconds an engine may take to become healthy."""
    request_timeout_s: float = bounded(600.0, gt=0)
    """Seconds one generation request may take (HTTP engines: one request carries an engine's whole
    share of the step when there is no router). An engine that does not answer within it is hung: it is
    restarted (see ``rollout.max_restarts``)."""
    max_restarts: int = 3
    """Engine fault tolerance (HTTP engines: embedded_server, sglang): restarts allowed per engine per
    RL step. A dead or hung engine (process exited, connection refused or reset, no answer within
    request_timeout_s or health_timeout_s) is restarted, re-synced to the served weight version from a
    snapshot written by each weight update, its memory state restored and its unfinished requests
    re-issued (each prompt gets its samples once). One more failure stops the run with an error naming
    the engine and its log. 0: no restarts and no snapshot."""
    health_timeout_s: float = bounded(30.0, gt=0)
    """Seconds an engine's /health_generate may take in the health check at the start of every step."""
    snapshot_dir: str = ""
    """Folder of the weight snapshot that re-syncs a restarted engine (empty: a temporary folder; a
    folder under /dev/shm keeps it in RAM). With sync.transport disk the update's shards are the snapshot."""
    generate_fn: str = ""
    """Custom rollout function ``package.module:callable`` (multi-turn / agentic); empty: single turn.
    Signature ``fn(engine, requests, rows, tokenizer, ctx) -> list[Sample]``, ``ctx`` a GenerateContext
    (megaforge.rollout.agent.multiturn); ``megaforge.rollout.agent.multiturn:tool_rollout`` runs tool calls
    between turns."""
    generate_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of rollout.generate_fn, e.g. ``{tools: [calculator, python]}`` for tool_rollout."""
    max_turns: int = 4
    """Turn limit of multi-turn rollouts (model turns per episode)."""
    return_routed_experts: bool = False
    """Routing replay (mixture-of-experts models, trainer.backend megatron): every generation also
    returns the experts its engine routed each token to (SGLang's ``return_routed_experts``; the
    servers start with ``--enable-return-routed-experts``; the embedded engine records its own), one
    [prompt + response - 1, num_hidden_layers, num_experts_per_tok] int table per sample (dense layers:
    0). The batch carries it per token and layer and the trainer's routers replay it in the pi_old,
    reference and policy passes (trainer.routing_replay), logging ``routing/replay_diff_frac``. Refused
    for dense models, the torch backend, trainer.recompute full, rollout.generate_fn and
    loop.partial_rollouts."""
    max_tool_tokens: int = 64
    """Tokens of one tool result appended to the context (longer results are cut); the whole
    response, model and tool tokens, stays within rollout.max_new_tokens."""


def server_flags(args: list[str]) -> dict[str, list[str]]:
    """``rollout.extra_args`` as ``{"--flag": [values]}``, in order: ``--flag`` alone -> ``[]``, ``--flag a b``
    -> ``["a", "b"]``, ``--flag=a`` -> ``["a"]`` (a flag given twice: the later one). The one reader of the
    list (the memory planner, the peers' mapping). ValueError naming the key on a value before any flag."""
    flags: dict[str, list[str]] = {}
    key = None
    for a in map(str, args):
        if a.startswith("--"):
            key, _, v = a.partition("=")
            flags[key] = [v] if _ else []
        elif key is None:
            raise ValueError(f"rollout.extra_args: value {a!r} comes before any --flag (items are '--flag', "
                             f"'--flag value ...' or '--flag=value')")
        else:
            flags[key].append(a)
    return flags

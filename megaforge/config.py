"""megaforge's configuration tree: one typed dataclass per section, a docstring per key.

Load with :func:`load_config` (``--config FILE.yaml`` plus dotted overrides such as
``--grpo.n_samples 4 --output_dir runs``). ``python launchers/grpo.py --help`` prints every key.
The mechanics (type checks, unknown-key suggestions) live in :mod:`megaforge.configtree`.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml

from megaforge import configtree
from megaforge.configtree import ConfigError

DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model directory or hub id of the policy's initial weights. Empty: random init
    from ``model.config`` (seeded by ``model.init_seed``)."""
    config: str = ""
    """HF ``config.json`` (file or directory) used for random init when ``model.path`` is empty."""
    tokenizer: str = ""
    """Tokenizer directory or hub id; defaults to ``model.path``."""
    dtype: DType = "float32"
    """Parameter and compute dtype of the trainer and the embedded engine."""
    init_seed: int = 0
    """Seed of the random init (only with ``model.config``)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation for HF modules (sdpa, eager, flex_attention)."""
    trust_remote_code: bool = False
    """Passed to transformers; only enable for model code you trust."""


@dataclass
class DataConfig:
    path: str = ""
    """Prompts: a .jsonl or .parquet file, a directory of them, a `datasets` dataset (local path or
    hub name), or a synthetic task name (``format: synthetic``, e.g. ``arithmetic``)."""
    format: Literal["auto", "jsonl", "parquet", "hf", "synthetic"] = "auto"
    """How to read ``data.path``; ``auto`` decides from the path."""
    split: str = "train"
    """Split of a `datasets` dataset."""
    name: str = ""
    """Configuration (subset) of a `datasets` hub dataset, e.g. ``main`` for openai/gsm8k or ``en`` for
    open-r1/DAPO-Math-17k-Processed; empty: the dataset's default."""
    streaming: bool = False
    """Stream a `datasets` dataset instead of loading it whole."""
    input_key: str = "prompt"
    """Row key of the prompt text, or of a list of chat messages ({role, content})."""
    label_key: str = "answer"
    """Row key of the reference answer handed to the reward functions."""
    response_key: str = "response"
    """Row key of the target response (SFT data)."""
    apply_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template (user turn + generation prompt)."""
    system_prompt: str = ""
    """System message prepended to every chat prompt (empty: none)."""
    max_prompt_len: int = 512
    """Prompts longer than this many tokens are an error naming the row (or skipped, see below)."""
    shuffle: bool = True
    """Shuffle the rows each epoch with the run's seed (map-style data only)."""
    skip_bad_rows: bool = False
    """Skip (and count in ``data/skipped_rows``) malformed or over-long rows instead of failing."""
    synthetic_size: int = 4096
    """Rows of a synthetic task."""
    synthetic_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the synthetic task generator (e.g. ``{max_operand: 9}``)."""


@dataclass
class GRPOConfig:
    """The seed's ``grpo:`` block: group sampling and the clipped objective's numbers."""

    n_samples: int = 8
    """Responses sampled per prompt (the group size)."""
    clip_low: float = 0.2
    """Ratio lower clip: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """Ratio upper clip: ratio <= 1 + clip_high (clip-higher when > clip_low)."""
    beta: float = 0.0
    """KL coefficient against the frozen reference policy (0 disables the reference model)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same temperature."""


@dataclass
class AlgoConfig:
    """Which estimator, loss and aggregation; see ``megaforge.algorithms`` for formulas."""

    advantage: str = "grpo"
    """Advantage estimator: grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae (needs the
    critic) | a name registered by an ``algo.plugins`` module | ``package.module:callable``."""
    loss: str = "ppo_clip"
    """Policy loss: ppo_clip | gspo | cispo | sapo | reinforce | a registered name | ``package.module:callable``."""
    loss_agg: Optional[str] = None
    """Loss aggregation: token_mean | seq_mean_token_sum | seq_mean_token_mean | seq_mean_token_sum_norm |
    null: the loss's own, as its paper (gspo, sapo: seq_mean_token_mean, the mean over sequences of each
    sequence's token mean; the other losses: token_mean). A value contradicting gspo's or sapo's is an
    error (under it the loss is not its paper's objective)."""
    loss_agg_norm: float = 0.0
    """Constant normaliser of seq_mean_token_sum_norm (0: rollout.max_new_tokens)."""
    kl_estimator: str = "low_var_kl"
    """KL estimator: k1 | k2 | k3 | low_var_kl."""
    kl_in_reward: bool = False
    """Apply the KL as a per-token reward penalty instead of a loss term: r_t -= grpo.beta * KL_t, with
    KL_t taken from the trainer's old log-probs (pi_old, computed before the update) against the
    reference, as verl does; not from the engine's rollout log-probs, which a different kernel computes."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= entropy_coef * entropy)."""
    clip_c: Optional[float] = None
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens; null disables."""
    std_eps: float = 1e-6
    """Epsilon added to the std by ``grpo`` (group std) and the batch-normalised estimators."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling cap on pi_old/pi_rollout (null disables)."""
    tis_level: Literal["token", "sequence"] = "token"
    """TIS ratio: per token, or the sequence's product of token ratios applied to all its tokens."""
    mis_threshold: Optional[float] = None
    """Masked importance sampling: weight 0 where pi_old/pi_rollout exceeds this (null disables)."""
    mis_threshold_low: Optional[float] = None
    """Masked importance sampling lower bound: weight 0 where the ratio is below this (null: none)."""
    mis_level: Literal["token", "sequence", "geometric"] = "token"
    """MIS ratio: per token, the sequence's product of ratios, or its geometric mean (rejection only)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero advantage) and sample more prompts to keep
    rollout.batch_size groups; DAPO. Prompts per extra round: missing groups * loop.oversample."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step when dynamic sampling; after the last one the step trains on the
    groups kept so far (all of the last round's groups when none was kept)."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: responses longer than rollout.max_new_tokens - overlong_buffer
    get a linearly growing penalty (0 disables)."""
    overlong_penalty: float = 1.0
    """Penalty at rollout.max_new_tokens tokens (DAPO: 1.0)."""
    gamma: float = 1.0
    """Discount for reinforce_pp / gae."""
    lam: float = 1.0
    """GAE lambda."""
    plugins: list[str] = field(default_factory=list)
    """Modules imported at start-up so that the losses / advantages / rewards they register by name
    (``@POLICY_LOSSES.register("my_loss")``) can be used by that name."""
    plugin_kwargs: dict = field(default_factory=dict)
    """Extra untyped values for plug-in losses / advantages (``p.plugin_kwargs``); typed knobs are
    declared by the plug-in's registry entry (``params=``) and set as ``algo.<entry>_<field>``."""
    components: dict = field(default_factory=lambda: {p: c() for p, c in algo_components({}).items()},
                             metadata={"extensions": lambda data: algo_components(data)})
    """(Not a key.) The typed parameters that registry entries declare (``register("sapo",
    params=SapoParams)``), by key prefix: field ``tau_pos`` is key ``algo.sapo_tau_pos``
    (megaforge.algorithms.params). Built-in: sapo_tau_pos, sapo_tau_neg, cispo_clip_low, reinforce_clip."""


def algo_components(data: dict) -> dict[str, type]:
    """{key prefix: parameters dataclass} of the registered algorithm components, the extension keys of
    the ``algo`` section (megaforge.configtree): megaforge's and those of the modules of ``algo.plugins``
    in ``data``, which are imported first."""
    # imported when a config is built, not with this module: the algorithms import torch, and reward
    # worker processes import this module (RewardSpec) within a reward's start-up deadline
    from megaforge.algorithms.params import component_classes, load_plugins

    plugins = configtree.coerce(data.get("plugins", []), list[str], "algo.plugins")
    load_plugins(plugins)
    classes = component_classes(plugins)
    own = {f.name for f in dataclasses.fields(AlgoConfig)}
    for prefix, c in classes.items():
        for f in dataclasses.fields(c):
            if prefix + f.name in own:
                raise ConfigError(f"config key 'algo.{prefix}{f.name}' is AlgoConfig's own and also a field of "
                                  f"{c.__name__}: rename the field or the registry entry")
    return classes


@dataclass
class CriticConfig:
    """The value model of PPO (``algo.advantage: gae``): the policy's backbone plus a linear value head,
    trained with the clipped value loss through the trainer backend."""

    enabled: Optional[bool] = None
    """Train a critic; null: exactly when algo.advantage is gae."""
    path: str = ""
    """Hugging Face model directory of the critic's backbone; empty: a copy of the policy at RL start
    (after the SFT warm start; the only choice of trainer.backend megatron, where the critic is a
    second GPTModel at the policy's layout). The value head starts at zero."""
    lr: float = 1e-5
    """Critic learning rate (constant, AdamW with the trainer's betas / eps / weight decay)."""
    value_clip: Optional[float] = 0.2
    """PPO value clipping: V_clip = V_old + clip(V - V_old, -value_clip, value_clip); null disables."""


@dataclass
class RewardModelConfig:
    """A learned reward model (``name: reward_model``): a Hugging Face
    ``AutoModelForSequenceClassification`` checkpoint with one output (e.g. Qwen2ForSequenceClassification),
    scored in batches in a worker process of its own (megaforge.rewards.reward_model)."""

    path: str = ""
    """Checkpoint directory of the reward model (config.json, weights, tokenizer)."""
    tokenizer: str = ""
    """Tokenizer directory; empty: ``path``. Its chat template (not the policy's) formats the input."""
    device: str = "cpu"
    """Device of the reward model: cpu | cuda | cuda:N (give it a GPU of its own: it stays loaded)."""
    dtype: DType = "float32"
    """Parameter and compute dtype."""
    template: Literal["chat", "concat"] = "chat"
    """chat: the messages [user: prompt, assistant: response] through the reward model tokenizer's chat
    template; concat: prompt + response as they are. The prompt is the text rewards receive: the
    policy's prompt, after the policy's chat template when data.apply_chat_template is true."""
    max_length: int = 2048
    """Tokens per scored sequence. Longer ones keep their last max_length tokens (the score is read at
    the last token, so the response's end is always scored; the prompt's start goes first)."""
    batch_size: int = 16
    """Sequences per forward pass."""
    trust_remote_code: bool = False
    """Passed to transformers; only enable for model code you trust."""


@dataclass
class JudgeConfig:
    """An LLM judge (``name: llm_judge``): a generative reward through a megaforge engine of its own,
    the judge model separate from the policy (megaforge.rewards.judge)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig())
    """The judge's model and tokenizer (model.path, model.dtype, ...), not the policy's."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(device="cpu"))
    """The judge's engine (rollout.engine embedded | embedded_server | sglang, rollout.device, ...)."""
    template: str = ""
    """The judge's prompt: {prompt}, {response} and {label} are replaced by the sample's (other braces
    doubled: {{ }}). One of template / template_file."""
    template_file: str = ""
    """A file holding the template (e.g. examples/llm_judge/rubric.txt)."""
    chat_template: bool = True
    """Wrap the filled template as a user turn in the judge tokenizer's chat template."""
    verdict: Literal["score", "pass_fail"] = "score"
    """score: the verdict is a number in [score_min, score_max]; pass_fail: PASS or FAIL (1.0 / 0.0)."""
    pattern: str = ""
    """Regular expression whose first group is the verdict; the last match in the judge's answer
    counts. Empty: ``Score: N`` (score) or ``Verdict: PASS|FAIL`` (pass_fail), case-insensitive. An
    answer without a match, or a score out of range, fails that sample (reward/errors, scored 0)."""
    score_min: float = 0.0
    """Lowest valid score."""
    score_max: float = 10.0
    """Highest valid score."""
    normalize: bool = True
    """Reward = (score - score_min) / (score_max - score_min), in [0, 1]; false: the score itself."""
    max_new_tokens: int = 256
    """Tokens the judge may write."""
    temperature: float = 0.0
    """Judge sampling temperature; 0: greedy (the same answer for the same sample)."""
    batch_size: int = 32
    """Samples judged per engine call."""


@dataclass
class RewardSpec:
    name: str = "math"
    """Registered reward (math, thinking, remote, reward_model, llm_judge, ...) or ``package.module:callable``."""
    weight: float = 1.0
    """Weight of this reward in the sum."""
    kwargs: dict = field(default_factory=dict)
    """Constructor arguments of the reward."""
    label: str = ""
    """Its name in metrics (reward/<label>) and messages; empty: the last part of ``name``. Labels are
    unique (give two remote rewards labels of their own)."""
    workers: Optional[int] = None
    """Worker processes of a pool of this reward's own; null: the reward's default (reward_model and
    llm_judge: 1, they hold a model; the others share rewards.workers)."""
    url: str = ""
    """remote: the reward service's URL. Each request is ``POST url`` with the JSON ``{prompt, response,
    label}`` answered by a number or ``{"reward": x}`` (slime's form), or with batch_size > 0 a JSON
    list of such objects answered by a list as long (megaforge.rewards.remote)."""
    api_key: str = ""
    """remote: bearer token sent as ``Authorization: Bearer <token>`` (it is written to the run's
    config.yaml like every key: prefer api_key_env). Never logged."""
    api_key_env: str = ""
    """remote: name of the environment variable holding the bearer token (read by the reward workers)."""
    batch_size: int = 0
    """remote: samples per request; 0: one request per sample in slime's form."""
    max_concurrency: int = 8
    """remote: requests in flight at once per reward worker."""
    request_timeout_s: float = 10.0
    """remote: seconds one request may take; a request still unanswered then fails its samples as
    timeouts (reward/timeouts). The whole call also stays within rewards.timeout_s."""
    retries: int = 3
    """remote: new attempts after a connection error (refused, reset) or HTTP 502 / 503 / 504."""
    backoff_s: float = 0.5
    """remote: wait before retry k (k = 0, 1, ...): backoff_s * 2**k."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """reward_model: the checkpoint and how it is scored."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """llm_judge: the judge model, its engine, prompt and verdict parser."""


@dataclass
class RewardsConfig:
    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec("math", 1.0)])
    """Rewards summed (with weights) into each sample's reward."""
    timeout_s: float = 30.0
    """Seconds a reward call gets from its submission (> 0): a call not done by then scores 0 and counts
    in ``reward/timeouts``; its worker process is killed and replaced, so a step's reward phase ends
    within about this long after its last submission however many calls hang."""
    workers: int = 0
    """Reward worker processes of the shared pool (0: one per CPU core, at most 4)."""
    start_timeout_s: float = 600.0
    """Seconds the reward workers get to build their rewards at start-up (imports, loading a reward
    model or a judge)."""
    stream_prompts: int = 0
    """Prompts per engine call while rewards are computed: with N > 0 a step's generation runs as engine
    calls of N prompts (x grpo.n_samples samples) and each call's samples go to the reward workers as
    it returns, so rewards overlap the rest of the generation (time/reward: the rewards' span,
    time/reward_wait: the wait after generation ended). 0: one engine call, rewards after it. Smaller
    calls decode smaller batches: use it for slow rewards (services, reward models, judges)."""


@dataclass
class RolloutConfig:
    engine: Literal["embedded", "embedded_server", "sglang"] = "embedded"
    """Rollout engine: HF transformers in-process (embedded), the same behind HTTP
    (embedded_server), or SGLang servers."""
    batch_size: int = 16
    """Prompts per RL step (each sampled grpo.n_samples times)."""
    max_new_tokens: int = 128
    """Maximum response length."""
    top_p: float = 1.0
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
    several), so the engine's other numerics show only in ``train_rollout_logprob_abs_diff``."""
    tensor_parallel: int = 1
    """Engine tensor-parallel size (sglang)."""
    num_engines: int = 1
    """Number of engines (sglang)."""
    num_gpus: int = 0
    """GPUs reserved for rollout when disaggregated (0: colocated with the trainer)."""
    mem_fraction: float = 0.5
    """Fraction of GPU memory the engine may use (sglang --mem-fraction-static)."""
    router: bool = False
    """Put the SGLang router in front of several engines."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed through to each engine server."""
    engine_python: str = ""
    """Python interpreter that runs the SGLang servers and router (empty: this process's). Point it at
    another virtualenv's ``bin/python`` when SGLang is installed apart from the trainer (its pins, e.g.
    of transformers, differ). Its sglang release is checked before any work."""
    engine_env: dict = field(default_factory=dict)
    """Environment variables of the engine servers and router, set on top of this process's environment
    (minus torchrun's rendezvous variables, which servers never inherit), e.g.
    ``{PYTHONPATH: /opt/sglang/site}`` for an SGLang installed into a folder; its ``PYTHONPATH``
    replaces this process's."""
    host: str = "127.0.0.1"
    """Interface engine servers bind to."""
    api_key: str = ""
    """Token required by engine admin endpoints when bound beyond loopback."""
    weight_roots: list[str] = field(default_factory=list)
    """Directories an embedded server bound beyond loopback (rollout.host) may read weights from with
    /update_weights_from_disk (its --weight-root); nothing else is readable. megaforge adds the folders
    it writes weights to itself: rollout.snapshot_dir, else the temporary folder (default snapshots,
    sync.transport disk). Loopback servers read any directory."""
    startup_timeout_s: float = 600.0
    """Seconds an engine may take to become healthy."""
    request_timeout_s: float = 600.0
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
    health_timeout_s: float = 30.0
    """Seconds an engine's /health_generate may take in the health check at the start of every step."""
    snapshot_dir: str = ""
    """Folder of the weight snapshot that re-syncs a restarted engine (empty: a temporary folder; a
    folder under /dev/shm keeps it in RAM). With sync.transport disk the update's shards are the snapshot."""
    generate_fn: str = ""
    """Custom rollout function ``package.module:callable`` (multi-turn / agentic); empty: single turn.
    Signature ``fn(engine, requests, rows, tokenizer, cfg) -> list[Sample]`` (megaforge.rollout.agent.multiturn);
    ``megaforge.rollout.agent.multiturn:tool_rollout`` runs tool calls between turns."""
    generate_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of rollout.generate_fn, e.g. ``{tools: [calculator, python]}`` for tool_rollout."""
    max_turns: int = 4
    """Turn limit of multi-turn rollouts (model turns per episode)."""
    max_tool_tokens: int = 64
    """Tokens of one tool result appended to the context (longer results are cut); the whole
    response, model and tool tokens, stays within rollout.max_new_tokens."""


@dataclass
class TrainerConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """Trainer backend: torch (HF modules, DDP) or megatron (megatron-core, TP/PP/CP)."""
    device: str = "auto"
    """auto | cpu | cuda."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the cosine / linear schedule."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward."""
    mini_batches: int = 1
    """Optimizer steps per RL step (the batch is split into this many mini-batches)."""
    epochs: int = 1
    """Passes over the rollout batch per RL step (PPO epochs)."""
    ref_device: str = "same"
    """Where the frozen reference policy lives: same | cpu."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    autocast: Literal["off", "bfloat16"] = "off"
    """torch backend on CUDA: run the forward and backward of the decoder layers under bfloat16
    autocast (parameters, gradients and AdamW state stay in model.dtype, e.g. float32 master weights);
    the LM head and the log-softmax stay in float32, so token log-probs keep float32 resolution."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient (skipped) before the run stops."""
    # --- megatron backend ---
    tensor_parallel: int = 1
    """Tensor-parallel size (megatron)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (megatron)."""
    context_parallel: int = 1
    """Context-parallel size (megatron)."""
    expert_parallel: int = 1
    """Expert-parallel size (megatron, MoE)."""
    sequence_parallel: bool = False
    """Sequence parallelism (megatron, needs tensor_parallel > 1)."""
    layer_spec: Literal["auto", "te", "torch"] = "auto"
    """Transformer layer implementation (megatron): te (Transformer Engine), torch, or auto."""
    fp8: Optional[Literal["hybrid", "e4m3"]] = None
    """FP8 training format (megatron + te)."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe (delayed, tensorwise, ...)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation (megatron)."""
    fused_logprobs: Optional[bool] = None
    """Per-token logprob/entropy over the vocabulary (megatron) through torch.compile'd kernels that
    read the bf16 logits once per pass instead of ~16 GB of float32 temporaries per 4k x 32k
    micro-batch: null = on for CUDA logits, off on CPU; true/false force it (false: eager, the same
    formulas op by op)."""


@dataclass
class SFTConfig:
    max_steps: int = 0
    """SFT optimizer steps before RL (0 skips the warm start). The SFT launcher runs only these."""
    batch_size: int = 32
    """Sequences per SFT step."""
    lr: float = 1e-3
    """SFT learning rate."""
    warmup_steps: int = 0
    """Linear warm-up of the SFT learning rate."""
    data: Optional[DataConfig] = None
    """SFT data; null: ``data`` (the RL prompts with their ``response`` targets). Rows are
    prompt/response (loss on the response and its end-of-turn token) or a chat message list under
    ``input_key`` ending with an assistant turn (loss on every assistant turn)."""
    pack: bool = True
    """Pack several examples per row (position ids restart per example and attention never crosses
    examples: transformers' position-id packing, exact for its built-in models; turn it off for
    trust_remote_code models whose attention ignores position-id restarts). Megatron always packs."""
    pack_len: int = 0
    """Row length of packed rows (torch backend); 0: the longest example of each micro-batch, so
    packing never lengthens a row and only removes padding."""
    max_len: int = 512
    """Maximum SFT sequence length."""


@dataclass
class LoopConfig:
    mode: Literal["sync", "off_policy"] = "sync"
    """sync: rollout then train; off_policy: rollout of step N+1 overlaps training of step N (needs the
    engine in its own process: rollout.engine embedded_server or sglang). See megaforge.driver.offpolicy."""
    max_staleness: int = 1
    """K: no token is ever trained at staleness > K, where staleness = (trainer weight version when the
    step trains) - (weight version that generated the token). off_policy needs K >= trainer.mini_batches
    * trainer.epochs (one step of overlap ages samples by that many versions)."""
    stale_policy: Literal["drop", "correct"] = "drop"
    """What keeps staleness <= K when sync.interval would exceed it. drop: weights are pushed only on
    schedule; a batch older than K is dropped (counted in staleness/dropped_samples) and regenerated
    with fresh weights. correct: a weight push is forced before a rollout that would be trained at
    staleness > K (sync/forced), nothing is dropped, and off-policy samples are importance-corrected
    with pi_theta / pi_rollout (needs algo.tis_cap or algo.mis_threshold)."""
    partial_rollouts: bool = False
    """Generate in rounds of at most loop.partial_budget_tokens tokens per sample: a sample unfinished
    after its round is carried over and continued in the next step (after the weight update) with
    prompt + generated tokens as its new prompt, so one long sample does not stall a step. Every
    sample is trained exactly once. Not with rollout.generate_fn."""
    partial_budget_tokens: int = 0
    """Tokens per sample per generation round with partial rollouts (0: rollout.max_new_tokens // 2)."""
    partial_old_tokens: Literal["mask", "correct"] = "mask"
    """Tokens of a continued sample generated by older weights than its last segment: mask (not
    trained; the context still holds them) or correct (trained, importance-corrected with their
    recorded rollout logprobs: needs algo.tis_cap or algo.mis_threshold). Tokens older than K are
    masked either way."""
    oversample: float = 1.0
    """Prompts drawn per step = batch_size * oversample when filters may drop groups."""


@dataclass
class SyncConfig:
    transport: Literal["auto", "inproc", "ipc", "nccl", "disk", "shm"] = "auto"
    """Trainer -> engine weight transport (megaforge.sync): ipc (colocated GPUs: CUDA IPC of flattened
    buckets through two reused device buffers), nccl (engines on other GPUs: a weight-update group,
    one broadcast per bucket), disk (safetensors + update_weights_from_disk), shm (CPU shared memory),
    auto (ipc for CUDA tensors, shm for CPU ones)."""
    bucket_mb: int = 512
    """Maximum MiB of one weight bucket (a single larger tensor is a bucket of its own)."""
    interval: int = 1
    """Sync weights every this many steps."""
    check_equal: bool = False
    """After each update, compare the engine's weights with the trainer's (per-tensor sha256 in the
    engine's dtype; SGLang: its /weights_checker hashes in its own layout) and fail naming the tensor."""


@dataclass
class MemoryConfig:
    offload: Literal["none", "pinned", "tms"] = "none"
    """Trainer state off the GPU while the engines generate (colocated runs; megaforge.memory): pinned
    (host buffers allocated once, chunked copies on a side stream), tms (torch_memory_saver
    pause/resume; pip install torch-memory-saver), none (resident). A CPU trainer: nothing to do."""


@dataclass
class EvalSetConfig:
    """One held-out prompt set. Its prompts are built like the training prompts (``data.system_prompt``,
    ``data.apply_chat_template``, ``data.max_prompt_len``) and scored by ``rewards.functions``."""

    name: str = ""
    """Name of the set: its metrics are ``eval/<name>/...`` (letters, digits, ``_``, ``-``, ``.``)."""
    path: str = ""
    """A .jsonl / .parquet file or folder, or a `datasets` dataset (local or hub); empty: hold out
    ``holdout`` of data.path's distinct prompts (never trained on)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """How to read ``path``; ``auto`` decides from the path."""
    split: str = "test"
    """Split of a `datasets` dataset."""
    subset: str = ""
    """Configuration (subset) of a `datasets` hub dataset, e.g. ``main`` for openai/gsm8k."""
    input_key: str = ""
    """Row key of the prompt (empty: data.input_key)."""
    label_key: str = ""
    """Row key of the reference answer (empty: data.label_key)."""
    holdout: float = 0.0
    """With ``path`` empty: the fraction (0 < f < 1) of data.path's distinct prompts held out of training
    (chosen with the run's seed; every row with a held-out prompt leaves the RL and SFT data)."""
    max_rows: int = 0
    """Evaluate the first N prompts of the set only (0: all)."""


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts through the rollout engine (megaforge.eval): greedy pass@1 and
    sampled pass@k, the reward's components and the response length per set, logged as
    ``eval/<set>/...`` in the step's metrics row."""

    sets: list[EvalSetConfig] = field(default_factory=list)
    """Held-out sets (a file, a `datasets` split, or ``holdout`` of data.path); empty: no evaluation."""
    interval: int = 0
    """Evaluate after every N RL steps and after the last one (0: only before training, see below)."""
    before_train: bool = False
    """Evaluate the starting policy (after any SFT warm start), logged as step 0."""
    greedy: bool = True
    """Greedy pass@1: one temperature-0 response per prompt."""
    n_samples: int = 0
    """Sampled responses per prompt for pass@k (0: none)."""
    pass_k: list[int] = field(default_factory=list)
    """k of the sampled pass@k (each 1 <= k <= eval.n_samples); empty: 1 and eval.n_samples."""
    temperature: Optional[float] = None
    """Temperature of the sampled responses (null: grpo.temperature); top_p / top_k are rollout's."""
    max_new_tokens: int = 0
    """Response length limit (0: rollout.max_new_tokens)."""
    correct_reward: str = ""
    """The reward function (a name in rewards.functions) that decides correctness for pass@k; empty:
    the first one."""
    correct_threshold: float = 1.0
    """A response is correct when that reward's unweighted value is >= this."""
    check_disjoint: bool = True
    """Refuse a set whose prompt is also a training prompt (data.path, and sft.data when the warm start
    runs), naming the set and the row; a streaming training set is read through once for it."""
    write_samples: bool = True
    """Write every evaluated response to ``<run dir>/eval/<set>/step_NNNNNN.jsonl``."""

    def validate_with(self, cfg, need) -> None:
        """Checks that need the rest of the config (called by Config.validate)."""
        import re

        names = [s.name for s in self.sets]
        for i, s in enumerate(self.sets):
            key = f"eval.sets[{i}]"
            need(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", s.name)), f"{key}.name",
                 f"must be a non-empty name of letters, digits, '_', '-', '.' (got {s.name!r})")
            need(names.count(s.name) == 1, f"{key}.name", f"{s.name!r} names more than one set")
            need(s.max_rows >= 0, f"{key}.max_rows", "must be >= 0")
            if s.path:
                need(s.holdout == 0.0, f"{key}.holdout", "holds out of data.path: leave eval.sets[].path empty")
            else:
                need(0.0 < s.holdout < 1.0, f"{key}.holdout",
                     "set a fraction in (0, 1) of data.path to hold out, or eval.sets[].path")
                need(not cfg.data.streaming, f"{key}.holdout", "needs map-style data (data.streaming false)")
        need(sum(not s.path for s in self.sets) <= 1, "eval.sets", "at most one set may hold out of data.path")
        need(self.interval >= 0, "eval.interval", "must be >= 0")
        need(self.n_samples >= 0, "eval.n_samples", "must be >= 0")
        need(self.greedy or self.n_samples > 0 or not self.sets, "eval.greedy",
             "evaluation needs greedy responses or eval.n_samples > 0")
        for k in self.pass_k:
            need(1 <= k <= self.n_samples, "eval.pass_k", f"{k} is not in [1, eval.n_samples={self.n_samples}]")
        need(self.temperature is None or self.temperature > 0, "eval.temperature", "must be > 0 (or null)")
        need(self.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0")
        need(not self.sets or self.interval > 0 or self.before_train, "eval.sets",
             "are never evaluated: set eval.interval and/or eval.before_train")
        rewards = [f.name for f in cfg.rewards.functions] + [f.name.rsplit(":", 1)[-1] for f in cfg.rewards.functions]
        need(not self.correct_reward or self.correct_reward in rewards, "eval.correct_reward",
             f"{self.correct_reward!r} is not in rewards.functions ({', '.join(f.name for f in cfg.rewards.functions)})")

    @property
    def ks(self) -> list[int]:
        """The k values of sampled pass@k."""
        return list(self.pass_k) if self.pass_k else sorted({1, self.n_samples}) if self.n_samples else []


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    """Write TensorBoard event files under ``<run dir>/tensorboard``."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: str = "megaforge"
    """W&B project."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """W&B mode; offline needs no network."""
    log_samples: int = 1
    """Sample texts printed per step (0: none)."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every N RL steps (0: only at the end)."""
    keep_last_n: int = 2
    """Valid checkpoints kept (older ones, and corrupt or partial ones, are deleted after a new one
    is complete); the checkpoint a run resumed from is kept for the whole run."""
    save_optimizer: bool = True
    """Include optimizer and scheduler state."""


@dataclass
class LaunchConfig:
    dist_timeout_s: float = 600.0
    """torch.distributed collective timeout in seconds: a collective still waiting after this fails
    (megaforge.cluster). Rank failures are caught sooner by the watchdog below."""
    heartbeat_s: float = 1.0
    """Watchdog period (seconds): each rank bumps its heartbeat in the rendezvous store and reads the
    failure flag and the other ranks' heartbeats (multi-process runs only)."""
    peer_timeout_s: float = 120.0
    """A rank whose heartbeat has not changed for this long (or a store unreachable this long) counts
    as dead: every other rank stops its engine servers and exits."""
    abort_grace_s: float = 5.0
    """After another rank reported a failure, this rank gets this long to exit on its own (e.g. when
    it raised the same error) before the watchdog ends it."""


@dataclass
class SlurmConfig:
    cluster: Literal["slurm", "local"] = "slurm"
    """Where launchers/slurm.py submits: slurm (sbatch through submitit) or local (submitit's local
    executor on this machine, one node: CI)."""
    nodes: int = 1
    """Nodes of the job (one submitit task per node, each running torchrun)."""
    gpus_per_node: int = 8
    """GPUs per node (torchrun processes per node = gpus_per_node - rollout.num_gpus / nodes); on a
    CPU run (trainer.device cpu) the number of gloo processes per node."""
    partition: str = ""
    """SLURM partition (sbatch --partition); empty: the cluster's default."""
    account: str = ""
    """SLURM account (sbatch --account); empty: the user's default."""
    qos: str = ""
    """SLURM quality of service (sbatch --qos); empty: none."""
    time: str = "24:00:00"
    """Time limit: [D-]HH:MM:SS, HH:MM or minutes (quote it in YAML: "24:00:00"). SIGUSR2 arrives
    signal_delay_s before it."""
    cpus_per_task: int = 0
    """CPUs per node (one task per node); 0: leave to SLURM."""
    mem_gb: int = 0
    """Memory per node in GB; 0: leave to SLURM."""
    constraint: str = ""
    """sbatch --constraint (node features); empty: none."""
    job_name: str = ""
    """Job name; empty: megaforge-<run_name>."""
    sbatch: dict = field(default_factory=dict)
    """Extra sbatch options, e.g. {exclusive: true, reservation: r1, mail-type: END}: each becomes
    #SBATCH --key=value (a true value: --key)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the task on every node (module load, source venv/bin/activate)."""
    signal_delay_s: int = 180
    """SIGUSR2 this many seconds before the time limit: the run finishes its step, checkpoints and
    requeues itself (give it time for one step plus a checkpoint)."""
    stop_grace_s: int = 150
    """After the preemption signal, how long the node's ranks get to finish the step and checkpoint
    before they are killed (keep it below signal_delay_s)."""
    max_requeues: int = 10
    """Time-outs after which the job is not requeued again (submitit's max_num_timeout)."""
    master_port: int = 0
    """torchrun's rendezvous port; 0: derived from the job id (20000-59999)."""


@dataclass
class Config:
    output_dir: str = "runs"
    """Runs are written to ``<output_dir>/<run_name>/``."""
    run_name: str = "run"
    """Name of the run directory."""
    max_steps: int = 10
    """RL steps."""
    seed: int = 0
    """Seed of data order, sampling and init."""
    resume: bool = False
    """Continue from the latest complete checkpoint in the run directory."""
    export_hf_every: int = 0
    """Write a Hugging Face export to ``<run dir>/hf/step_N/`` every N steps (0: never)."""
    deterministic: bool = False
    """Use deterministic algorithms (CPU resume tests)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model and tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """RL prompts."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Group sampling and clipped objective (the seed's block)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantage estimator, policy loss, aggregation, KL, corrections."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (PPO / gae)."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Reward functions."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engines and sampling."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer backend, optimizer and parallel layout."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start (and the SFT launcher)."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """Synchronous or off-policy loop."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight synchronisation."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Colocation memory management."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks and progress display."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (greedy pass@1, sampled pass@k) during RL."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Distributed timeouts and the rank watchdog (megaforge.cluster)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """SLURM / submitit job (launchers/slurm.py)."""

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.run_name)

    @property
    def critic_enabled(self) -> bool:
        return self.critic.enabled if self.critic.enabled is not None else self.algo.advantage == "gae"

    def _validate_algo(self, need) -> None:
        a = self.algo
        for k in ("tis_cap", "mis_threshold", "mis_threshold_low"):
            v = getattr(a, k)
            need(v is None or v > 0, f"algo.{k}", "must be > 0 (or null)")
        need(a.mis_threshold_low is None or a.mis_threshold is not None, "algo.mis_threshold_low",
             "needs algo.mis_threshold (the upper bound)")
        need(a.mis_threshold is None or a.mis_threshold_low is None or a.mis_threshold_low < a.mis_threshold,
             "algo.mis_threshold_low", "must be < algo.mis_threshold")
        need(a.dynamic_sampling_max_rounds >= 1, "algo.dynamic_sampling_max_rounds", "must be >= 1")
        need(a.overlong_buffer >= 0, "algo.overlong_buffer", "must be >= 0")
        need(a.overlong_buffer < self.rollout.max_new_tokens or a.overlong_buffer == 0, "algo.overlong_buffer",
             f"must be < rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        need(a.overlong_penalty >= 0, "algo.overlong_penalty", "must be >= 0")
        need(0 < a.gamma <= 1, "algo.gamma", "must be in (0, 1]")
        need(0 <= a.lam <= 1, "algo.lam", "must be in [0, 1]")
        need(a.std_eps >= 0, "algo.std_eps", "must be >= 0")
        need(self.loop.oversample >= 1, "loop.oversample", "must be >= 1")
        need(not (a.kl_in_reward and self.grpo.beta > 0 and a.advantage in ("grpo", "dr_grpo", "rloo")),
             "algo.kl_in_reward", f"algo.advantage {a.advantage} uses sequence rewards only, so the KL penalty "
             "would be dropped: use reinforce_pp, reinforce_pp_baseline or gae, or keep the KL in the loss")
        need(not (a.advantage == "gae" and self.critic.enabled is False), "critic.enabled",
             "algo.advantage gae needs the critic (set critic.enabled true or null)")
        need(self.critic.lr > 0, "critic.lr", "must be > 0")
        need(self.critic.value_clip is None or self.critic.value_clip > 0, "critic.value_clip", "must be > 0 (or null)")
        need(self.sft.pack_len >= 0, "sft.pack_len", "must be >= 0")

    def _validate_rewards(self, need) -> None:
        r = self.rewards
        need(r.start_timeout_s > 0, "rewards.start_timeout_s", "must be > 0")
        need(r.stream_prompts >= 0, "rewards.stream_prompts", "must be >= 0 (0: rewards after generation)")
        labels: dict[str, int] = {}
        for i, spec in enumerate(r.functions):
            key = f"rewards.functions[{i}]"
            label = reward_label(spec)
            need(label not in labels, f"{key}.label", f"reward label {label!r} is already used by "
                 f"rewards.functions[{labels.get(label)}]: give each reward a label of its own")
            labels[label] = i
            check_reward_spec(spec, key, need)

    def _validate_loop(self, need) -> None:
        lp, a, r = self.loop, self.algo, self.rollout
        corrected = a.tis_cap is not None or a.mis_threshold is not None
        need(lp.max_staleness >= 0, "loop.max_staleness", "must be >= 0")
        updates = self.trainer.mini_batches * self.trainer.epochs
        need(lp.mode != "off_policy" or lp.max_staleness >= updates, "loop.max_staleness",
             f"must be >= trainer.mini_batches * trainer.epochs = {updates} in off_policy mode (one step of "
             f"overlap ages every sample by that many weight versions)")
        need(lp.mode != "off_policy" or r.engine != "embedded", "rollout.engine",
             "loop.mode off_policy overlaps generation with training, which needs the engine in its own "
             "process: set rollout.engine to embedded_server (CPU/dev) or sglang. The in-process embedded engine "
             "shares this process's cores and GIL (measured on CPU: no speed-up over sync)")
        need(lp.stale_policy != "correct" or corrected, "loop.stale_policy",
             "correct needs an importance-sampling correction: set algo.tis_cap or algo.mis_threshold")
        need(lp.partial_budget_tokens >= 0, "loop.partial_budget_tokens", "must be >= 0")
        need(not (lp.partial_rollouts and lp.partial_old_tokens == "correct") or corrected, "loop.partial_old_tokens",
             "correct needs an importance-sampling correction: set algo.tis_cap or algo.mis_threshold")
        need(not (lp.partial_rollouts and r.generate_fn), "loop.partial_rollouts",
             "partial rollouts continue single-turn generations; they do not combine with rollout.generate_fn")
        need(r.max_turns >= 1, "rollout.max_turns", "must be >= 1")
        need(r.max_tool_tokens >= 1, "rollout.max_tool_tokens", "must be >= 1")

    def _validate_launch(self, need) -> None:
        la, sl = self.launch, self.slurm
        need(la.dist_timeout_s > 0, "launch.dist_timeout_s", "must be > 0")
        need(la.heartbeat_s > 0, "launch.heartbeat_s", "must be > 0")
        need(la.peer_timeout_s > 2 * la.heartbeat_s, "launch.peer_timeout_s", "must be > 2 x launch.heartbeat_s")
        need(la.abort_grace_s >= 0, "launch.abort_grace_s", "must be >= 0")
        need(sl.nodes >= 1, "slurm.nodes", "must be >= 1")
        need(sl.gpus_per_node >= 1, "slurm.gpus_per_node", "must be >= 1")
        need(sl.signal_delay_s >= 0 and sl.stop_grace_s >= 0, "slurm.signal_delay_s", "and slurm.stop_grace_s must be >= 0")
        need(sl.max_requeues >= 0, "slurm.max_requeues", "must be >= 0")
        need(0 <= sl.master_port < 65536, "slurm.master_port", "must be a port number (0: derived from the job id)")

    @property
    def engine_dtype(self) -> str:
        """The engines' parameter dtype: ``rollout.dtype``, ``model.dtype`` when it is auto."""
        return self.model.dtype if self.rollout.dtype == "auto" else self.rollout.dtype

    def validate(self) -> None:
        def need(cond: bool, key: str, msg: str):
            if not cond:
                raise ConfigError(f"config key '{key}': {msg}")

        need(self.max_steps >= 0, "max_steps", "must be >= 0")
        need(self.sft.max_steps >= 0, "sft.max_steps", "must be >= 0")
        need(self.grpo.n_samples >= 1, "grpo.n_samples", "must be >= 1")
        need(self.grpo.temperature > 0, "grpo.temperature", "must be > 0")
        need(0 <= self.grpo.clip_low < 1, "grpo.clip_low", "must be in [0, 1)")
        need(self.grpo.clip_high >= 0, "grpo.clip_high", "must be >= 0")
        need(self.grpo.beta >= 0, "grpo.beta", "must be >= 0")
        need(self.algo.clip_c is None or self.algo.clip_c > 1, "algo.clip_c", "must be > 1 (or null)")
        self._validate_algo(need)
        need(self.rewards.timeout_s > 0, "rewards.timeout_s", "must be > 0 (seconds a step's reward calls get)")
        need(self.rewards.workers >= 0, "rewards.workers", "must be >= 0 (0: one per CPU core, at most 4)")
        self._validate_rewards(need)
        need(self.rollout.batch_size >= 1, "rollout.batch_size", "must be >= 1")
        need(self.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        need(0 < self.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        need(self.rollout.max_restarts >= 0, "rollout.max_restarts", "must be >= 0")
        need(self.rollout.health_timeout_s > 0, "rollout.health_timeout_s", "must be > 0")
        need(self.trainer.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
        need(self.trainer.mini_batches >= 1, "trainer.mini_batches", "must be >= 1")
        need(self.trainer.epochs >= 1, "trainer.epochs", "must be >= 1")
        need(self.trainer.autocast == "off" or self.trainer.backend == "torch", "trainer.autocast",
             "is the torch backend's (megatron computes in model.dtype, with trainer.fp8 for FP8)")
        for k in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            need(getattr(self.trainer, k) >= 1, f"trainer.{k}", "must be >= 1")
        need(
            not self.trainer.sequence_parallel or self.trainer.tensor_parallel > 1,
            "trainer.sequence_parallel", "needs trainer.tensor_parallel > 1",
        )
        need(self.sync.bucket_mb >= 1, "sync.bucket_mb", "must be >= 1")
        need(self.sync.interval >= 1, "sync.interval", "must be >= 1")
        self._validate_loop(need)
        need(self.checkpoint.keep_last_n >= 1, "checkpoint.keep_last_n", "must be >= 1")
        self._validate_launch(need)
        self.eval.validate_with(self, need)
        need(bool(self.model.path or self.model.config), "model.path", "set model.path (or model.config for a random init)")
        need(bool(self.data.path) or self.max_steps == 0, "data.path", "set the RL prompt data")
        need(self.run_name not in ("", ".", "..") and "/" not in self.run_name, "run_name", "must be a plain folder name")


def reward_label(spec: RewardSpec) -> str:
    """The reward's name in metrics and messages: ``label``, else the last part of ``name``."""
    return spec.label or spec.name.rsplit(":", 1)[-1]


_REMOTE_KEYS = ("url", "api_key", "api_key_env", "batch_size", "max_concurrency", "request_timeout_s", "retries",
                "backoff_s")


def check_reward_spec(spec: RewardSpec, key: str, need) -> None:
    """The service keys of one rewards.functions entry: set only for the reward that reads them, and valid."""
    default = RewardSpec()
    for k in _REMOTE_KEYS:
        need(spec.name == "remote" or getattr(spec, k) == getattr(default, k), f"{key}.{k}",
             f"only the remote reward reads it (this entry is {spec.name!r})")
    for k, name in (("reward_model", "reward_model"), ("judge", "llm_judge")):
        need(spec.name == name or getattr(spec, k) == getattr(default, k), f"{key}.{k}",
             f"only the {name} reward reads it (this entry is {spec.name!r})")
    need(spec.workers is None or spec.workers >= 1, f"{key}.workers", "must be >= 1 (or null)")
    if spec.name == "remote":
        need(spec.url.startswith(("http://", "https://")), f"{key}.url", f"the remote reward needs an http(s) URL, "
             f"got {spec.url!r}")
        need(not (spec.api_key and spec.api_key_env), f"{key}.api_key", "give api_key or api_key_env, not both")
        need(spec.batch_size >= 0, f"{key}.batch_size", "must be >= 0 (0: one request per sample)")
        need(spec.max_concurrency >= 1, f"{key}.max_concurrency", "must be >= 1")
        need(spec.request_timeout_s > 0, f"{key}.request_timeout_s", "must be > 0")
        need(spec.retries >= 0 and spec.backoff_s >= 0, f"{key}.retries", "and backoff_s must be >= 0")
    if spec.name == "reward_model":
        rm = spec.reward_model
        need(bool(rm.path), f"{key}.reward_model.path", "set the reward model's checkpoint directory")
        need(rm.max_length >= 2, f"{key}.reward_model.max_length", "must be >= 2")
        need(rm.batch_size >= 1, f"{key}.reward_model.batch_size", "must be >= 1")
    if spec.name == "llm_judge":
        j = spec.judge
        need(bool(j.model.path or j.model.config), f"{key}.judge.model.path", "set the judge's model")
        need(bool(j.template) != bool(j.template_file), f"{key}.judge.template",
             "set one of judge.template and judge.template_file")
        need(j.score_min < j.score_max, f"{key}.judge.score_min", "must be < judge.score_max")
        need(j.max_new_tokens >= 1 and j.batch_size >= 1, f"{key}.judge.max_new_tokens",
             "and judge.batch_size must be >= 1")
        need(j.temperature >= 0, f"{key}.judge.temperature", "must be >= 0 (0: greedy)")


def load_config(argv: Optional[list[str]] = None, cls=Config) -> Config:
    """Parse ``argv`` (default ``sys.argv[1:]``); ``--help`` prints every key and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip() + "\n\n" + configtree.help_text(cls))
        raise SystemExit(0)
    return configtree.load(cls, argv)


def save_config(cfg: Config, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(configtree.to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)


def config_from_dict(data: dict, cls=Config) -> Config:
    return configtree.build(cls, data)

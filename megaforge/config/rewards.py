"""Config section of the reward functions (``rewards:``): the entries of ``rewards.functions``, the
reward model and LLM judge they may carry, and the checks of one entry. Reward worker processes import
this module (RewardSpec) within a reward's start-up deadline: it imports no algorithm and no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megaforge.config.model import DType, ModelConfig
from megaforge.config.rollout import RolloutConfig
from megaforge.configtree import bounded


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
    """Regular expression whose first group is the verdict; the judge's answer must hold exactly one
    match, on its last non-empty line. Empty: ``Score: N`` (score) or ``Verdict: PASS|FAIL``
    (pass_fail), case-insensitive. An answer with no match, several, or its match elsewhere, or a
    score out of range, fails that sample (reward/errors, scored 0)."""
    score_min: float = 0.0
    """Lowest valid score."""
    score_max: float = 10.0
    """Highest valid score."""
    normalize: bool = True
    """Reward = (score - score_min) / (score_max - score_min), in [0, 1]; false: the score itself."""
    max_new_tokens: int = 256
    """Tokens the judge may write."""
    temperature: float = bounded(0.0, ge=0)
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
    """remote: seconds one attempt of a request may take, from connecting to the answer's last byte; a
    request still unanswered then fails its samples as timeouts (reward/timeouts). The whole call
    also stays within rewards.timeout_s."""
    max_response_mb: float = 4.0
    """remote: the largest answer read (MiB); a longer one fails its request unread (reward/errors)."""
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
    """Seconds a reward call gets from the moment a worker starts it (> 0; time queued does not count):
    a call not done by then scores 0 and counts in ``reward/timeouts``; its worker process is killed
    (with its process tree) and replaced, so calls queued behind hanging ones still run. After 2x the
    largest pool of one reward's calls timed out in a row, its queued calls of the phase are not run."""
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


def reward_label(spec: RewardSpec) -> str:
    """The reward's name in metrics and messages: ``label``, else the last part of ``name``."""
    return spec.label or spec.name.rsplit(":", 1)[-1]


_REMOTE_KEYS = ("url", "api_key", "api_key_env", "batch_size", "max_concurrency", "request_timeout_s", "retries",
                "backoff_s", "max_response_mb")


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
        need(spec.max_response_mb > 0, f"{key}.max_response_mb", "must be > 0")
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

"""megaforge as a Python library: the same code the launchers run, called from your own script.

A whole run (what ``python launchers/grpo.py --config X.yaml --key value`` does)::

    from megaforge import api
    cfg = api.load_config("configs/demo_cpu.yaml", {"max_steps": 20, "output_dir": "/tmp/runs"})
    run = api.run_grpo(cfg)              # SFT warm start (sft.max_steps), then RL; returns the finished Run
    print(run.run_dir)                   # config.yaml, metrics.jsonl, checkpoints/, ...

Step by step (generate -> score -> train -> push weights), through a :class:`Session`::

    with api.Session(cfg) as s:          # run folder, tokenizer, trainer, SFT warm start, engine, rewards
        samples = s.generate(["What is 2 + 3?"], labels=["5"])   # grpo.n_samples Sample objects a prompt
        s.score(samples)                 # sets sample.reward; returns reward/... metrics
        m = s.train_step(samples)        # advantages (algo.advantage), reference / old log-probs, optimizer step
        s.push_weights()                 # the trainer's new weights into the rollout engine

or from the pieces (:func:`load_tokenizer`, :func:`build_trainer`, :func:`build_engine`,
:func:`build_rewards`, then :func:`generate`, :func:`score`, :func:`train_step`, :func:`push_weights`).

Processes: one process needs nothing else (world size 1). Under ``torchrun`` every rank builds the
trainer and calls :func:`train_step` / :func:`push_weights` (collectives); the engine, the rewards,
generation and scoring are the main rank's (None / not called elsewhere; pass ``samples=None`` to
``train_step`` on the other ranks). Errors are exceptions (``ConfigError`` for configuration,
``megaforge.driver.common.RunError`` for a run that cannot go on); the launchers turn the same errors
into one ``megaforge: error:`` line.

This module imports torch only when a function that needs it is called (``import megaforge`` stays light).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Optional, Sequence, Union

from megaforge import configtree
from megaforge.config import Config
from megaforge.configtree import ConfigError

__all__ = ["Session", "build_engine", "build_rewards", "build_trainer", "generate", "load_config", "load_tokenizer",
           "prompt_rows", "push_weights", "run_grpo", "run_sft", "score", "train_step"]

ConfigSource = Union[str, "os.PathLike[str]", dict, Config, None]


def load_config(source: ConfigSource = None, overrides: Union[dict, Sequence[str], None] = None) -> Config:
    """A checked :class:`~megaforge.config.Config` from ``source`` (a YAML file's path, a nested dict of
    the YAML's form, a Config, or None for the defaults) and ``overrides`` (``{"grpo.n_samples": 4}``
    with dotted keys, or command-line arguments ``["--grpo.n_samples", "4"]``). Unknown keys, wrong types
    and values out of range raise ConfigError naming the key, as on the command line."""
    if isinstance(source, Config):
        tree = configtree.to_dict(source)
    elif isinstance(source, dict):
        tree = copy.deepcopy(source)
    elif isinstance(source, (str, os.PathLike)):
        tree = configtree.to_dict(configtree.load(Config, ["--config", os.fspath(source)]))
    elif source is None:
        tree = {}
    else:
        raise TypeError(f"load_config: source must be a YAML file's path, a dict or a Config, not "
                        f"{type(source).__name__}")
    if overrides is None:
        overrides = {}
    elif isinstance(overrides, (list, tuple)):
        path, overrides = configtree.parse_cli([str(a) for a in overrides])
        if path:
            raise ConfigError("load_config: give the YAML file as source, not as --config in overrides")
    elif not isinstance(overrides, dict):
        raise TypeError(f"load_config: overrides must be a dict of dotted keys or a list of command-line "
                        f"arguments, not {type(overrides).__name__}")
    for k, v in overrides.items():
        configtree.set_dotted(tree, k, v)
    configtree.check_keys(Config, overrides, tree)
    return configtree.build(Config, tree)


def _config(cfg) -> Config:
    return cfg if isinstance(cfg, Config) else load_config(cfg)


def run_grpo(cfg):
    """A whole RL run (``launchers/grpo.py``): SFT warm start, then ``max_steps`` RL steps, checkpoints,
    metrics. ``cfg``: a Config or anything :func:`load_config` takes. Returns the finished
    :class:`megaforge.loop.Run` (``run.run_dir``, ``run.state``)."""
    from megaforge import loop  # lazy: torch

    return loop.run_grpo(_config(cfg))


def run_sft(cfg):
    """A supervised run (``launchers/sft.py``); returns the finished :class:`megaforge.loop.Run`."""
    from megaforge import loop  # lazy: torch

    return loop.run_sft(_config(cfg))


# ------------------------------------------------------------------------------------- the pieces
# Each function below is a thin call into the build step (megaforge.build.RunBuilder), which reads the
# configuration and hands each piece only its own sections.
def load_tokenizer(cfg):
    """The policy's tokenizer (``model.tokenizer``, else ``model.path``)."""
    from megaforge.build import RunBuilder

    return RunBuilder(_config(cfg)).load_tokenizer()


def build_trainer(cfg, tokenizer=None, rl: bool = True):
    """The configured trainer (``trainer.backend``; the process group from torchrun's variables first,
    none for one process). ``rl``: set up as a run's RL phase starts (optimizer and schedule over
    ``max_steps``, the frozen reference when ``grpo.beta`` > 0); False: as built, for SFT."""
    from megaforge.build import RunBuilder

    return RunBuilder(_config(cfg)).library_trainer(tokenizer, rl)


def build_engine(cfg, tokenizer=None):
    """The configured rollout engine (``rollout.engine``: in-process, or engine servers this process
    starts); None on ranks other than the main one. Call ``engine.shutdown()`` when done. It serves the
    model's own weights until :func:`push_weights` gives it the trainer's."""
    from megaforge.build import RunBuilder

    return RunBuilder(_config(cfg)).library_engine(tokenizer)


def build_rewards(cfg):
    """The configured rewards (``rewards.functions``) in their worker processes; ``close()`` when done."""
    from megaforge.build import RunBuilder

    return RunBuilder(_config(cfg)).rewards()


def prompt_rows(tokenizer, prompts: Sequence, cfg, labels: Optional[Sequence] = None) -> list:
    """Prompt rows (:class:`megaforge.data.prompts.PromptRow`) from prompt texts or chat message lists,
    through the chat template as a run's data (``data.apply_chat_template``, ``data.system_prompt``);
    ``labels``: each prompt's reference answer for the rewards. Rows given as PromptRow pass through."""
    from megaforge.build import RunBuilder

    return RunBuilder(_config(cfg)).prompt_rows(tokenizer, prompts, labels)


def generate(engine, tokenizer, prompts: Sequence, cfg, labels: Optional[Sequence] = None, step: int = 1,
             n: Optional[int] = None, stop_ids: Optional[list] = None) -> list:
    """``n`` (default ``grpo.n_samples``) sampled responses to each prompt, as unscored
    :class:`~megaforge.types.Sample` objects (prompt-major, one group id per prompt), with the run's
    sampling (``grpo.temperature``, ``rollout.*``) and seeds (``seed``, ``step``); multi-turn through
    ``rollout.generate_fn`` when it is set."""
    from megaforge.build import RunBuilder

    b = RunBuilder(_config(cfg))
    return b.generate(engine, tokenizer, b.prompt_rows(tokenizer, prompts, labels), step, n, stop_ids)


def score(samples: list, rewards, cfg) -> dict:
    """Each sample's ``reward`` set by ``rewards`` (plus DAPO's overlong shaping with
    ``algo.overlong_buffer``); returns the means ``reward/mean``, ``reward/<label>`` and the counts
    ``reward/errors``, ``reward/timeouts``."""
    from megaforge.build import RunBuilder
    from megaforge.driver.steps import StepParts

    m: dict = {}
    StepParts.score(_Scorer(RunBuilder(_config(cfg)).step_settings(), rewards), samples, m)
    n = max(len(samples), 1)
    out = {k: (v if k in ("reward/errors", "reward/timeouts") or k.startswith("time/") else v / n) for k, v in m.items()}
    out["reward/mean"] = sum(s.reward for s in samples) / n
    return out


class _Scorer:
    """What :meth:`StepParts.score` reads of its object (no trainer or engine needed to score)."""

    def __init__(self, settings, rewards):
        self.settings, self.rewards = settings, rewards


def train_step(trainer, samples: Optional[list], cfg, engine=None) -> dict:
    """One RL update of ``trainer`` on scored ``samples`` (the main rank's; None on the others), as a
    run's step trains: advantages by ``algo.advantage`` over the samples' groups, reference and old
    log-probs where the objective needs them, ``trainer.mini_batches`` x ``trainer.epochs`` optimizer
    steps. With ``engine`` its memory is released for the update (colocated GPUs). Returns the step's
    metrics (``loss``, ``grad_norm``, ``advantages/nonzero_frac``, ...)."""
    from megaforge.build import RunBuilder
    from megaforge.data.batch import samples_to_batch

    parts = RunBuilder(_config(cfg)).library_parts(trainer, engine)
    batch = None
    if samples is not None:
        if not samples:
            raise ValueError("train_step: no samples")
        tok = getattr(trainer, "tokenizer", None)  # the pad id only fills positions past each row's length
        batch = samples_to_batch(samples, tok.pad_token_id if tok is not None else 0)
    m: dict = {}
    parts.train(batch, m, colocated=engine is not None, keep_weights=True)
    return m


def push_weights(trainer, engine, cfg) -> dict:
    """The trainer's weights into ``engine`` (every rank calls it; None on ranks without the engine):
    ``sync.transport``, ``sync.bucket_mb``, ``sync.check_equal``; the engine then serves weight version
    ``trainer.version``. Returns the sync's timings and peak-memory metrics."""
    from megaforge.build import RunBuilder

    m: dict = {}
    RunBuilder(_config(cfg)).library_parts(trainer, engine).push(m)
    return m


# --------------------------------------------------------------------------------------- a session
class Session:
    """A run folder with a trainer, a rollout engine, rewards and prompt data, driven by your code:
    what a run sets up before its first RL step (:meth:`megaforge.loop.Run.start_rl`: the SFT warm start
    of ``sft.max_steps`` first, unless ``sft=False``). Use it as a context manager (or call
    :meth:`close`): it holds the run folder's lock, engine servers and reward workers."""

    def __init__(self, cfg, sft: bool = True):
        from megaforge.loop import Run  # lazy: torch

        self.cfg = _config(cfg)
        self.run = Run(self.cfg, "grpo")
        try:
            if sft:
                self.run.sft()
            self.run.start_rl()
        except BaseException:
            self.close()
            raise
        self.tokenizer, self.trainer, self.engine = self.run.tokenizer, self.run.trainer, self.run.engine
        self.rewards, self.data = self.run.rewards, self.run.data
        self.step = 0

    @property
    def run_dir(self) -> str:
        return self.run.run_dir

    def prompts(self, n: Optional[int] = None) -> list:
        """The next ``n`` (default ``rollout.batch_size``) prompt rows of ``data.path``."""
        return self.data.next_batch(n or self.cfg.rollout.batch_size)

    def generate(self, prompts: Optional[Sequence] = None, labels: Optional[Sequence] = None) -> list:
        """:func:`generate` on this session's engine: ``prompts`` (texts, message lists or rows; None: the
        next :meth:`prompts`), seeded by the next step number."""
        self.step += 1
        return generate(self.engine, self.tokenizer, self.prompts() if prompts is None else prompts, self.cfg,
                        labels, step=self.step, stop_ids=self.run.stop_ids)

    def score(self, samples: list) -> dict:
        """:func:`score` with this session's rewards."""
        return score(samples, self.rewards, self.cfg)

    def train_step(self, samples: Optional[list]) -> dict:
        """:func:`train_step` of this session's trainer (the engine's memory released around it)."""
        return train_step(self.trainer, samples, self.cfg, self.engine)

    def push_weights(self) -> dict:
        """:func:`push_weights` from this session's trainer into its engine."""
        return push_weights(self.trainer, self.engine, self.cfg)

    def close(self) -> None:
        """Engine servers, reward workers and the run folder's lock released."""
        run, self.run = getattr(self, "run", None), None
        if run is not None:
            run.close_rl()
            run.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

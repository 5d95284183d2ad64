"""Multi-turn rollouts (megaforge.rollout.agent.multiturn) and tools: environment tokens carry mask 0 on the
TrainBatch and get exactly zero gradient; tool-call parsing; the calculator; the generate_fn checks."""
import os

import pytest
import torch

from megaforge.config import load_config
from megaforge.data.batch import samples_to_batch
from megaforge.hf import load_hf_model, load_tokenizer
from megaforge.rollout.embedded import EmbeddedEngine
from megaforge.build import RunBuilder
from megaforge.rollout.manager import make_requests, score, stop_token_ids
from megaforge.rollout.agent.multiturn import ToolEnv, call_generate_fn, run_episodes
from megaforge.rollout.agent.tools import Calculator, build_tools, parse_call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
OBS = "<result>again</result>"


class Feedback:
    """An environment that answers every turn (a judge giving feedback) for two turns, then ends the
    episode; reward 0.5 per feedback turn and 1 at the end."""

    stop: list = []
    gives_reward = True

    def __init__(self):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return (OBS, False, 0.5) if self.turns < 3 else (None, True, 1.0)


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(["--config", DEMO, "--grpo.beta", "0.1", "--rollout.max_new_tokens", "40"])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    engine = EmbeddedEngine(load_hf_model(cfg.model, torch.device("cpu")), tok)
    return cfg, tok, engine


def episodes(cfg, tok, engine, n_rows=3, n=2, max_tool_tokens=5):
    from megaforge.data.prompts import PromptSource

    rows = PromptSource(cfg.data, tok, 0).next_batch(n_rows)
    reqs = make_requests(rows, n, RunBuilder(cfg).sampling().params(stop_token_ids(tok)), 0, 1)
    envs = [Feedback() for _ in reqs]
    return rows, run_episodes(engine, reqs, envs, tok, 40, max_turns=4, max_tool_tokens=max_tool_tokens,
                              max_turn_tokens=6)


def test_env_tokens_are_masked_on_the_batch_and_get_zero_gradient(setup):
    from megaforge.algorithms import policy_objective
    from megaforge.trainer.logprobs import token_logprobs

    cfg, tok, engine = setup
    rows, samples = episodes(cfg, tok, engine)
    obs_ids = tok(OBS, add_special_tokens=False)["input_ids"][:5]
    for s in samples:
        assert s.metadata["env_reward"] == pytest.approx(2.0) or s.finish_reason == "stop"  # EOS may end it early
        # structure: model turns of <= 6 tokens (mask 1) separated by the cut observation (mask 0, logprob 0)
        env = [t for t, k in enumerate(s.response_mask) if k == 0]
        if s.metadata["episode"]["turns"] == 3:
            assert len(env) == 2 * len(obs_ids)
        for t in env:
            assert s.rollout_logprobs[t] == 0.0
        runs = [s.response_ids[t: t + len(obs_ids)] for t in env if t == 0 or s.response_mask[t - 1] == 1]
        assert all(r == obs_ids for r in runs)
    assert sum(len([k for k in s.response_mask if k == 0]) for s in samples) > 0
    for s in samples:
        s.group_id, s.reward = 0, float(len(s.response_ids) % 3)
    batch = samples_to_batch(samples, tok.pad_token_id)
    env_pos = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    model_pos = torch.zeros_like(env_pos)
    for b, s in enumerate(samples):
        p = len(s.prompt_ids)
        for t, k in enumerate(s.response_mask):
            (model_pos if k else env_pos)[b, p + t] = True
    assert torch.all(batch.loss_mask[env_pos] == 0) and torch.all(batch.loss_mask[model_pos] == 1)
    assert torch.all(batch.rollout_logprobs[env_pos] == 0)
    assert int(batch.loss_mask.sum()) == int(model_pos.sum()) == batch.num_tokens

    # the loss's gradient w.r.t. every token's logprob: exactly 0 on environment tokens, with a KL term
    # and advantages that are non-zero everywhere (also on the environment tokens)
    torch.manual_seed(1)
    batch.advantages = torch.randn_like(batch.loss_mask) + 2.0
    batch.ref_logprobs = batch.rollout_logprobs - 0.1 * torch.rand_like(batch.loss_mask)
    model = engine.model
    T = batch.tokens.shape[1]
    attn = (torch.arange(T)[None, :] < batch.lengths[:, None]).long()
    logits = model(input_ids=batch.tokens, attention_mask=attn, use_cache=False).logits
    lp, _ = token_logprobs(logits, batch.tokens, batch.lengths, cfg.grpo.temperature, False)
    lp.retain_grad()
    params = RunBuilder(cfg).objective()
    loss, _ = policy_objective(lp, batch, params)
    loss.backward()
    assert torch.all(lp.grad[env_pos] == 0)
    assert (lp.grad[model_pos] != 0).float().mean() > 0.9
    # and the loss does not depend on what sits at environment positions in advantages / rollout logprobs
    moved = batch.replace(advantages=torch.where(env_pos, batch.advantages * 100, batch.advantages),
                          ref_logprobs=torch.where(env_pos, batch.ref_logprobs - 5, batch.ref_logprobs))
    loss2, _ = policy_objective(lp.detach(), moved, params)
    assert float(loss2) == float(loss.detach())


def test_episode_reward_is_added_to_the_reward_functions(setup):
    cfg, tok, engine = setup
    from megaforge.rewards import RewardManager

    _, samples = episodes(cfg, tok, engine, n_rows=2)
    for s in samples:
        s.label = "3"
    m = score(samples, RewardManager(cfg.rewards))
    for s in samples:
        assert s.reward == pytest.approx(s.metadata["env_reward"])  # the random model never answers right
    assert m["reward/env"] == pytest.approx(sum(s.metadata["env_reward"] for s in samples) / len(samples))
    assert m["episode/turns"] > 1


def test_parse_call():
    assert parse_call("I will compute <tool>calculator: 47*86</tool>") == ("calculator", "47*86")
    assert parse_call("<tool>python:\nprint(1)\n</tool>") == ("python", "print(1)")
    assert parse_call("<tool>a: 1</tool> then <tool>b: 2</tool>") == ("b", "2")
    for bad in ("no call", "<tool>calculator 3*7</tool>", "<tool>calculator: 3*7", "calculator: 3*7</tool>"):
        assert parse_call(bad) is None


def test_calculator_is_exact_and_safe():
    c = Calculator()
    assert c("47*86") == "4042" and c(" (2+3) * -4 ") == "-20" and c("7/2") == "3.5" and c("2**10") == "1024"
    assert c("10/4*2") == "5"
    assert c("1/0") == "error: division by zero"
    for bad in ("__import__('os').system('echo hi')", "[1]*3", "a+1", "9**9**9", "'x'*3", ""):
        assert c(bad).startswith("error:"), bad
    assert c("2**64") == str(2 ** 64) and c("2**65").startswith("error")


def test_tool_env_runs_the_named_tool_and_reports_errors():
    env = ToolEnv(build_tools(["calculator"]))
    assert env.step("<tool>calculator: 6*7</tool>") == ("<result>42</result>", False, 0.0)
    obs, done, _ = env.step("<tool>search: cats</tool>")
    assert obs.startswith("<result>error: unknown tool 'search'") and not done
    assert env.step("\\boxed{42}") == (None, True, 0.0)
    assert env.metrics() == {"tool_calls": 2.0, "tool_errors": 1.0, "used_tool": 1.0}


def bad_count(engine, requests, rows, tokenizer, ctx):
    return []


def test_generate_fn_answer_is_checked(setup):
    cfg, tok, engine = setup
    from megaforge.data.prompts import PromptSource

    rows = PromptSource(cfg.data, tok, 0).next_batch(1)
    reqs = make_requests(rows, 2, RunBuilder(cfg).sampling().params(stop_token_ids(tok)), 0, 1)
    cfg2 = load_config(["--config", DEMO, "--rollout.generate_fn", f"{__name__}:bad_count"])
    with pytest.raises(ValueError, match="rollout.generate_fn .* must return a list of 2 Samples"):
        call_generate_fn(RunBuilder(cfg2).generate_context(), engine, reqs, rows, 2, tok, 0)


def test_generate_fn_that_does_not_import_fails_at_startup_naming_where_it_moved():
    # rollout.generate_fn is checked before any work (preflight), and a megaforge module that moved
    # into a folder (multiturn went to rollout/agent/) is named at its new place.
    from megaforge.configtree import ConfigError
    from megaforge.build import RunBuilder

    cfg = load_config(["--config", DEMO, "--rollout.generate_fn", "megaforge.rollout.multiturn:tool_rollout"])
    with pytest.raises(ConfigError, match=r"rollout\.generate_fn .*did you mean 'megaforge\.rollout\.agent\.multiturn'"):
        RunBuilder(cfg).preflight()
    RunBuilder(load_config(["--config", DEMO, "--rollout.generate_fn", "megaforge.rollout.agent.multiturn:tool_rollout"])).preflight()

"""Partial rollouts (megaforge.rollout.partial): every sample is returned exactly once across steps,
continuations really continue (prompt + earlier tokens as context), old-weight tokens are masked or
kept as configured, and the pool's state survives a JSON round trip exactly."""
import json

import pytest
import torch

from loop_helpers import DEMO, launch
from megaforge.config import load_config
from megaforge.data.prompts import PromptSource
from megaforge.hf import load_hf_model, load_tokenizer
from megaforge.rewards import RewardManager
from megaforge.rollout.embedded import EmbeddedEngine
from megaforge.build import RunBuilder
from megaforge.rollout.manager import score, stop_token_ids
from megaforge.rollout.partial import PartialPool


def make_pool(*overrides, engine=None):
    cfg = load_config(["--config", DEMO, "--rollout.batch_size", "3", "--grpo.n_samples", "2",
                       "--rollout.max_new_tokens", "12", "--loop.partial_rollouts", "true",
                       "--loop.partial_budget_tokens", "4", "--loop.max_staleness", "3", *overrides])
    tok = load_tokenizer(cfg.model)
    if engine is None:
        torch.manual_seed(0)
        engine = EmbeddedEngine(load_hf_model(cfg.model, torch.device("cpu")), tok)
    rewards = RewardManager(cfg.rewards)

    def score_fn(samples, m):
        score(samples, rewards)
        return samples

    data = PromptSource(cfg.data, tok, cfg.seed)
    pool = PartialPool(engine, data, tok, cfg.loop, cfg.grpo.n_samples, cfg.rollout.max_new_tokens, cfg.seed, score_fn,
                       RunBuilder(cfg).sampling().params(stop_token_ids(tok)))
    return pool, engine, cfg


def steps(pool, engine, n_steps, start=1):
    """Run ``n_steps`` steps: the engine's version goes up by one between steps (as after an update)."""
    out = []
    for step in range(start, start + n_steps):
        engine.set_version(step - 1)
        pool.train_version = step - 1
        out.append(pool.generate(step, 3, 0, {}))
    return out


def test_every_sample_exactly_once_and_continuations_continue():
    pool, engine, cfg = make_pool()
    batches = steps(pool, engine, 6)
    uids = [s.metadata["uid"] for b in batches for s in b]
    assert len(uids) == len(set(uids)), "a sample was returned twice"
    pending = {f"{g.gid}:{e.j}" for g in pool.inflight + pool.ready for e in g.episodes}
    drawn = {f"{gid}:{j}" for gid in range(pool.next_gid) for j in range(2)}
    assert set(uids) | pending == drawn and not set(uids) & pending  # nothing lost, nothing duplicated
    assert all(len(b) == 6 for b in batches)  # 3 groups x 2 samples every step
    cont = [s for b in batches for s in b if s.metadata["segments"] > 1]
    assert cont, "no sample was continued across rounds"
    # a continued sample's tokens were generated in context: with unchanged weights (only the version
    # moved) each rollout logprob equals the model's logprob of that token given prompt + all earlier tokens
    model = engine.model
    for s in cont[:6]:
        assert len(s.response_ids) <= cfg.rollout.max_new_tokens
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        p = len(s.prompt_ids)
        ref = [float(logp[p + t - 1, tok]) for t, tok in enumerate(s.response_ids)]
        # float32 logprobs of segments decoded with a KV cache across rounds vs one full forward: other
        # sum orders, ~1-2 ulp of |lp| <= 8 (4.8e-7 measured); a continuation decoded without its
        # earlier segments as context differs by orders of magnitude more
        assert ref == pytest.approx(s.rollout_logprobs, abs=1e-5)
        # mask mode: only the last segment's tokens (newest version) are trained
        versions_newest = s.weight_version
        assert all(m == 0 for m in s.response_mask[: len(s.response_mask) - sum(s.response_mask)])
        assert sum(s.response_mask) > 0 and versions_newest >= s.metadata["oldest_version"]


def test_correct_mode_keeps_old_tokens_and_bounds_staleness():
    pool, engine, _ = make_pool("--loop.partial_old_tokens", "correct", "--algo.tis_cap", "2.0",
                                "--loop.max_staleness", "1")
    batches = steps(pool, engine, 6)
    for step, b in enumerate(batches, start=1):
        V = step - 1
        for s in b:
            # old-version tokens are trained (mask 1) unless older than K = 1; the sample's version is
            # the oldest trained token's, so V - weight_version <= K
            assert V - s.weight_version <= 1
            if s.metadata["segments"] > 1 and V - s.metadata["oldest_version"] <= 1:
                assert all(s.response_mask)
    assert any(0 in s.response_mask for b in batches for s in b)  # some tokens were older than K


def test_pool_state_round_trip_is_exact():
    pool, engine, _ = make_pool()
    steps(pool, engine, 2)
    state = json.loads(json.dumps(pool.state_dict()))
    twin, _, _ = make_pool(engine=engine)
    twin.data.load_state_dict(pool.data.state_dict())
    twin.load_state_dict(state)
    a = steps(pool, engine, 3, start=3)
    b = steps(twin, engine, 3, start=3)
    for x, y in zip(a, b):
        assert [(s.metadata["uid"], s.response_ids, s.rollout_logprobs, s.response_mask, s.reward) for s in x] == \
               [(s.metadata["uid"], s.response_ids, s.rollout_logprobs, s.response_mask, s.reward) for s in y]


def test_partial_rollouts_in_the_loop_account_for_every_group(tmp_path):
    recs = launch(str(tmp_path), "p", "--max_steps", "5", "--loop.partial_rollouts", "true",
                  "--loop.partial_budget_tokens", "4", "--loop.max_staleness", "3")
    for r in recs:
        assert r["partial/groups_drawn_total"] == r["partial/groups_returned_total"] + r["partial/groups_pending"]
        assert r["staleness/max"] <= 3
    assert recs[-1]["partial/groups_returned_total"] == 5 * 4  # batch_size groups every step
    assert sum(r["partial/continued_samples"] for r in recs) > 0
    assert sum(r["partial/masked_old_tokens"] for r in recs) > 0

"""The tool-use example, short: SFT warm start on mixed traces, then GRPO with multi-turn calculator
rollouts; the reward and the tool use rise. The trained model's real tool episodes carry the tool's
result with loss mask 0 on the TrainBatch."""
import json
import os
import subprocess
import sys

import pytest
import torch

# ~2 min on 2 cores (280 SFT steps before the RL steps): out of the default run, which keeps the tool
# rollouts' masking and rewards (test_multiturn_tools.py); `python -m pytest -q tests -m ''` runs it
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIG = os.path.join(ROOT, "examples", "tool_use", "tool_use.yaml")
STEPS = 12
# the example's recipe, shortened: 280 SFT steps of 48 traces, half of them calling the tool (the copy of
# operands and result is learned around step 200-240), then 12 RL steps of 8 prompts x 8 samples
SHORT = ["--sft.max_steps", "280", "--sft.batch_size", "48", "--data.synthetic_kwargs", "{tool_fraction: 0.5}",
         "--max_steps", str(STEPS), "--rollout.batch_size", "8",
         "--metrics.progress", "false", "--metrics.log_samples", "0", "--export_hf_every", str(STEPS)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tool_use"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), "--config", CONFIG, *SHORT,
                        "--output_dir", out, "--run_name", "t"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run_dir = os.path.join(out, "t")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(l) for l in f]


def test_reward_and_tool_use_rise(run):
    _, recs = run
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    reward = [r["reward/mean"] for r in recs]
    used = [r["episode/used_tool"] for r in recs]
    # a step's mean over 64 episodes is noisy (+-0.2): compare 4-step windows
    first, last = sum(reward[:4]) / 4, sum(reward[-4:]) / 4
    print("\nreward/mean", [round(x, 2) for x in reward], "\nepisode/used_tool", [round(x, 2) for x in used])
    assert last > first + 0.1, reward
    assert sum(used[-4:]) / 4 > sum(used[:4]) / 4 + 0.2, used
    # the tool's tokens are environment tokens: trained tokens are fewer than response tokens
    assert all(r["episode/turns"] >= 1 for r in recs)


def _mask_runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """[(mask value, token ids)] for each maximal run of equal mask values, in order."""
    runs = []
    for t, k in zip(ids, mask):
        if runs and runs[-1][0] == k:
            runs[-1][1].append(t)
        else:
            runs.append((k, [t]))
    return runs


def test_trained_model_tool_episodes_mask_the_results(run):
    """Whatever the trained model writes on this machine: every model turn that calls the tool is
    followed by environment tokens (loss mask 0, logprob 0) that are the tool's answer to that call,
    tokenized and cut to rollout.max_tool_tokens and to the response budget."""
    from megaforge.config import load_config
    from megaforge.data.batch import samples_to_batch
    from megaforge.data.prompts import PromptSource
    from megaforge.hf import load_tokenizer
    from megaforge.rollout.embedded import EmbeddedEngine
    from megaforge.build import RunBuilder
    from megaforge.rollout.manager import generate_samples, stop_token_ids
    from megaforge.rollout.agent.tools import Calculator, parse_call

    run_dir, _ = run
    cfg = load_config(["--config", CONFIG, "--model.path", os.path.join(run_dir, "hf", f"step_{STEPS}")])
    import examples.tool_use.task  # noqa: F401  (registers the synthetic task)

    tok = load_tokenizer(cfg.model)
    engine = EmbeddedEngine.from_spec(RunBuilder(cfg).engine_spec(), tok, "cpu")
    rows = PromptSource(cfg.data, tok, 1).next_batch(8)
    b = RunBuilder(cfg)
    samples = generate_samples(engine, rows, 2, b.sampling().params(stop_token_ids(tok)), 1, 1, 0, tok,
                               b.generate_context())
    called = [s for s in samples if s.metadata["episode"]["tool_calls"] > 0]
    # the trained model calls the tool (test_reward_and_tool_use_rise checks the rate); one call
    # episode is enough to check the masking on
    assert called, [s.response_text for s in samples]
    batch = samples_to_batch(samples, tok.pad_token_id)
    calc, cut, budget = Calculator(), cfg.rollout.max_tool_tokens, cfg.rollout.max_new_tokens
    for b, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        m = torch.tensor(s.response_mask, dtype=torch.float32)
        assert torch.equal(batch.loss_mask[b, p: p + n], m)
        assert torch.all(batch.rollout_logprobs[b, p: p + n][m == 0] == 0)
        runs = _mask_runs(s.response_ids, s.response_mask)
        assert runs[0][0] == 1, runs
        used, calls = 0, 0
        for i, (k, ids) in enumerate(runs):
            if k == 1:  # one model turn (turns alternate with the environment's answers)
                used += len(ids)
                calls += parse_call(tok.decode(ids, skip_special_tokens=True)) is not None
                continue
            # the environment's answer to the call of the model turn before it
            call = parse_call(tok.decode(runs[i - 1][1], skip_special_tokens=True))
            assert call is not None and call[0] == "calculator", (s.response_text, call)
            obs = f"<result>{calc(call[1])}</result>"
            want = list(tok(obs, add_special_tokens=False)["input_ids"])[:min(cut, budget - used)]
            assert ids == want, (obs, tok.decode(ids), cut, budget - used)
            assert obs.startswith(tok.decode(ids))  # the cut keeps a prefix of the tool's output
            used += len(ids)
        assert calls == s.metadata["episode"]["tool_calls"], (s.response_text, calls)

"""The tool-use example, short: SFT warm start on mixed traces, then GRPO with multi-turn calculator
rollouts; the reward and the tool use rise. The trained model's real tool episodes carry the tool's
result with loss mask 0 on the TrainBatch."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def test_trained_model_tool_episodes_mask_the_results(run):
    from megaforge.config import load_config
    from megaforge.data.batch import samples_to_batch
    from megaforge.data.prompts import PromptSource
    from megaforge.hf import load_tokenizer
    from megaforge.rollout.embedded import EmbeddedEngine
    from megaforge.rollout.manager import generate_samples, sampling_params, stop_token_ids
    from megaforge.rollout.tools import Calculator

    run_dir, _ = run
    cfg = load_config(["--config", CONFIG, "--model.path", os.path.join(run_dir, "hf", f"step_{STEPS}")])
    import examples.tool_use.task  # noqa: F401  (registers the synthetic task)

    tok = load_tokenizer(cfg.model)
    engine = EmbeddedEngine.from_config(cfg, tok, "cpu")
    rows = PromptSource(cfg.data, tok, 1).next_batch(8)
    samples = generate_samples(engine, rows, 2, sampling_params(cfg, stop_token_ids(tok)), 1, 1, 0, tok, cfg)
    called = [s for s in samples if s.metadata["episode"]["tool_calls"] > 0]
    assert len(called) >= 8, [s.response_text for s in samples]
    batch = samples_to_batch(samples, tok.pad_token_id)
    for b, s in enumerate(samples):
        text = s.response_text
        if s not in called:
            assert all(s.response_mask)
            continue
        # the environment's tokens decode to exactly the "<result>...</result>" observation(s)
        env_ids = [t for t, k in zip(s.response_ids, s.response_mask) if k == 0]
        a, b_ = text.index("<tool>"), text.index("</tool>")
        expr = text[a + len("<tool>calculator:"): b_].strip()
        assert tok.decode(env_ids) == f"<result>{Calculator()(expr)}</result>"
        p = len(s.prompt_ids)
        m = torch.tensor(s.response_mask, dtype=torch.float32)
        assert torch.equal(batch.loss_mask[b, p: p + len(s.response_ids)], m)
        assert torch.all(batch.rollout_logprobs[b, p: p + len(s.response_ids)][m == 0] == 0)

"""tools/evaluate.py (issue 41, point 9): without --out its per-sample file goes beside the run it
evaluates (``<run>/eval/evaluate/<checkpoint>/<set>.jsonl``), not into the working directory; its
refusal of a set that shares prompts with the run's training data names the flag that overrides it."""
import importlib.util
import json
import os
import sys

from eval_helpers import ROOT, launch_here, samples

sys.path.insert(0, os.path.join(ROOT, "tools"))
_spec = importlib.util.spec_from_file_location("megaforge_evaluate_tool_out", os.path.join(ROOT, "tools", "evaluate.py"))
TOOL = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TOOL)


def run_tool(capsys, *args):
    rc = TOOL.main(list(args))
    out, err = capsys.readouterr()
    return rc, (json.loads(out.strip().splitlines()[-1]) if rc == 0 else None), err


def test_output_beside_the_run_and_the_disjointness_override_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the run's config.yaml holds paths relative to the repository root
    launch_here(str(tmp_path), "r", "--max_steps", "1")
    run = tmp_path / "r"
    shared = tmp_path / "shared.jsonl"  # prompts of the synthetic training task (every a + b of 0..9 is there)
    shared.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "answer": str(a + 2)}) + "\n"
                              for a in range(3)))
    before = set(os.listdir(ROOT))
    rc, _, err = run_tool(capsys, "--model", str(run), "--data", str(shared), "--k", "0")
    assert rc == 1 and "has the same prompt as training row" in err, err[-2000:]
    line = err.strip().splitlines()[-1]  # (before it: transformers' shard-writing progress bar)
    assert line.startswith("evaluate: error: eval set 'shared'") and line.endswith("--eval.check_disjoint false")
    rc, got, err = run_tool(capsys, "--model", str(run), "--data", str(shared), "--k", "0",
                            "--eval.check_disjoint", "false", "--rollout.max_new_tokens", "4")
    assert rc == 0, err[-2000:]
    want = run / "eval" / "evaluate" / "step_000001" / "shared.jsonl"
    assert got["samples/shared"] == str(want) and len(samples(str(want))) == 3
    assert set(os.listdir(ROOT)) == before  # nothing written into the working directory

"""Expert parallelism of the Megatron backend on the CPU (gloo): the tiny Qwen3-MoE of
tests/convert (4 layers, layer 0 dense, 4 experts top-2, float32) at EP 2 alone, with TP 2 +
sequence parallel, with PP 2, and with expert-TP 2; each against transformers (logprobs) and against
the EP 1 trainer (one RL step's reduced gradients, gathered to whole HF tensors through the
converter; metrics; weights after the step). The shared batch has 5 rows in micro-batches of 2, so
at DP 2 the ranks hold 3 and 2 rows (2 and 1 micro-batches): the MoE filler micro-batches keep the
expert all-to-all from hanging, and must add nothing. EP 2's checkpoint resumes at EP 1 x TP 2 + SP
(expert-TP 1: expert-DP 2 != DP 1, which needs the expert parameters' own gradient reduction).
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "convert"))

import mt_helpers  # noqa: E402
from cv_helpers import MODELS, make_model  # noqa: E402

WORKER = os.path.join(HERE, "moe_worker.py")
VOCAB = MODELS["qwen3_moe"]["vocab"]
#: logprobs vs transformers in float32 (the issue's bound; 9.5e-7 measured at every layout)
HF_TOL = 1e-4
#: same weights, another layout: only the float32 summation order differs (which rank adds which
#: tokens' contributions, the DP all-reduce of two halves, the TP reduction): a few ulp of the
#: logprobs (~6) -> 1e-5, the bound of the dense layout comparisons (tests/megatron)
LAYOUT_TOL = 1e-5
#: gradients: the same summation-order rounding, relative to the largest gradient of the tensor
#: (float32 eps 1.2e-7 times sums over ~100 tokens and 64..96 hidden units)
GRAD_RTOL = 1e-5
#: weights after an Adam step (lr 1e-3, eps 1e-6): Adam amplifies gradient rounding |g| <~ eps by
#: lr / eps (test_megatron_parity.py's WEIGHT_TOL)
WEIGHT_TOL = 3e-5


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ep")
    path = make_model(str(root / "qwen3_moe"), **MODELS["qwen3_moe"])
    batch = mt_helpers.make_batch(vocab=VOCAB)
    ref = run(root, path, "ep1", {}, 1)
    return {"root": root, "path": path, "hf": mt_helpers.hf_logprobs(path, batch, temperature=0.8),
            "ref": ref, "valid": lp_positions(batch)}


def lp_positions(batch) -> torch.Tensor:
    t = torch.arange(batch.tokens.shape[1])[None]
    return (t >= 1) & (t < batch.lengths[:, None])


def run(root, path, name: str, layout: dict, nprocs: int, **extra) -> dict:
    """Rank 0's results of moe_worker at ``layout`` (every rank's logprobs checked equal)."""
    spec = {"model": path, "layout": layout, "vocab": VOCAB, **extra}
    res = mt_helpers.run_workers("moe", nprocs, spec, root / name, timeout=600, worker=WORKER)
    for r in res[1:]:
        assert torch.equal(r["lp"], res[0]["lp"])
    return res[0]


def max_diff(a, b, valid) -> float:
    return float((a - b).abs()[valid].max())


def check_against_ep1(moe, got: dict) -> dict:
    """Logprobs vs HF and EP 1, gradients / metrics / weights after the step vs EP 1; the figures."""
    ref, valid = moe["ref"], moe["valid"]
    out = {"hf": max_diff(got["lp"], moe["hf"], valid), "ep1": max_diff(got["lp"], ref["lp"], valid)}
    assert out["hf"] <= HF_TOL and out["ep1"] <= LAYOUT_TOL, out
    assert got["grads"].keys() == ref["grads"].keys()
    worst = (0.0, "")
    for k, g in ref["grads"].items():
        scale = float(g.abs().max())
        d = float((got["grads"][k] - g).abs().max()) / max(scale, 1e-12)
        worst = max(worst, (d, k))
    assert worst[0] <= GRAD_RTOL, f"gradient {worst[1]} differs from EP 1's by {worst[0]:.3g} of its largest entry"
    moved = max(float(ref["grads"][k].abs().max()) for k in ref["grads"] if ".experts." in k)
    assert moved > 1e-4  # the experts are trained (the comparison is not one of zeros)
    out["grad_rel"] = worst[0]
    for k, v in ref["metrics"].items():
        assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    out["weights"] = max(float((got["weights"][k] - w).abs().max()) for k, w in ref["weights"].items())
    assert out["weights"] <= WEIGHT_TOL, out
    print(f"\n{out}")
    return out


def test_ep2_logprobs_grads_and_resume_at_ep1_tp2(moe):
    """EP 2 on 2 ranks (DP 2, uneven micro-batch counts); its checkpoint (after one step) loads at
    EP 1 x TP 2 + SP, expert-TP 1: same logprobs, and the same second step (Adam state resharded)."""
    got = run(moe["root"], moe["path"], "ep2", {"ep": 2}, 2,
              ckpt=str(moe["root"] / "ckpt_ep2"), layout2={"tp": 2, "sp": True, "ep": 1, "etp": 1})
    assert got["data_parallel"] == (0, 2)
    check_against_ep1(moe, got)
    resumed = max_diff(got["loaded_lp"], got["lp_after"], moe["valid"])
    assert resumed <= LAYOUT_TOL, resumed
    for k, v in got["metrics2"].items():
        assert got["loaded_metrics2"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    w2 = max(float((got["loaded_weights2"][k] - w).abs().max()) for k, w in got["weights2"].items())
    assert w2 <= WEIGHT_TOL, w2
    print(f"resume EP2 -> EP1 x TP2: logprobs {resumed:.3g}, weights after the next step {w2:.3g}")


@pytest.mark.parametrize("name,layout", [
    ("ep2_tp2_sp", {"ep": 2, "tp": 2, "sp": True}),
    ("ep2_etp2", {"ep": 2, "etp": 2}),
])
def test_ep2_with_tensor_and_expert_tensor_parallel(moe, name, layout):
    """4 ranks: EP 2 x TP 2 + SP (experts whole: expert-TP 1, expert-DP 2; dense DP 2), and EP 2 x expert-TP 2 with
    TP 1 (experts split over 2 ranks, dense DP 4)."""
    check_against_ep1(moe, run(moe["root"], moe["path"], name, layout, 4))


@pytest.mark.slow
def test_ep2_pp2(moe):
    """4 ranks: EP 2 x PP 2 (DP 2, uneven micro-batch counts through the pipeline schedule)."""
    check_against_ep1(moe, run(moe["root"], moe["path"], "ep2_pp2", {"ep": 2, "pp": 2}, 4))


def test_layout_errors_name_the_keys():
    from megaforge.trainer.megatron.parallel import check_layout

    with pytest.raises(ValueError, match=r"trainer.expert_tensor_parallel x trainer.expert_parallel x "
                                         r"trainer.pipeline_parallel = 2 x 2 x 1"):
        check_layout(2, 1, 1, 1, ep=2, etp=2)
    with pytest.raises(ValueError, match=r"trainer.tensor_parallel x trainer.pipeline_parallel x trainer.context_parallel"):
        check_layout(4, 3, 1, 1)
    check_layout(4, 2, 1, 1, ep=2, etp=2)


def test_check_parity_ep2(moe, tmp_path):
    """tools/check_parity.py --ep 2 on 2 ranks: passes at 1e-4 and reports the layout."""
    import json

    tool = os.path.join(mt_helpers.ROOT, "tools", "check_parity.py")
    codes, logs = mt_helpers.run_ranks([tool, "--hf", moe["path"], "--ep", "2", "--seq", "32", "--batch", "5"], 2,
                                       tmp_path, "parity_ep2")
    assert codes == [0, 0], mt_helpers.tails(logs)
    rep = json.loads(next(line for line in logs[0].splitlines() if line.startswith("{")))
    assert rep["ok"] and (rep["ep"], rep["etp"], rep["family"]) == (2, 1, "qwen3_moe"), rep
    assert rep["max_abs_logprob_diff"] <= HF_TOL
    print(f"\n{json.dumps({k: rep[k] for k in ('max_abs_logprob_diff', 'argmax_agreement', 'tokens', 'ep', 'etp', 'world_size', 'ok')})}")

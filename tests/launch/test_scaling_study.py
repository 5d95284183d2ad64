"""tools/scaling_study.py on 1 and 2 gloo processes of the demo: table (CSV + Markdown) with its
columns, PNG plots, the cost model's leave-one-out check and projection; a layout the dry run
rejects is listed with the reason. The cost model's formulas against hand-computed numbers."""
import csv
import math
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import scaling_model as cm  # noqa: E402
from scaling_study import COLUMNS  # noqa: E402

# Tolerances: the study's table and the cost model are Python float (IEEE double) arithmetic, the
# same on every CPU, and the CSV keeps full precision (repr): sums of <= 6 doubles agree to ~1e-15, so
# rel 1e-6 only says "the same formula"; the fit on exact synthetic data recovers its coefficients to
# ~1e-12 (rel 1e-6, abs below the smallest coefficient).


@pytest.mark.slow
def test_cpu_study_writes_table_plots_and_cost_model(tmp_path):
    spec = yaml.safe_load(open(os.path.join(ROOT, "tools", "scaling", "cpu_demo.yaml")))
    spec["points"] = [{"gpus": 2, "tp": 2}]  # the torch backend has no TP: the dry run says so
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "study"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scaling_study.py"), str(path), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "scaling.csv")))
    assert list(rows[0]) == COLUMNS
    by = {r["name"]: r for r in rows}
    one, two = by["g1_tp1_pp1_cp1_e1"], by["g2_tp1_pp1_cp1_e1"]
    assert one["status"] == two["status"] == "ok" and (one["trainer_ranks"], two["trainer_ranks"]) == ("1", "2")
    assert two["dp"] == "2" and one["engine"] == "embedded"
    for r in (one, two):
        assert int(r["steps_measured"]) == 2  # 3 steps, the first is warm-up
        phases = sum(float(r[f"time_{ph}_s"]) for ph in ("rollout", "train", "sync", "offload", "onload", "other"))
        assert math.isclose(phases, float(r["time_step_s"]), rel_tol=1e-6)
        assert math.isclose(float(r["tokens_per_s"]), float(r["tokens_per_step"]) / float(r["time_step_s"]), rel_tol=1e-6)
    assert float(one["scaling_efficiency"]) == 1.0
    assert math.isclose(float(two["scaling_efficiency"]), float(two["speedup"]) / 2, rel_tol=1e-6)
    skipped = by["g2_tp2_pp1_cp1_e1"]
    assert skipped["status"] == "skipped" and "trainer.tensor_parallel=2 needs trainer.backend megatron" in skipped["reason"]
    assert not (out / "runs" / "g2_tp2_pp1_cp1_e1").exists()
    assert (out / "runs" / "g2_tp1_pp1_cp1_e1" / "metrics.jsonl").exists()
    assert not (out / "runs" / "g2_tp1_pp1_cp1_e1" / "checkpoints").exists()  # weights are not kept by default
    md = (out / "scaling.md").read_text()
    assert md.startswith("| " + " | ".join(COLUMNS)) and "g2_tp1_pp1_cp1_e1" in md
    for name in ("throughput.png", "step_breakdown.png", "scaling_efficiency.png", "cost_model.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    loo = list(csv.DictReader(open(out / "cost_model_loo.csv")))
    assert {r["name"] for r in loo} == {"g1_tp1_pp1_cp1_e1", "g2_tp1_pp1_cp1_e1"}
    for r in loo:
        assert math.isclose(float(r["rel_error"]), float(r["predicted_step_s"]) / float(r["measured_step_s"]) - 1, rel_tol=1e-6)
    proj = list(csv.DictReader(open(out / "projection.csv")))
    assert [int(r["gpus"]) for r in proj] == [64, 128, 256, 512, 1024]
    assert all(r["engines"] == "1" for r in proj)  # the embedded engine stays one process
    assert "Leave-one-out" in (out / "cost_model.md").read_text()


SHAPE = cm.Shape(params=1e9, active_params=1e9, layers=24, hidden=2048, kv=1024, bytes_per_el=2)
HW = cm.Hardware(intra_gbps=400.0, inter_gbps=50.0, latency_s=0.0, gpus_per_node=8)


def test_communication_terms_by_hand():
    pt = cm.Point(gpus=16, tp=2, pp=2, cp=2, engines=16, micro_batches=6, tokens=1e6, gen_tokens=2e5)
    assert pt.dp == 2
    f = cm.features(pt, SHAPE, HW)
    flops = 6 * 1e9 * 1e6 / 16 * (6 + 2 - 1) / 6  # bubble (p-1)/(m+p-1): compute x (m+p-1)/m
    assert math.isclose(f["train"][0], flops)
    tp = 4 * 12 * (2 * 1 / 2) * (1e6 / 4) * 2048 * 2 / 400e9
    cp = 3 * 12 * (1 / 2) * (1e6 / 2) * 1024 * 2 / 400e9
    dp = (2 * 1 / 2) * (1e9 / 4) * 4 / 50e9  # the DP group spans 16 GPUs > 8 per node: network bandwidth
    assert math.isclose(f["train"][1], tp + cp + dp)
    assert f["rollout"][0] == 2e5 / 16 and f["sync"] == (2e9, 0.0)
    dis = cm.Point(gpus=8, rollout_gpus=4, engines=4, tokens=1e6, gen_tokens=2e5)
    assert math.isclose(cm.features(dis, SHAPE, HW)["sync"][1], 2e9 / 400e9)  # one node: NVLink hop


def test_fit_recovers_the_model_and_predicts_held_out_points():
    truth = {"rollout": (0.5, 2e-4), "train": (0.2, 1.0 / 300e12), "sync": (0.1, 1.0 / 20e9),
             "offload_onload": (0.05, 1.0 / 50e9), "other": (0.3, 0.0)}
    pts = []
    for gpus, tp, engines, k in ((1, 1, 1, 1.0), (2, 1, 1, 1.5), (4, 2, 2, 3.0), (8, 2, 2, 4.0)):
        pt = cm.Point(gpus=gpus, tp=tp, engines=engines, tokens=2e5 * k, gen_tokens=5e4 * gpus, name=f"g{gpus}")
        f = cm.features(pt, SHAPE, HW)
        pt.measured = {ph: truth[ph][0] + truth[ph][1] * f[ph][0] + f[ph][1] for ph in cm.PHASES}
        pt.measured["step"] = sum(pt.measured[ph] for ph in cm.PHASES)
        pts.append(pt)
    model = cm.fit(pts, SHAPE, HW)
    for ph in ("rollout", "train", "offload_onload", "other"):  # sync: P*b is one number per model, so
        assert model.coef[ph][0] == pytest.approx(truth[ph][0], rel=1e-6, abs=1e-9)  # s0 + s1 P b is a constant
        assert model.coef[ph][1] == pytest.approx(truth[ph][1], rel=1e-6, abs=1e-30)
    for pt in pts:
        assert model.predict(pt)["sync"] == pytest.approx(pt.measured["sync"], rel=1e-9)
    loo = cm.leave_one_out(pts, SHAPE, HW)
    assert len(loo) == 4 and max(abs(r["rel_error"]) for r in loo) < 1e-6
    proj = cm.projections(model, pts[-1], pts[0], [64, 1024], "weak")
    assert [r["dp"] for r in proj] == [32, 512] and proj[1]["tokens_per_step"] == pytest.approx(2e5 * 4 * 128)
    base_tps = pts[0].tokens / pts[0].measured["step"]
    for r in proj:
        assert r["step_s"] == pytest.approx(sum(r[f"{ph}_s"] for ph in cm.PHASES))
        assert r["scaling_efficiency"] == pytest.approx(r["tokens_per_step"] / r["step_s"] / r["gpus"] / base_tps)
    strong = cm.projections(model, pts[-1], pts[0], [64], "strong")[0]
    assert strong["tokens_per_step"] == pts[-1].tokens

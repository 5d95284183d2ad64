"""The distillation teacher in the dry run's memory plan (``algo.advantage: distill``): its frozen weights in
the train phase, beside the engine only where it stays on the GPU (served by the trainer with
``memory.offload: none``, or by an embedded engine), nothing for an SGLang server at ``teacher.url``; a
teacher the run would refuse (another vocabulary) is a plan error; a teacher the planner cannot read is
a warning, never a silent zero.

Expected bytes are computed here from the config.json values (hidden 1536, 12 heads of 128, 2 kv heads,
ffn 8960, 28 layers, vocab 151,936, untied, qkv bias), not through the planner's shape code."""
import os

from planner_helpers import MODELS, plan

RECIPE = "configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml"
Q05B = os.path.join(MODELS, "qwen2.5-coder-0.5b")
T15B = os.path.join(MODELS, "qwen2.5-coder-1.5b")
DISTILL = ("--algo.advantage", "distill", "--teacher.path", "/nonexistent/teacher")
GiB = float(1 << 30)
H, QD, KVD, F, V, L = 1536, 12 * 128, 2 * 128, 8960, 151936, 28


def teacher_params(tp: int) -> int:
    """One TP rank's parameters of the 1.5B teacher (norms replicated, the rest split over tp)."""
    attn = (QD + 2 * KVD) * H // tp + QD * H // tp + (QD + 2 * KVD) // tp
    layer = attn + 2 * H + 3 * H * F // tp
    return L * layer + 2 * V * H // tp + H


def items(p: dict, phase: str) -> dict:
    return p["phases"][phase]["items"]


def test_teacher_served_by_the_trainer_counts_its_weights_and_moves_with_the_offload():
    assert teacher_params(1) == 1_777_088_000  # the conversion's count (tools/fetch_packaged_model.py)
    base = plan(RECIPE, "--memory.offload", "none", model_config=Q05B, gpu="H200")
    p = plan(RECIPE, *DISTILL, "--memory.offload", "none", model_config=Q05B, teacher_config=T15B, gpu="H200")
    want = 2 * teacher_params(1) / GiB  # bfloat16: teacher.dtype auto = model.dtype
    assert abs(items(p, "train")["teacher weights (frozen)"] - want) < 2e-3
    assert abs(items(p, "rollout")["teacher weights (frozen) (resident: memory.offload none)"] - want) < 2e-3
    assert abs(items(p, "sync")["teacher weights (frozen) (resident: memory.offload none)"] - want) < 2e-3
    for phase in ("train", "rollout", "sync"):  # the teacher is the only difference from the GRPO plan
        assert abs(p["phases"][phase]["total_gib"] - base["phases"][phase]["total_gib"] - want) < 2e-3, phase
    assert p["teacher"]["counted"] and p["teacher"]["hf_params"] == 1_777_088_000
    pinned = plan(RECIPE, *DISTILL, "--memory.offload", "pinned", model_config=Q05B, teacher_config=T15B, gpu="H200")
    assert "teacher weights (frozen)" in items(pinned, "train")
    assert not any("teacher" in k for k in items(pinned, "rollout")) and not any("teacher" in k for k in items(pinned, "sync"))


def test_teacher_at_tensor_parallel_2_is_split_like_the_student():
    p = plan(RECIPE, *DISTILL, "--trainer.tensor_parallel", "2", "--trainer.sequence_parallel", "true",
             "--memory.offload", "pinned", model_config=Q05B, teacher_config=T15B, gpu="H200", gpus_per_node=2)
    assert abs(items(p, "train")["teacher weights (frozen)"] - 2 * teacher_params(2) / GiB) < 2e-3


def test_teacher_served_by_an_engine():
    # an embedded engine on rollout.device: in every phase, never offloaded
    p = plan(RECIPE, *DISTILL, "--teacher.served_by", "engine", "--memory.offload", "pinned",
             model_config=Q05B, teacher_config=T15B, gpu="H200")
    for phase in ("train", "rollout", "sync"):
        assert abs(items(p, phase)["teacher engine weights"] - 2 * teacher_params(1) / GiB) < 2e-3, phase
    p = plan(RECIPE, *DISTILL, "--teacher.served_by", "engine", "--memory.offload", "none",
             model_config=Q05B, teacher_config=T15B, gpu="H200")
    assert [k for k in items(p, "rollout") if "teacher" in k] == ["teacher engine weights"]  # once, resident or not
    # an SGLang server at teacher.url (grpo.temperature 1.0, as the config requires): nothing here
    p = plan(RECIPE, *DISTILL, "--teacher.served_by", "engine", "--teacher.url", "http://10.0.0.5:30000",
             "--grpo.temperature", "1.0", model_config=Q05B, gpu="H200")
    assert not any("teacher" in k for ph in p["phases"].values() for k in ph["items"])
    assert p["teacher"] == {"served_by": "engine", "url": "http://10.0.0.5:30000", "counted": False}


def test_teacher_not_readable_is_a_warning_and_another_vocabulary_an_error():
    p = plan(RECIPE, *DISTILL, model_config=Q05B, gpu="H200")  # teacher.path is no folder here
    assert p["ok"] and p["teacher"]["counted"] is False
    assert any("teacher's memory is not counted" in w and "--teacher_config" in w for w in p["warnings"])
    assert not any("teacher" in k for ph in p["phases"].values() for k in ph["items"])
    p = plan(RECIPE, *DISTILL, model_config=Q05B, teacher_config=os.path.join(MODELS, "llama-3.1-8b"), gpu="H200")
    assert not p["ok"] and p["errors"][0]["key"] == "teacher.path"
    assert "vocabulary of 128256 rows, the student's 151936" in p["errors"][0]["message"]
    p = plan(RECIPE, model_config=Q05B, teacher_config=T15B, gpu="H200")  # GRPO: no teacher to describe
    assert not p["ok"] and "the config has no teacher" in p["errors"][0]["message"]


def test_memory_offload_auto_counts_the_teacher():
    """The choice a run makes at start-up (megaforge.build, from the same plan): on a 110 GiB GPU with SGLang at
    0.8 of it, the GRPO recipe's state fits beside the engine (103.2 GiB of 104.5 allowed), the teacher's 3.31 GiB
    more do not (106.5), so the distillation run pins its state, teacher included, while SGLang generates."""
    opts = dict(model_config=Q05B, gpu_memory_gib=110)
    grpo = plan(RECIPE, "--memory.offload", "auto", "--rollout.mem_fraction", "0.8", **opts)
    assert grpo["memory_offload"]["auto"] == "none" and "rollout: 103.2 of 110.0" in grpo["memory_offload"]["reason"]
    distill = plan(RECIPE, *DISTILL, "--memory.offload", "auto", "--rollout.mem_fraction", "0.8", teacher_config=T15B, **opts)
    assert distill["memory_offload"]["auto"] == "pinned"
    assert "rollout phase would need 106.5 of 110.0 GiB" in distill["memory_offload"]["reason"]
    assert not any("teacher" in k for k in items(distill, "rollout")) and distill["phases"]["rollout"]["verdict"] == "fits"


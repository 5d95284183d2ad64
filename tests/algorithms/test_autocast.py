"""trainer.autocast (torch backend): the decoder under bfloat16 autocast, the LM head in float32, float32
master weights. CPU autocast runs the same bfloat16 matmuls as CUDA's (other kernels), so these tests
show the wiring; the speed is the GPU's (docs/benchmarks)."""
import pytest
import torch
from algo_helpers import ROOT, padded_batch

from megaforge.build import RunBuilder
from megaforge.config import load_config
from megaforge.configtree import ConfigError
from megaforge.hf import hf_state_names
from megaforge.trainer import precision

BASE = ["--config", f"{ROOT}/configs/demo_cpu.yaml", "--model.config", f"{ROOT}/configs/models/tiny-qwen2",
        "--model.tokenizer", f"{ROOT}/assets/tiny-tokenizer", "--trainer.device", "cpu",
        "--trainer.micro_batch_size", "2", "--grpo.beta", "0.1"]


def _trainer(autocast: str, *extra):
    from megaforge.trainer.torch_backend import TorchTrainer

    return TorchTrainer(RunBuilder(load_config(BASE + ["--trainer.autocast", autocast, *extra])).trainer_spec(), None)


def _batch():
    b = padded_batch()
    b.advantages = torch.randn(4, 9, generator=torch.Generator().manual_seed(1)) * b.loss_mask
    return b


def test_head_computes_in_float32_under_autocast():
    t = _trainer("off")
    ids = torch.randint(3, 500, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert t.model(input_ids=ids).logits.dtype == torch.bfloat16  # what autocast alone gives
    names = hf_state_names(t.model)
    precision.float32_head(t.model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert t.model(input_ids=ids).logits.dtype == torch.float32
    assert hf_state_names(t.model) == names  # the sync's tensor names are unchanged
    assert t.model.lm_head.weight.dtype == torch.float32


def test_autocast_logprobs_are_bfloat16_close_to_float32():
    off, on = _trainer("off"), _trainer("bfloat16")
    for a, b in zip(off.model.parameters(), on.model.parameters(), strict=True):
        assert torch.equal(a, b)  # same seeded init
    batch = _batch()
    lp_off, lp_on = off.compute_logprobs(batch), on.compute_logprobs(batch)
    mask = batch.loss_mask.bool()
    diff = (lp_off - lp_on)[mask].abs()
    # bfloat16 operands (8-bit mantissa, relative rounding 2^-9) in 2 layers of width 64 before a
    # float32 head: measured max 0.0019 over these 15 tokens (|lp| ~ 6.3) with ATen's avx512 and
    # default kernels; 0.02 is 10x that. Nonzero: autocast was on.
    assert 0 < diff.max() < 0.02, diff.max()


def test_reference_keeps_its_own_head():
    t = _trainer("bfloat16")
    t.snapshot_reference()
    batch = _batch()
    ref0 = t.compute_logprobs(batch, "ref")
    with torch.no_grad():
        t.model.get_output_embeddings().weight.mul_(2.0)
    assert not torch.equal(t.compute_logprobs(batch, "policy"), ref0)
    assert torch.equal(t.compute_logprobs(batch, "ref"), ref0)  # bound to the copy's weight, not the policy's


def test_train_step_keeps_float32_master_weights():
    t = _trainer("bfloat16", "--trainer.lr", "1e-6", "--trainer.warmup_steps", "0")
    batch = _batch()
    batch.old_logprobs = batch.rollout_logprobs = t.compute_logprobs(batch)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    m = t.train_step(batch)
    assert torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
    changed = 0
    for n, p in t.model.named_parameters():
        assert p.dtype == torch.float32, n
        # an update of lr 1e-6 on weights ~0.02 is below bfloat16's spacing there (~1e-4): only a float32
        # master copy records it
        changed += int(not torch.equal(p.detach(), before[n]))
    assert changed == len(before)


def test_autocast_is_the_torch_backends():
    with pytest.raises(ConfigError, match="trainer.autocast"):
        load_config(BASE + ["--trainer.autocast", "bfloat16", "--trainer.backend", "megatron"])
    with pytest.raises(ConfigError, match="trainer.autocast"):
        load_config(BASE + ["--trainer.autocast", "fp8"])


def test_training_forwards_leave_cudnn_attention_out():
    """The forward context of a CUDA trainer disables cuDNN's SDPA (NaN backward, pytorch#196678) and
    keeps the other backends; the flags come back afterwards. Elsewhere the context changes nothing."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with precision.autocast("off", torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with precision.autocast("bfloat16", torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # CPU machines: torch.autocast('cuda') is off
def test_autocast_context_acts_inside_with_only():
    """Calling precision.autocast changes nothing until its ``with`` (it once entered both contexts at
    the call, so a context made and not entered left autocast and the SDPA flags switched)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    ctx = precision.autocast("bfloat16", torch.device("cuda"))
    assert torch.backends.cuda.cudnn_sdp_enabled() == before and not torch.is_autocast_enabled("cuda")
    with ctx:
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before and not torch.is_autocast_enabled("cuda")

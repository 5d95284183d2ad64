"""sync.check_equal against SGLang's /weights_checker (megaforge.sync.sglang_checksum).

* tensor_hash equals SGLang's GPU hash (sglang.kernels.ops.memory.gpu_tensor_hash, 0.5.16 and
  0.5.23 are the same kernel): the values below were computed by that Triton kernel run by Triton's
  interpreter on these exact bytes (an integer hash: the same on every machine).
* The check against an engine answering /weights_checker as SGLang does (``ranks`` of
  ``{checksums, parallelism_info}``), with SGLang's tensors built here from the HF ones by hand
  (per head, per rank) at TP 1, 2 and 4 (4 ranks > 2 key/value heads: heads replicated): equal
  weights pass, a changed, missing or unsent tensor fails naming it. The real server answers the
  same request in tests/gpu.
"""
from __future__ import annotations

import json

import pytest
import torch

from megaforge.sync.check import SGLangChecksumCheck, WeightMismatchError
from megaforge.sync.sglang_checksum import hash_hex, tensor_hash


def _det(n: int, dtype: torch.dtype) -> torch.Tensor:
    x = (torch.arange(n, dtype=torch.int64) * 2654435761 % 1000003).to(torch.float32) / 1000003 - 0.5
    return x.to(dtype)


GOLDEN = [(0, torch.bfloat16, "0000000000000000"), (1, torch.bfloat16, "407fa11018735975"),
          (7, torch.bfloat16, "cbbea8ee80657766"), (33, torch.float32, "d7a00123eab8fe21"),
          (16384, torch.bfloat16, "a1b736c80b51a49b"), (16387, torch.bfloat16, "8d934f1521c3b8c0"),
          (30001, torch.float16, "d8992343a7108aee")]


@pytest.mark.parametrize("n,dtype,want", GOLDEN)
def test_hash_equals_sglangs_kernel(n, dtype, want):
    assert f"{tensor_hash(_det(n, dtype)):016x}" == want


def test_hash_sees_every_word_and_its_position():
    t = _det(9000, torch.bfloat16)
    h = tensor_hash(t)
    for i in (0, 4095, 8191, 8192, 8999):  # both tiles, both halves of a word
        u = t.clone()
        u[i] = u[i] + 1
        assert tensor_hash(u) != h
    assert tensor_hash(t.flip(0)) != h and tensor_hash(t.view(90, 100)) == h  # bytes, not shape


# ------------------------------------------------------------------- the check, SGLang's layout
HEADS, KV, HD, HIDDEN, FFN, VOCAB = 4, 2, 16, 64, 96, 500  # vocab padded to 512 rows by SGLang


def _hf_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    t = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": r(HIDDEN)}
    for L in range(2):
        p = f"model.layers.{L}."
        t.update({p + "self_attn.q_proj.weight": r(HEADS * HD, HIDDEN), p + "self_attn.k_proj.weight": r(KV * HD, HIDDEN),
                  p + "self_attn.v_proj.weight": r(KV * HD, HIDDEN), p + "self_attn.q_proj.bias": r(HEADS * HD),
                  p + "self_attn.k_proj.bias": r(KV * HD), p + "self_attn.v_proj.bias": r(KV * HD),
                  p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HD), p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
                  p + "mlp.up_proj.weight": r(FFN, HIDDEN), p + "mlp.down_proj.weight": r(HIDDEN, FFN),
                  p + "input_layernorm.weight": r(HIDDEN), p + "post_attention_layernorm.weight": r(HIDDEN)})
    return t


def _heads(w: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.cat([w[h * HD:(h + 1) * HD] for h in ids])


def _sglang_rank(hf: dict, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """What SGLang rank ``rank`` of ``tp`` holds, written out per head and per row range."""
    q_ids = list(range(rank * HEADS // tp, (rank + 1) * HEADS // tp))
    kv_ids = list(range(rank * KV // tp, (rank + 1) * KV // tp)) if KV >= tp else [rank * KV // tp]
    out = {}
    emb = torch.zeros(512, HIDDEN, dtype=torch.bfloat16)
    emb[:VOCAB] = hf["model.embed_tokens.weight"]
    out["model.embed_tokens.weight"] = emb[rank * 512 // tp:(rank + 1) * 512 // tp]
    out["model.norm.weight"] = hf["model.norm.weight"]
    f = FFN // tp
    for L in range(2):
        p = f"model.layers.{L}."
        a = p + "self_attn."
        for kind in ("weight", "bias"):
            out[a + f"qkv_proj.{kind}"] = torch.cat([_heads(hf[a + f"q_proj.{kind}"], q_ids),
                                                     _heads(hf[a + f"k_proj.{kind}"], kv_ids),
                                                     _heads(hf[a + f"v_proj.{kind}"], kv_ids)])
        out[a + "o_proj.weight"] = hf[a + "o_proj.weight"][:, q_ids[0] * HD:(q_ids[-1] + 1) * HD]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][rank * f:(rank + 1) * f],
                                                        hf[p + "mlp.up_proj.weight"][rank * f:(rank + 1) * f]])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"][:, rank * f:(rank + 1) * f]
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = hf[p + n]
    return out


class FakeSGLang:
    """Answers /weights_checker as SGLang does (io_struct ChecksumInfo per rank); stands in for the
    server, which needs a GPU (tests/gpu asks the real one)."""

    def __init__(self, model_dir: str, served: dict, tp: int):
        self.model_dir, self.served, self.tp_sizes = model_dir, served, [tp]
        self.clients = [type("C", (), {"url": "http://127.0.0.1:30000"})()]

    def query(self, method, endpoint, payload=None):
        if endpoint == "/server_info":
            return [{"version": "0.5.16", "dtype": "bfloat16", "model_path": self.model_dir, "tp_size": self.tp_sizes[0]}]
        assert (method, endpoint, payload) == ("POST", "/weights_checker", {"action": "checksum"})
        tp = self.tp_sizes[0]
        ranks = [{"checksums": {n: hash_hex(t) for n, t in self.served[r].items()}, "per_gpu_checksum": "x",
                  "parallelism_info": {"tp_rank": r, "tp_size": tp, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                                       "pp_size": 1, "rank": r, "size": tp}} for r in range(tp)]
        return [{"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": "y"}]


def _check(tmp_path, hf, served, tp):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": HEADS, "num_key_value_heads": KV,
                                                      "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    eng = FakeSGLang(str(tmp_path), served, tp)
    check = SGLangChecksumCheck(eng, ["http://127.0.0.1:30000"], eng.query("GET", "/server_info"))
    for n, t in hf.items():
        check.record(n, t.float())  # the trainer's tensors may be float32: hashed in the engine's dtype
    return check


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_check_passes_on_equal_weights_and_names_what_differs(tmp_path, tp):
    hf = _hf_tensors()
    served = [_sglang_rank(hf, r, tp) for r in range(tp)]
    assert _check(tmp_path, hf, served, tp).verify() == len(served[0])
    bad = [dict(s) for s in served]
    name = "model.layers.1.mlp.gate_up_proj.weight"
    bad[tp - 1][name] = bad[tp - 1][name].clone()
    bad[tp - 1][name][-1, -1] += 1  # the up projection's last value on the last rank
    with pytest.raises(WeightMismatchError, match=rf"{name}.*TP rank {tp - 1} of {tp}"):
        _check(tmp_path, hf, bad, tp).verify()
    gone = [dict(s) for s in served]
    del gone[0]["model.norm.weight"]
    with pytest.raises(WeightMismatchError, match="has no tensor 'model.norm.weight'"):
        _check(tmp_path, hf, gone, tp).verify()
    partial = {k: v for k, v in hf.items() if k != "model.layers.0.self_attn.v_proj.bias"}
    with pytest.raises(WeightMismatchError, match="only.*qkv_proj.bias"):
        _check(tmp_path, partial, served, tp).verify()
    extra = {k: v for k, v in hf.items() if k != "model.layers.0.input_layernorm.weight"}
    with pytest.raises(WeightMismatchError, match="input_layernorm.weight.*did not send"):
        _check(tmp_path, extra, served, tp).verify()

"""GPU check of the trimmed flash-attn wheel (tools/peers/flash_attn_prepare.sh), run on the GPU machine.

Packs 3 sequences (lengths 37, 300, 512), 14 query heads / 2 kv heads (GQA, Qwen2.5-0.5B's shape), head dim 64,
bfloat16, and compares flash_attn_varlen_func (causal by default) with torch's scaled_dot_product_attention computed
per sequence in float32 (kv heads repeated for GQA, as flash-attn maps query head h to kv head h // 7): the forward
output and the backward gradients of q, k and v for one random upstream gradient. Then checks the trimmed build's
guard: head dim 128 and float16 must raise its RuntimeError ("... is a trimmed build ...") instead of running.

Tolerances (bf16 inputs and output, fp32 accumulation inside flash-attn): the forward is expected within ~1e-2 abs of
the fp32 reference, the gradients within a few e-2. A check passes when
    max|flash - ref| <= atol * max(1, max|ref|),  atol = 2e-2 for out, 5e-2 for dq, dk, dv,
i.e. the gradients' bound scales with their magnitude. For scale, the same comparison for torch's own SDPA run in
bf16 is printed too (`bf16_sdpa_*`): flash-attn's error should be of its order.

Prints one JSON line {max_abs_diff_out, max_abs_diff_dq, max_abs_diff_dk, max_abs_diff_dv, ..., ok}; exit 1 if not ok,
2 if there is no CUDA device. Imports only torch and flash_attn (and the standard library).
usage: PYTHONPATH=/tmp/verlsite python3 tools/peers/fa2_check.py [--seqlens 37,300,512] [--noncausal]
"""
import argparse
import json
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--seqlens", default="37,300,512", help="packed sequence lengths (default 37,300,512)")
    p.add_argument("--heads", type=int, default=14, help="query heads (default 14)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64: the only one built)")
    p.add_argument("--noncausal", action="store_true", help="check non-causal attention instead of causal")
    p.add_argument("--atol-out", type=float, default=2e-2, help="forward tolerance x max(1, max|ref|)")
    p.add_argument("--atol-grad", type=float, default=5e-2, help="gradient tolerance x max(1, max|ref|)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-trim-check", action="store_true", help="skip the head dim 128 / float16 error checks")
    return p.parse_args(argv)


def reference(q, k, v, dout, cu, causal, dtype):
    """SDPA per sequence in `dtype`; returns out, dq, dk, dv (float32, packed like the inputs)."""
    import torch
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qr, kr, vr = leaves
    outs = []
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        qs = qr[s:e].transpose(0, 1)                                 # (H, L, D)
        ks = kr[s:e].repeat_interleave(group, dim=1).transpose(0, 1)  # (H, L, D): query head h -> kv head h // group
        vs = vr[s:e].repeat_interleave(group, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.to(dtype))
    return [t.float() for t in (out.detach(), qr.grad, kr.grad, vr.grad)]


def trim_guard(flash_attn_varlen_func, head_dim, dtype, cu_t, max_len, heads, kv_heads, total):
    """True when the call raises the trimmed build's error, else the unexpected outcome as a string."""
    import torch

    q = torch.randn(total, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    try:
        flash_attn_varlen_func(q, k, v, cu_t, cu_t, max_len, max_len, causal=True)
        torch.cuda.synchronize()
    except RuntimeError as e:
        return True if "trimmed build" in str(e) else f"other error: {str(e)[:200]}"
    return "ran (no trimmed-build error)"


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 2
    import flash_attn
    from flash_attn import flash_attn_varlen_func

    torch.manual_seed(args.seed)
    lens = [int(x) for x in args.seqlens.split(",")]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    total, max_len, causal = cu[-1], max(lens), not args.noncausal
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(total, args.heads, args.head_dim, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(total, args.kv_heads, args.head_dim, device=dev, dtype=bf16, requires_grad=True)
    v = torch.randn(total, args.kv_heads, args.head_dim, device=dev, dtype=bf16, requires_grad=True)
    dout = torch.randn(total, args.heads, args.head_dim, device=dev, dtype=bf16)

    out = flash_attn_varlen_func(q, k, v, cu_t, cu_t, max_len, max_len, causal=causal)
    out.backward(dout)
    got = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    ref = reference(q, k, v, dout, cu, causal, torch.float32)
    base = reference(q, k, v, dout, cu, causal, bf16)

    res = {"flash_attn": flash_attn.__version__, "device": torch.cuda.get_device_name(),
           "seqlens": lens, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
           "causal": causal}
    ok = True
    for name, g, r, b, atol in zip(("out", "dq", "dk", "dv"), got, ref, base,
                                   (args.atol_out, args.atol_grad, args.atol_grad, args.atol_grad)):
        diff = (g - r).abs().max().item()
        tol = atol * max(1.0, r.abs().max().item())
        finite = bool(torch.isfinite(g).all().item())
        res[f"max_abs_diff_{name}"] = round(diff, 6)
        res[f"tol_{name}"] = round(tol, 6)
        res[f"bf16_sdpa_diff_{name}"] = round((b - r).abs().max().item(), 6)
        ok = ok and finite and diff <= tol
    if not args.skip_trim_check:
        for key, hd, dt in (("trim_error_hdim128", 128, bf16), ("trim_error_fp16", args.head_dim, torch.float16)):
            res[key] = trim_guard(flash_attn_varlen_func, hd, dt, cu_t, max_len, args.heads, args.kv_heads, total)
            ok = ok and res[key] is True
    res["ok"] = bool(ok)
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

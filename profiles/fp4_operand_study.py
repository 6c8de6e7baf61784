"""What an sm100 FP4 decode would lose by quantizing Q and P to the block-scaled MMA's
operand format (NVFP4 / MXFP4), to e4m3 with a row scale, or to MXFP8 (e4m3 with a
power-of-two scale per 32 along the contraction: the other operand of tcgen05's
``kind::mxf8f6f4`` beside an MXFP4 cache), instead of keeping them 16-bit: the relative L2
error of the decode output against attention over the same FP4 cache with 16-bit Q and P
(and that cache's own error against 16-bit attention), on SmolLM2-135M's own Q / K / V
(tests/data/smollm2_kv.pt); last, Q and P as the sm100 kernel forms them
(``emulate_sm100``: fp32 row scales, one and ``OPERAND_TERMS`` FP4 terms).  CPU, a few
seconds: ``python3 profiles/fp4_operand_study.py``."""
import math
from pathlib import Path

import torch

import bitdecode as bd
from bitdecode import emulate_sm100 as E
from bitdecode import reference as R
from bitdecode.layouts import sm100

def fp4_round(x, fp4, dim=-1):
    codes, sf = R.quantize_fp4(x, fp4, dim=dim, check_finite=False)
    return R.dequantize_fp4(codes, sf, fp4, torch.float32, dim=dim)

def fp8_round(x):  # e4m3, one fp32 scale per row (amax / 448)
    s = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448
    return (x.float() / s).to(torch.float8_e4m3fn).float() * s

def mxfp8_round(x, vec=32):  # OCP MXFP8 (e4m3): 2^(floor(log2 amax) - 8) per block of 32, last dim
    n = x.shape[-1]
    xf = torch.nn.functional.pad(x.float(), (0, (-n) % vec))
    b = xf.reshape(*xf.shape[:-1], -1, vec)
    amax = b.abs().amax(-1, keepdim=True)
    _, e = torch.frexp(amax)  # amax = m 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    scale = torch.where(amax > 0, torch.exp2((e - 1 - 8).float()), torch.ones_like(amax))
    q = (b / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(xf.shape)[..., :n]

def attn(q, k, v, fp4=None, quant_q=False, quant_p=False):
    # q [Hq, D], k, v [L, Hkv, D] (already dequantized cache values), fp32
    hq, d = q.shape; hkv = k.shape[1]; g = hq // hkv
    qf = q.float()
    if isinstance(quant_q, tuple):  # ("terms", n): the kernel's Q operand (its row scale undone)
        qhat, rg = E._q_operand(q, fp4, quant_q[1])
        qf = (qhat / rg.double()[:, None]).float()
    elif quant_q == "fp8":
        qf = fp8_round(q)
    elif quant_q == "mxfp8":
        qf = mxfp8_round(q)
    elif quant_q:
        qf = fp4_round(q.to(torch.bfloat16), fp4).float()  # blocks along D (the contraction)
    s = torch.einsum("hgd,lhd->hgl", qf.view(hkv, g, d), k.float()) / math.sqrt(d)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    if isinstance(quant_p, tuple):  # the kernel's P operand: max p is 1 here (one tile, m_new its max)
        flat = p.reshape(-1, p.shape[-1])
        n = flat.shape[-1]; pad = (-n) % 128
        phat, rp = E._p_operand(torch.nn.functional.pad(flat, (0, pad)), flat.amax(-1), fp4, quant_p[1])
        p = (phat / rp.double()[:, None]).float()[:, :n].reshape(p.shape)
    elif quant_p == "fp8":
        p = fp8_round(p)
    elif quant_p == "mxfp8":
        p = mxfp8_round(p)
    elif quant_p:  # P in [0, 1] quantized along tokens (the PV contraction), blocks of the format
        n = p.shape[-1]; vec = sm100.SF_VEC[fp4]; pad = (-n) % vec
        pp = torch.nn.functional.pad(p, (0, pad))
        p = fp4_round(pp.to(torch.bfloat16), fp4).float()[..., :n]
    o = torch.einsum("hgl,lhd->hgd", p, v.float()) / l
    return o.reshape(hq, d)

data = torch.load(Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2_kv.pt")
def get(name, layer):
    return (data[f"{name}{layer}"].view(torch.float8_e4m3fn).float() * data[f"{name}{layer}_scale"]).bfloat16()

for fp4 in ("nvfp4", "mxfp4"):
    fmt = bd.KVFormat(fp4=fp4)
    for layer in data["layers"]:
        q, k, v = get("q", layer), get("k", layer), get("v", layer)
        n = k.shape[0] // 128 * 128
        kd = R.unpack_k(*R.pack_k(k[:n].transpose(0, 1), fmt), fmt, torch.bfloat16).transpose(0, 1)
        vd = R.unpack_v(*R.pack_v(v[:n].transpose(0, 1), fmt), fmt, torch.bfloat16).transpose(0, 1)
        rows = []
        for i in range(q.shape[0]):
            exact = attn(q[i], k[:n], v[:n])
            base = attn(q[i], kd, vd)  # the FP4 cache, 16-bit Q and P (what sm80 computes)
            errs = []
            for qq, qp in ((True, False), (False, True), (True, True), ("fp8", "fp8"), ("mxfp8", False),
                           ("mxfp8", "mxfp8"), (("terms", 1),) * 2, (("terms", E.OPERAND_TERMS),) * 2):
                o = attn(q[i], kd, vd, fp4, qq, qp)
                errs.append(((o - base).norm() / base.norm()).item())
            rows.append([((base - exact).norm() / exact.norm()).item()] + errs)
        t = torch.tensor(rows).mean(0).tolist()
        print(f"{fp4} layer {layer}: cache vs 16-bit {t[0]:.4f}; +Q fp4 {t[1]:.4f}, +P fp4 {t[2]:.4f}, "
              f"+both {t[3]:.4f}, Q and P e4m3 {t[4]:.4f}, Q mxfp8 {t[5]:.4f}, Q and P mxfp8 {t[6]:.4f}, "
              f"the sm100 kernel's Q and P: 1 term {t[7]:.4f}, {E.OPERAND_TERMS} terms {t[8]:.4f} "
              "(relative L2, mean of 4 queries)")

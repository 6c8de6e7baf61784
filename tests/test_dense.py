"""The decode step's dense layers (``bitdecode.dense``): the GEMV against a float64 product of
the same 16-bit inputs (one rounding apart), SwiGLU bit for bit against torch's ops."""

from __future__ import annotations

import pytest
import torch

from bitdecode import dense

from kernel_builds import fresh_jit

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HALF_ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # relative, normal range


def _operands(tokens, n, k, dtype, device, bias=False, x_stride=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype).to(device)
    rows = torch.randn(tokens, x_stride or k, generator=g).to(dtype).to(device)
    x = rows[:, :k]  # (a row stride wider than K when x_stride is given)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype).to(device) if bias else None
    return x, w, b


def _assert_one_rounding(y, x, w, b):
    """``y`` is the float64 product rounded once to y's dtype, up to fp32 summation error."""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    mag = x.double().abs() @ w.double().abs().T
    bound = HALF_ULP[y.dtype] * ref.abs() + 2.0 ** -20 * mag + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound * 1.001).all()), f"max error {err.max().item():.3g} over bound {bound.max().item():.3g}"


def test_reference_paths_are_torch():
    x, w, b = _operands(3, 40, 512, torch.float32, "cpu", bias=True)
    assert torch.equal(dense.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    gu = torch.randn(2, 5, 64)
    assert torch.equal(dense.silu_mul(gu), torch.nn.functional.silu(gu[..., :32]) * gu[..., 32:])


def test_residual_is_torchs_add_after_the_product():
    """``linear(x, w, residual=r)`` is ``r + linear(x, w)`` (the product rounded, then the
    add) on torch's path; a residual of another shape, dtype or device is refused by name."""
    x, w, b = _operands(3, 40, 512, torch.bfloat16, "cpu", bias=True)
    r = torch.randn(3, 40).to(torch.bfloat16)
    assert torch.equal(dense.linear(x, w, residual=r), r + torch.nn.functional.linear(x, w))
    assert torch.equal(dense.linear(x, w, b, residual=r), r + torch.nn.functional.linear(x, w, b))
    with pytest.raises(ValueError, match=r"residual must have shape \(3, 40\)"):
        dense.linear(x, w, residual=r[:, :8])
    with pytest.raises(TypeError, match="residual must have dtype"):
        dense.linear(x, w, residual=r.float())


def test_dense_kernels_come_from_the_backends(monkeypatch):
    """``dense`` and ``rope`` build their kernels through the arch's backend
    (``Backend.dense``), as decode and bitnet do: sm80's kernels on every arch (sm90 and
    sm100 inherit them), looked up when a kernel is built, never per call."""
    from bitdecode import backend as backends, jit, rope
    from bitdecode.kernels_sm80 import dense as d80

    k80, k90, k100 = (dense.kernels_for(a) for a in ("sm_80", "sm_90a", "sm_100a"))
    assert (k80, k90, k100) == tuple(backends.get(n).dense for n in ("sm80", "sm90", "sm100"))
    assert k90 is k80 and k100 is k80
    assert k90.gemv_rows_per_warp(3200, 4096, 132) == d80.rows_per_warp(3200, 4096, 132)
    assert k90.gemv_rows_per_warp(128, 16384, 132) == d80.rows_per_warp(128, 16384, 132) == 1
    with pytest.raises(ValueError, match="no kernel backend builds for 'sm_75'"):
        backends.of_arch("sm_75")

    calls = []

    def recorder(name):
        def build(self, *args, **kw):
            calls.append((name, args, kw))
            return lambda *a: None
        return build

    for name in ("compile_gemv", "compile_gemm_small_m", "compile_silu_mul", "compile_rope"):
        monkeypatch.setattr(type(k90), name, recorder(name))
    monkeypatch.setattr(jit, "target_arch", lambda index=None: "sm_90a")
    monkeypatch.setattr(backends, "num_sms", lambda device: 132)
    fresh_jit(monkeypatch)
    opts = jit.compile_options("sm_90a")
    fn, rows = dense._gemv_plan(torch.device("cuda", 0), torch.bfloat16, 3200, 4096, 2, True)
    assert rows == d80.rows_per_warp(3200, 4096, 132)
    assert calls.pop() == ("compile_gemv", (True, 4096, 2, True, opts),
                           dict(pdl=True, has_residual=False, residual_ahead=False))
    x, w = torch.empty(5, 4096, dtype=torch.float16), torch.empty(64, 4096, dtype=torch.float16)
    dense._gemm_small_m(x, w, config=(8, 2, 1))
    assert calls.pop() == ("compile_gemm_small_m", (False, 4096, 5, opts),
                           dict(pdl=True, has_residual=False, residual_ahead=False, warps=8, batch=2, row_blocks=1))
    dense._gemm_small_m(x, w, config=(8, 2, 1))  # (built once: the next call finds it)
    q = torch.empty(1, 2, 3, 64, dtype=torch.bfloat16)
    rope._launch(q, q, torch.empty(1, 3, 64, dtype=torch.bfloat16), torch.empty(1, 3, 64, dtype=torch.bfloat16))
    assert calls == [("compile_rope", (True, 64, opts), {})]


def test_auto_takes_the_kernel_that_measured_faster(monkeypatch):
    """"auto" runs 3-16 tokens of a projection up to q/k/v's size on the small-M GEMM, 1-2
    tokens (3 on larger weights) on the GEMV except for large tall weights (gate/up, where
    cuBLAS measured faster), and leaves the rest to torch; "kernel" takes the small-M GEMM
    where "auto" would and for every 4-16 tokens, else the GEMV; "reference" neither.  The
    kernels' launches are replaced by the torch maths: this checks the routing, on the CPU."""
    ran = []

    def fake(name):
        def run(x2, weight, bias, residual):
            ran.append(name)
            y = torch.nn.functional.linear(x2, weight, bias)
            return y if residual is None else residual + y
        return run

    def rows(most):  # the token limits of the real checks, CPU tensors let through
        return lambda x, w, b=None: ("", x.reshape(-1, x.shape[-1])) if dense._tokens(x) <= most \
            else (f"1 to {most} rows of x", None)

    monkeypatch.setattr(dense, "_small_m_rows", rows(dense.SMALL_M_MAX_TOKENS))
    monkeypatch.setattr(dense, "_gemv_rows", rows(dense.GEMV_MAX_TOKENS))
    monkeypatch.setattr(dense, "_gemm_small_m", fake("small_m"))
    monkeypatch.setattr(dense, "_gemv", fake("gemv"))
    cases = (  # tokens, N, K, auto's kernel (None: torch), "kernel"'s
        (1, 28672, 4096, "gemv", "gemv"), (2, 4096, 4096, "gemv", "gemv"), (2, 28672, 4096, None, "gemv"),
        (2, 4096, 14336, "gemv", "gemv"), (3, 4096, 4096, "small_m", "small_m"), (3, 6144, 4096, "small_m", "small_m"),
        (3, 4096, 14336, "gemv", "gemv"), (3, 28672, 4096, None, "gemv"), (4, 4096, 4096, "small_m", "small_m"),
        (8, 6144, 4096, "small_m", "small_m"), (16, 64, 256, "small_m", "small_m"), (8, 28672, 4096, None, "small_m"),
        (8, 4096, 14336, None, "small_m"), (17, 64, 256, None, None),
        (2, 5120, 5120, "gemv", "gemv"))  # (a square weight past SMALL_M_AUTO_WEIGHTS: N <= K)
    for tokens, n, k, auto, kernel in cases:
        x, w, _ = _operands(tokens, n, k, torch.float32, "cpu")
        for backend, want in (("auto", auto), ("kernel", kernel), ("reference", None)):
            ran.clear()
            if backend == "kernel" and want is None:
                with pytest.raises(ValueError, match="rows of x"):
                    dense.linear(x[:, None], w, backend=backend)
                continue
            y = dense.linear(x[:, None], w, backend=backend)
            assert y.shape == (tokens, 1, n) and ran == ([want] if want else []), (tokens, n, k, backend, ran)
        assert (auto == "small_m") == dense.small_m_wins(tokens, n, k)
        if tokens <= dense.GEMV_MAX_TOKENS and auto != "small_m":
            assert (auto == "gemv") == dense.gemv_wins(tokens, n, k)
    # a bias goes to the GEMV at 3 tokens (the small-M GEMM takes none)
    x, w, b = _operands(3, 64, 256, torch.float32, "cpu", bias=True)
    ran.clear()
    dense.linear(x, w, b)
    assert ran == ["gemv"]
    # a residual: in the kernel's epilogue without a bias, after it with one; added once either way
    for bias in (None, b):
        r = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
        ran.clear()
        y = dense.linear(x, w, bias, residual=r)
        torch.testing.assert_close(y, r + torch.nn.functional.linear(x, w, bias))
        assert ran == ["small_m" if bias is None else "gemv"]


def test_bad_arguments_are_named():
    x, w, b = _operands(2, 16, 256, torch.float16, "cpu", bias=True)
    with pytest.raises(ValueError, match="x's last dim must be weight's K = 256"):
        dense.linear(x[:, :128], w)
    with pytest.raises(ValueError, match=r"weight must be \(N, K\)"):
        dense.linear(x, w[0])
    with pytest.raises(ValueError, match=r"bias must be \(16,\)"):
        dense.linear(x, w, b[:3])
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        dense.linear(x, "w")
    with pytest.raises(ValueError, match="backend must be one of"):
        dense.linear(x, w, backend="cuda")
    with pytest.raises(ValueError, match="GEMV kernel needs CUDA tensors"):
        dense.linear(x, w, backend="kernel")
    x4, w4, b4 = _operands(dense.GEMV_MAX_TOKENS + 1, 16, 256, torch.float16, "cpu", bias=True)
    with pytest.raises(ValueError, match="small-M GEMM kernel needs CUDA tensors"):
        dense.linear(x4, w4, backend="kernel")
    with pytest.raises(ValueError, match=r"gate_up must be \(\.\.\., 2I\)"):
        dense.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="SwiGLU kernel needs CUDA tensors"):
        dense.silu_mul(torch.randn(2, 16, dtype=torch.float16), backend="kernel")
    # torch's own product of a CPU x and a meta weight returns uninitialized memory
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        dense.linear(x, w.to("meta"))
    with pytest.raises(ValueError, match="bias is on meta but x is on cpu"):
        dense.linear(x, w, b.to("meta"))
    with pytest.raises(TypeError, match="weight must have x's dtype torch.float32, got torch.float16"):
        dense.linear(x.float(), w)
    with pytest.raises(TypeError, match="bias must have x's dtype torch.float16, got torch.float32"):
        dense.linear(x, w, b.float())
    with pytest.raises(TypeError, match="gate_up must be a floating-point tensor"):
        dense.silu_mul(torch.ones(2, 16, dtype=torch.int32))


@pytest.mark.gpu
@cuda
def test_gpu_kernel_refusals_say_why():
    x, w, _ = _operands(dense.SMALL_M_MAX_TOKENS + 1, 16, 256, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match=f"1 to {dense.GEMV_MAX_TOKENS} rows of x"):
        dense.linear(x, w, backend="kernel")
    assert torch.equal(dense.linear(x, w), torch.nn.functional.linear(x, w))  # auto: cuBLAS for more tokens
    with pytest.raises(ValueError, match="K a multiple of 256"):
        dense.linear(x[:1, :128], w[:, :128], backend="kernel")
    with pytest.raises(ValueError, match="one fp16 / bf16 dtype"):
        dense.linear(x[:1], w.half(), backend="kernel")
    w.requires_grad_(True)
    with pytest.raises(ValueError, match="no autograd"):
        dense.linear(x[:1], w, backend="kernel")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, n, k, bias, x_stride", [
    (1, 4096, 4096, False, None),  # Llama-3-8B o_proj
    (1, 6144, 4096, True, None),  # merged q/k/v with Qwen2's biases
    (2, 4096, 14336, False, None),  # down_proj, two sequences
    (3, 101, 256, True, 264),  # N not a multiple of the CTA's rows, a strided x
    (1, 20000, 256, True, None),  # tall: several rows per warp, the last CTA's rows past N
    (2, 1, 512, False, None),
])
def test_gpu_gemv_is_one_rounding_of_the_exact_product(dtype, tokens, n, k, bias, x_stride):
    x, w, b = _operands(tokens, n, k, dtype, "cuda", bias, x_stride)
    y = dense.linear(x[:, None], w, b, backend="kernel")  # (tokens, 1, K): a decode step's shape
    assert y.shape == (tokens, 1, n) and y.dtype == dtype
    _assert_one_rounding(y[:, 0], x, w, b)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, n, k", [
    (8, 4096, 4096),  # Llama-3-8B o_proj at B=8
    (3, 6144, 4096),  # merged q/k/v at B=3 (auto: the small-M GEMM from 3 tokens)
    (4, 6144, 4096),  # merged q/k/v at B=4
    (16, 4096, 14336),  # down_proj at B=16: two token tiles
    (13, 101, 256),  # a partial token tile, N not a multiple of 16, one chunk a warp
    (9, 28672, 2560),  # gate/up-sized, K not a multiple of the load batch
])
def test_gpu_small_m_gemm_is_the_product(dtype, tokens, n, k):
    """The mma.sync GEMM for 4-16 tokens (``backend="kernel"``): within the 16-bit rounding
    of the float64 product (fp32 tensor-core sums: a looser sum-error term than the GEMV's),
    with and without the residual epilogue, in a (tokens, 1, K) decode shape; a bias or 17
    tokens are refused by name; "auto" takes it where ``small_m_wins`` says, else cuBLAS."""
    x, w, _ = _operands(tokens, n, k, dtype, "cuda", False, None)
    y = dense.linear(x[:, None], w, backend="kernel")
    assert y.shape == (tokens, 1, n) and y.dtype == dtype
    ref = x.double() @ w.double().T
    bound = HALF_ULP[dtype] * ref.abs() + 2.0 ** -16 * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (y[:, 0].double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"
    r = torch.randn(tokens, 1, n, device="cuda").mul(4).to(dtype)
    assert torch.equal(dense.linear(x[:, None], w, backend="kernel", residual=r), r + y)
    auto = dense.linear(x[:, None], w)  # the small-M GEMM where it measured faster, else cuBLAS
    assert torch.equal(auto, y if dense.small_m_wins(tokens, n, k) else torch.nn.functional.linear(x[:, None], w))
    if tokens > dense.GEMV_MAX_TOKENS:
        with pytest.raises(ValueError, match="small-M GEMM kernel needs no bias"):
            dense.linear(x, w, torch.zeros(n, device="cuda", dtype=dtype), backend="kernel")
    else:  # (with a bias, as few tokens go to the GEMV)
        _assert_one_rounding(dense.linear(x, w, torch.zeros(n, device="cuda", dtype=dtype), backend="kernel"), x, w,
                             torch.zeros(n, device="cuda", dtype=dtype))
    # the configs bench_dense sweeps: each 16-row block is computed as by the default, so the
    # same bits (several row blocks a CTA, the last one partial or past N; fewer warps)
    if k % 128 == 0:
        for config in ((8, 4, 3), (4, 8, 2), (8, 2, 1)):
            other = dense._gemm_small_m(x, w, config=config)
            if config[0] == 8:
                assert torch.equal(other, y[:, 0]), config
            else:  # (K split over fewer warps: another summation order)
                assert bool(((other.double() - ref).abs() <= bound).all()), config


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, n, k", [(1, 4096, 14336), (3, 101, 256), (2, 20000, 256)])
def test_gpu_gemv_residual_is_torchs_add(dtype, tokens, n, k):
    """The GEMV's residual epilogue: bit for bit the kernel's own product plus the residual
    as torch adds them (a decoder layer's last add), in a (tokens, 1, N) decode shape; a
    residual with strided rows too (a contiguous copy into the epilogue)."""
    x, w, _ = _operands(tokens, n, k, dtype, "cuda", False, None)
    r = torch.randn(tokens, 1, n, device="cuda").mul(8).to(dtype)
    y = dense.linear(x[:, None], w, backend="kernel")
    got = dense.linear(x[:, None], w, backend="kernel", residual=r)
    assert got.shape == (tokens, 1, n) and torch.equal(got, r + y)
    wide = torch.randn(tokens, 1, n + 8, device="cuda").to(dtype)[..., :n]
    assert torch.equal(dense.linear(x[:, None], w, backend="kernel", residual=wide), wide + y)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens, n, k", [(1, 4096, 4096), (1, 4096, 14336), (2, 101, 256), (3, 101, 256),
                                          (8, 4096, 4096), (16, 200, 512)])
def test_gpu_residual_ahead_is_bit_equal(tokens, n, k, monkeypatch):
    """``bitdecode.dense.RESIDUAL_AHEAD`` (the residual read with the first weights, in the
    GEMV and the small-M GEMM): bit for bit the late read's results, and with the
    previous kernel writing the residual (a torch add right before, in a CUDA graph whose
    replays change it)."""
    x, w, _ = _operands(tokens, n, k, torch.bfloat16, "cuda", False, None)
    r = torch.randn(tokens, 1, n, device="cuda").mul(8).to(torch.bfloat16)
    monkeypatch.setattr(dense, "RESIDUAL_AHEAD", False)  # (the default is on: build the late read first)
    fresh_jit(monkeypatch)
    want = dense.linear(x[:, None], w, backend="kernel", residual=r)
    monkeypatch.setattr(dense, "RESIDUAL_AHEAD", True)
    fresh_jit(monkeypatch)
    assert torch.equal(dense.linear(x[:, None], w, backend="kernel", residual=r), want)
    # the residual written by the kernel right before (programmatic launches overlap them)
    base = r.clone()
    step = lambda: dense.linear(x[:, None], w, backend="kernel", residual=base + 1)  # noqa: E731
    out = step()
    assert torch.equal(out, dense.linear(x[:, None], w, backend="kernel") + (base + 1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for shift in (2.0, -3.0):
        base.add_(shift)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, dense.linear(x[:, None], w, backend="kernel") + (base + 1)), shift


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 2 * 14336), (7, 2 * 14336), (3, 5, 2 * 512)])
def test_gpu_silu_mul_is_torch_bit_for_bit(dtype, shape):
    gu = torch.randn(*shape, device="cuda", dtype=torch.float32).mul(4).to(dtype)
    gu[..., :3] = torch.tensor([float("inf"), float("-inf"), -88.5])  # exp's edges
    got = dense.silu_mul(gu, backend="kernel")
    want = dense.silu_mul_reference(gu)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num()), (got.float() - want.float()).abs().max().item()
    wide = torch.randn(4, 2 * 512 + 64, device="cuda", dtype=dtype)[:, :2 * 512]  # strided rows
    assert torch.equal(dense.silu_mul(wide, backend="kernel"), dense.silu_mul_reference(wide))


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_gpu_norm_gemv_silu_chain_in_a_cuda_graph():
    """The PDL chain of a decode step's MLP (RMSNorm -> gate/up GEMV -> SwiGLU -> down
    GEMV: each kernel launched while the previous runs) captured in a CUDA graph equals the
    same kernels run eagerly, replay after replay with new inputs."""
    from bitdecode import bitnet

    g = torch.Generator(device="cuda").manual_seed(1)
    h, inter = 1024, 2816
    x = torch.randn(2, 1, h, device="cuda", dtype=torch.bfloat16, generator=g)
    wn = torch.rand(h, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    wgu = torch.randn(2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.03
    wd = torch.randn(h, inter, device="cuda", dtype=torch.bfloat16, generator=g) * 0.03

    def mlp(t):
        y = bitnet.rms_norm(t, wn, 1e-5, backend="kernel")
        return dense.linear(dense.silu_mul(dense.linear(y, wgu, backend="kernel"), backend="kernel"), wd,
                            backend="kernel")

    mlp(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp(x)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
        graph.replay()
        assert torch.equal(out, mlp(x)), seed


def test_an_empty_k_gives_zeros():
    """K = 0 (a degenerate projection) is torch's answer, zeros, not a division by zero."""
    y = dense.linear(torch.randn(2, 0), torch.randn(16, 0))
    assert torch.equal(y, torch.zeros(2, 16))

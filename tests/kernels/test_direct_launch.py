"""direct_launch: the key of a call against Triton's own binder, when the direct path runs and when Triton's does
(CPU, with a stand-in compiled kernel); on a GPU, every converted kernel through both paths bit for bit, eagerly,
inside a CUDA graph, and on a misaligned view that must get a kernel of its own."""

import importlib.util
import itertools
import logging

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from rerankit.kernels import direct_launch  # noqa: E402
from rerankit.kernels.direct_launch import ENV, arg_key, launch, verified  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _sample(x_ptr, y_ptr, n, m, f, maybe, desc, gdesc, stride: tl.int32, scale: tl.float32, BLOCK: tl.constexpr,
            MODE: tl.constexpr = "a"):
    pass


def sample_kernel() -> JITFunction:
    """A JITFunction (never compiled) whose parameters take each kind of specialization."""
    return JITFunction(_sample, do_not_specialize=["m"], do_not_specialize_on_alignment=["y_ptr"])


def triton_key(fn: JITFunction, args: list, kwargs: dict) -> str:
    """Triton's own cache key of a call, as ``JITFunction.run`` computes it (its binder, on the CPU)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    if not hasattr(fn, "binder_on_cpu"):
        fn.binder_on_cpu = create_function_from_signature(fn.signature, fn.params, BaseBackend)
    kwargs = {**kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    _, specialization, options = fn.binder_on_cpu(*args, **kwargs)
    return compute_cache_key({}, specialization, options)


_STORE = torch.zeros(8192, dtype=torch.uint8)


def at(dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` starting ``offset`` bytes into one 64-byte aligned buffer."""
    return _STORE[offset:offset + 2048].view(dtype)


def descriptors():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    plain, gluon = [], []
    for base in (torch.zeros(64, 64, dtype=torch.float16), torch.zeros(64, 64, dtype=torch.float32)):
        for block in ([16, 16], [32, 16], [16, 64]):
            for shape in ([64, 64], [48, 64]):
                plain.append(TensorDescriptor(base, shape, [64, 1], block))
                element = gl.float16 if base.dtype == torch.float16 else gl.float32
                for layout in (gl.NVMMASharedLayout.get_default_for(block, element),
                               gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=element.primitive_bitwidth,
                                                    rank=2)):
                    gluon.append(GluonDescriptor(base, shape, [64, 1], block, layout))
    return plain, gluon


INTS = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31, 2**31 + 16, -2**31, -2**31 - 16, 2**63 - 16, 2**63,
        2**64 - 16]
TENSORS = [at(dtype, offset) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
           for offset in (0, 16, 64, 4, 8) if offset % dtype.itemsize == 0]
SCALARS = INTS + [1.5, 1.0, True, False, None] + TENSORS[:4]
CONSTANTS = [1, True, 1.0, 16, "16", None, "a", "b", 0, False]


def test_equal_keys_only_where_tritons_keys_are_equal():
    """For each parameter, every pair of values: where the two keys are equal, Triton's cache keys are too (one
    compiled kernel serves both); for calls with the same keywords, the keys are equal exactly where Triton's are
    (a default passed or left out makes another key: a kernel kept twice, never a wrong one)."""
    fn = sample_kernel()
    kernel = direct_launch._Kernel(fn)
    plain, gluon = descriptors()
    base = [TENSORS[0], TENSORS[0], 16, 16, 1.0, None, plain[0], gluon[0], 16, 1.0]
    values = {0: TENSORS, 1: TENSORS, 2: SCALARS, 3: SCALARS, 4: SCALARS, 5: SCALARS, 6: plain, 7: gluon,
              8: INTS[:8], 9: [1.0, 2.0]}
    calls = [([*base[:i], value, *base[i + 1:]], {"BLOCK": 16}) for i, options in values.items() for value in options]
    calls += [(base, {"BLOCK": value}) for value in CONSTANTS] + [(base, {"BLOCK": 16, "MODE": v}) for v in CONSTANTS]
    calls += [(base, {"BLOCK": 16, "num_warps": warps}) for warps in (4, 8)]
    keys = [(triton_key(fn, args, kwargs), kernel.bind(tuple(args), kwargs, 0)[1], args, kwargs)
            for args, kwargs in calls]
    for (triton_a, ours_a, *call_a), (triton_b, ours_b, *call_b) in itertools.combinations(keys, 2):
        assert triton_a == triton_b or ours_a != ours_b, (call_a, call_b)
        if list(call_a[1]) == list(call_b[1]):  # the same keywords (else ours differ: a default given or not)
            assert (triton_a == triton_b) == (ours_a == ours_b), (call_a, call_b)
    assert len({ours for _, ours, *_ in keys}) > 60, "the calls must be of many specializations"


@pytest.mark.parametrize("a, b", [
    (at(torch.float16), at(torch.float16, 64)),  # both 16-byte aligned
    (32, 48), (3, 5), (2**31 + 16, 2**32), (1.0, 2.5), (None, None)])
def test_values_triton_specializes_alike_share_a_key(a, b):
    assert arg_key(a, direct_launch._FULL) == arg_key(b, direct_launch._FULL)


@pytest.mark.parametrize("a, b", [
    (at(torch.float16), at(torch.float16, 2)),  # alignment
    (at(torch.float16), at(torch.bfloat16)),  # dtype
    (1, 2), (16, 17), (16, 2**31 + 16), (2**31 + 16, 2**63 + 16),  # == 1, % 16, i32 / i64 / u64
    (None, at(torch.float16)), (True, 1), (1.0, 1), (0, False)])
def test_values_triton_specializes_apart_get_keys_apart(a, b):
    assert arg_key(a, direct_launch._FULL) != arg_key(b, direct_launch._FULL)


def test_descriptor_keys_follow_block_shape_dtype_and_layout():
    plain, gluon = descriptors()
    key = lambda d: arg_key(d, direct_launch._FULL)  # noqa: E731
    assert key(plain[0]) == key(plain[1])  # another global shape: the same kernel
    assert key(plain[0]) != key(plain[2])  # another block shape
    assert key(plain[0]) != key(plain[6])  # another dtype
    assert key(gluon[0]) != key(gluon[1])  # another layout
    assert key(gluon[0]) == key(gluon[2])  # another global shape
    assert key(gluon[0]) != key(plain[0])


def test_constexprs_are_keyed_by_type_and_value():
    constexpr = direct_launch._CONSTEXPR
    assert len({arg_key(v, constexpr) for v in (1, True, 1.0, "1")}) == 4
    with pytest.raises(direct_launch.Unsupported):
        arg_key(object(), constexpr)  # a value whose equality Triton would key by its str: Triton's path


def test_versions():
    assert verified("3.6.0") and verified("3.6.1") and verified("3.9.0")
    assert not any(verified(v) for v in ("3.5.1", "3.7.0", "3.10.0", "4.0.0", "3.60.0"))


def test_off_without_cuda_or_in_the_interpreter(monkeypatch):
    direct_launch.available.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not direct_launch.available()
    direct_launch.available.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not direct_launch.available()
    direct_launch.available.cache_clear()


def test_an_unverified_triton_warns_once_and_takes_tritons_path(monkeypatch, caplog):
    direct_launch.available.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(direct_launch.triton, "__version__", "3.7.0")
    with caplog.at_level(logging.WARNING, logger="rerankit.engine"):
        assert not direct_launch.available() and not direct_launch.available()
    direct_launch.available.cache_clear()
    assert caplog.text.count("triton 3.7.0 is not a version") == 1


def test_interpreted_kernels_take_tritons_path():
    from rerankit.kernels import rms_norm

    if not isinstance(rms_norm._rms_norm_kernel, JITFunction):  # the interpreter's kernel (CPU test runs)
        assert direct_launch._kernel_of(rms_norm._rms_norm_kernel) is None
    x = torch.randn(5, 64, dtype=torch.float32, device="cuda" if HAS_CUDA else "cpu")
    weight = torch.rand(64, dtype=x.dtype, device=x.device)
    torch.testing.assert_close(rms_norm.rms_norm(x, weight, 1e-6), rms_norm.rms_norm_reference(x, weight, 1e-6),
                               atol=1e-4, rtol=1e-4)


class FakeCompiled:
    """Stands in for a CompiledKernel: its launcher records each call."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.function, self.packed_metadata = 1234, ("metadata",)

    @property
    def run(self):
        return lambda *args: self.launches.append(args)


@pytest.fixture
def fake(monkeypatch):
    """The sample kernel with Triton's run replaced by a recorder, direct launches on (a CUDA host's device 0,
    stream 77); yields (kernel, Triton's calls, the compiled kernel)."""
    fn, compiled, stock = sample_kernel(), FakeCompiled(), []

    def run(*args, grid, warmup, **kwargs):
        stock.append((grid, args, kwargs))
        return compiled

    fn.run = run
    monkeypatch.setattr(direct_launch, "_KERNELS", {})
    monkeypatch.setattr(direct_launch, "available", lambda: True)
    monkeypatch.setattr(direct_launch, "_getters", lambda: (lambda: 0, lambda device: 77))
    monkeypatch.delenv(ENV, raising=False)
    yield fn, stock, compiled


def sample_args(x=None):
    plain, gluon = descriptors()
    x = TENSORS[0] if x is None else x
    return (x, x, 4096, 7, 0.5, None, plain[0], gluon[0], 16, 1.0)


def test_first_call_goes_through_triton_later_ones_straight_to_the_launcher(fake):
    fn, stock, compiled = fake
    args = sample_args()
    assert launch(fn, (3, 2), *args, BLOCK=64, num_warps=4) is compiled
    assert len(stock) == 1 and not compiled.launches
    assert launch(fn, (3, 2), *args, BLOCK=64, num_warps=4) is compiled
    assert len(stock) == 1
    assert compiled.launches == [(3, 2, 1, 77, 1234, ("metadata",), None, None, None, *args, 64, "a")]
    launch(fn, lambda meta: (meta["BLOCK"] // 16, meta["n"] // 1024, 5), *args, BLOCK=64, num_warps=4)
    assert compiled.launches[-1][:4] == (4, 4, 5, 77)  # a grid function gets every parameter by name


def test_a_new_specialization_goes_through_triton_once(fake):
    fn, stock, compiled = fake
    for x in (TENSORS[0], TENSORS[0], at(torch.float16, 2), at(torch.float16, 2), at(torch.float16, 32)):
        launch(fn, (1,), *sample_args(x), BLOCK=64)
    assert len(stock) == 2 and len(compiled.launches) == 3  # the misaligned view compiled apart, then direct
    launch(fn, (1,), *sample_args(), BLOCK=32)
    launch(fn, (1,), *sample_args(), BLOCK=64, num_warps=8)
    assert len(stock) == 4


def test_switch_hooks_and_unknown_arguments_take_tritons_path(fake, monkeypatch):
    fn, stock, compiled = fake
    args = sample_args()
    launch(fn, (1,), *args, BLOCK=64)
    monkeypatch.setenv(ENV, "0")
    launch(fn, (1,), *args, BLOCK=64)
    assert len(stock) == 2
    monkeypatch.setenv(ENV, "1")
    hooks = knobs.HookChain()
    hooks.add(lambda metadata: None)
    with monkeypatch.context() as patch:
        patch.setattr(knobs.runtime, "launch_enter_hook", hooks)
        launch(fn, (1,), *args, BLOCK=64)
    assert len(stock) == 3
    launch(fn, (1,), *args[:4], (1, 2), *args[5:], BLOCK=64)  # a tuple: not keyed here
    launch(fn, (1,), *args[:4], (1, 2), *args[5:], BLOCK=64)
    launch(fn, (1,), *args, BLOCK=64)
    assert len(stock) == 5 and len(compiled.launches) == 1


def test_a_compiled_kernel_of_another_shape_leaves_the_kernel_to_triton(fake, caplog):
    fn, stock, compiled = fake
    del compiled.function
    with caplog.at_level(logging.WARNING, logger="rerankit.engine"):
        for _ in range(3):
            launch(fn, (1,), *sample_args(), BLOCK=64)
    assert len(stock) == 3 and caplog.text.count("direct launches of") == 1


# ----------------------------------------------------------------------------------------------------------------
# GPU: each converted kernel through both paths, bit for bit.

gpu = pytest.mark.skipif(not HAS_CUDA or not direct_launch.available(), reason="needs CUDA and a verified triton")


def count_triton_runs(monkeypatch) -> list:
    """Calls of ``JITFunction.run`` (Triton's own launch path, the tuner's included) from now on."""
    runs, original = [], JITFunction.run

    def run(self, *args, **kwargs):
        runs.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", run)
    return runs


def same_bits(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def cases():
    """name -> a call of a converted kernel's wrapper on fresh inputs (0.6B shapes, 4k tokens)."""
    from packs import pack_meta

    from rerankit.kernels import fp8_quant, label_logprobs, prefix_attention, qk_norm_rope, qkv_rope_matmul, rms_norm
    from rerankit.kernels import swiglu_matmul
    from rerankit.kernels.attention_config import AttentionConfig

    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, generator=gen, device="cuda").to(dtype)  # noqa
    tokens, d, heads, kv, hd = 4096, 1024, 16, 8, 128
    x, w, delta = rand(tokens, d), rand(d) + 1, rand(tokens, d)
    layout = [(76, [64 + 37 * i % 384 for i in range(12)])] * 2
    meta = pack_meta(layout, "cuda")
    total = int(meta["cu_seqlens"][-1])
    qkv = rand(total, (heads + 2 * kv) * hd)
    q, k, v = (qkv[:, a:b].unflatten(1, (-1, hd)) for a, b in ((0, 2048), (2048, 3072), (3072, 4096)))
    positions = torch.arange(total, device="cuda") % 500
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, hd, 2, device="cuda").float() / hd)
    cos, sin = qkv_rope_matmul.rope_table(positions[:tokens], inv_freq)
    w_qkv = rand(4096, d) / 32
    codes, x_scale = fp8_quant.quantize_rows(x)
    w_codes, w_scale = fp8_quant.quantize_rows_reference(w_qkv)
    w_mlp = rand(2 * 3072, d) / 32
    hidden, lm_head = rand(64, d), rand(5000, d) / 32
    labels = torch.randint(0, 5000, (64, 2), generator=gen, device="cuda")
    pointer = AttentionConfig(64, 64, 4, 3, pack_gqa=True)
    descriptors = AttentionConfig(64, 32, 8, 3, pack_gqa=True, tma=True)
    return {
        "rms_norm": lambda: rms_norm.rms_norm(x, w, 1e-6),
        "quantize_rows": lambda: fp8_quant.quantize_rows(x),
        "rms_norm_quant": lambda: fp8_quant.rms_norm_quant(x, w, 1e-6, sumsq=True),
        "add_rms_norm_quant": lambda: fp8_quant.add_rms_norm_quant(x.clone(), delta, w, 1e-6),
        "abs_max+quantize_bounded": lambda: fp8_quant.quantize_bounded(x, fp8_quant.abs_max(x, delta)),
        "qk_norm_rope": lambda: qk_norm_rope.qk_norm_rope(qkv, heads, kv, hd, positions, inv_freq, w[:hd], w[hd:2 * hd],
                                                          1e-6),
        "qkv_rope_matmul_bf16": lambda: qkv_rope_matmul.qkv_rope_matmul(x, w_qkv, None, heads, kv, hd, cos, sin,
                                                                         w[:hd], w[hd:2 * hd]),
        "qkv_rope_matmul_fp8": lambda: qkv_rope_matmul.qkv_rope_matmul(codes, w_codes, None, heads, kv, hd, cos, sin,
                                                                        w[:hd], w[hd:2 * hd], x_scale=x_scale,
                                                                        w_scale=w_scale),
        "swiglu_matmul_bf16": lambda: swiglu_matmul.swiglu_matmul(x, w_mlp),
        "attention_default": lambda: prefix_attention.prefix_attention(q, k, v, **meta),
        "attention_pointer": lambda: prefix_attention.prefix_attention(q, k, v, **meta, config=pointer),
        "attention_descriptors_fp8_out": lambda: prefix_attention.prefix_attention(
            q, k, v, **meta, config=descriptors, fp8_bound=fp8_quant.abs_max(v)),
        "attention_reads": lambda: prefix_attention.prefix_attention(q, k, v, **meta,
                                                                     reads=meta["cu_seqlens"][1:].long() - 1),
        "label_logprobs": lambda: label_logprobs.label_logprobs(hidden, lm_head, labels),
        "label_logprobs_full_vocab": lambda: label_logprobs.label_logprobs(hidden, lm_head, labels, full_vocab=True),
    }


@pytest.mark.gpu
@gpu
def test_gpu_every_converted_kernel_launches_directly_bit_for_bit(monkeypatch):
    for name, call in cases().items():
        monkeypatch.setenv(ENV, "0")
        expected = call()
        monkeypatch.setenv(ENV, "1")
        call()  # keeps the compiled kernels (the tuners' first launches as well)
        call()
        with monkeypatch.context() as patch:
            runs = count_triton_runs(patch)
            got = call()
        torch.cuda.synchronize()
        assert not runs, f"{name}: {len(runs)} launches through Triton's path ({runs[:3]})"
        assert same_bits(got, expected), name


@pytest.mark.gpu
@gpu
def test_gpu_direct_launches_record_into_a_cuda_graph(monkeypatch):
    """Warmed up eagerly, then captured: the launches inside the capture are direct (on the capture's stream), and
    the replay, into outputs zeroed beforehand, gives Triton's own launches' results."""
    monkeypatch.setenv(ENV, "1")
    calls = cases()
    chosen = ["rms_norm", "rms_norm_quant", "qk_norm_rope", "attention_pointer", "attention_descriptors_fp8_out",
              "label_logprobs"]
    for name in chosen:
        calls[name](), calls[name]()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for name in chosen:
            calls[name]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with monkeypatch.context() as patch:
        runs = count_triton_runs(patch)
        with torch.cuda.graph(graph):
            captured = {name: calls[name]() for name in chosen}
    assert not runs
    for name in chosen:
        for out in captured[name] if isinstance(captured[name], tuple) else (captured[name],):
            out.view(torch.uint8).zero_()
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setenv(ENV, "0")
    for name in chosen:
        assert same_bits(captured[name], calls[name]()), name


@pytest.mark.gpu
@gpu
def test_gpu_a_misaligned_view_does_not_reuse_the_aligned_kernel(monkeypatch):
    from rerankit.kernels import rms_norm

    tokens, d = 1000, 1024
    flat = torch.randn(tokens * d + 1, device="cuda").to(torch.bfloat16)
    aligned, shifted = flat[:-1].view(tokens, d), flat[1:].view(tokens, d)
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 2
    weight = torch.rand(d, device="cuda").to(torch.bfloat16)
    monkeypatch.setenv(ENV, "0")
    expected = rms_norm.rms_norm(shifted, weight, 1e-6)
    monkeypatch.setenv(ENV, "1")
    rms_norm.rms_norm(aligned, weight, 1e-6)
    rms_norm.rms_norm(aligned, weight, 1e-6)
    with monkeypatch.context() as patch:
        runs = count_triton_runs(patch)
        first = rms_norm.rms_norm(shifted, weight, 1e-6)
        assert len(runs) == 1  # a key of its own: through Triton, which compiles the unaligned specialization
        second = rms_norm.rms_norm(shifted, weight, 1e-6)
        assert len(runs) == 1
    torch.cuda.synchronize()
    assert same_bits(first, expected) and same_bits(second, expected)
    entries = direct_launch._KERNELS[id(rms_norm._rms_norm_kernel)].entries.values()
    assert len({id(entry[0]) for entry in entries}) >= 2  # two compiled kernels


class FakeDriver:
    """Triton's driver on a CUDA host as ``JITFunction.run`` asks it: device 0, stream 77, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 77

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def test_the_launcher_gets_what_tritons_run_gives_it(fake, monkeypatch):
    """Triton's own ``JITFunction.run`` (its binder, options and launch; the compile stood in for) against the
    direct path: the same launcher arguments, but the launch metadata and the (empty) hook chains."""
    from triton.runtime.driver import driver

    fn, _, compiled = fake
    del fn.run  # Triton's own run again
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9's options warn where it is unset
    monkeypatch.setattr(driver, "_active", FakeDriver())
    monkeypatch.setattr(direct_launch, "_getters", lambda: (driver.active.get_current_device,
                                                            driver.active.get_current_stream))
    monkeypatch.setattr(fn, "_do_compile", lambda *args, **kwargs: compiled)
    compiled.launch_metadata = lambda grid, stream, *args: "launch metadata"
    grid = lambda meta: (meta["BLOCK"], meta["MODE"] == "b", 3)  # noqa: E731
    args = sample_args()
    for kwargs in ({"BLOCK": 64}, {"BLOCK": 32, "MODE": "b", "num_warps": 8}):
        launch(fn, grid, *args, **kwargs)
        launch(fn, grid, *args, **kwargs)
    stock, direct = compiled.launches[0::2], compiled.launches[1::2]
    for ours, triton_s in zip(direct, stock):
        assert len(ours) == len(triton_s) and all(a is b or a == b for a, b in zip(ours[:6], triton_s[:6]))
        assert all(a is b for a, b in zip(ours[9:], triton_s[9:]))  # every parameter, the same objects
        assert ours[6:9] == (None, None, None) and triton_s[6] == "launch metadata"
    assert direct[1][:3] == (32, True, 3) and direct[1][-2:] == (32, "b")

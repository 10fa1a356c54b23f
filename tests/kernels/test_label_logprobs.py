"""label_logprobs: the Triton kernels against the torch reference.

Small cases run the kernels in Triton's interpreter on the CPU (compiled where a GPU is present); `gpu` tests
use the real Qwen3 vocabulary.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # not importorskip: triton must not be imported yet, see below
    pytest.skip("needs triton", allow_module_level=True)

# Every dtype is multiplied exactly and accumulated in float32, as the reference does after upcasting.
TOLERANCE = 1e-4


def load_interpreted_kernels():
    """A private copy of the kernel module whose kernels run in Triton's interpreter, or None where impossible.

    Triton fixes interpretation when a function is decorated, its own reductions included, so TRITON_INTERPRET=1
    must be set before triton is first imported (and while kernels run); it is restored in between so that
    modules imported later compile as usual.
    """
    if os.environ.get("TRITON_INTERPRET") != "1" and ("triton" in sys.modules or torch.cuda.is_available()):
        return None
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.find_spec("rerankit.kernels.label_logprobs")
        interpreted_spec = importlib.util.spec_from_file_location("label_logprobs_interpreted", spec.origin)
        module = importlib.util.module_from_spec(interpreted_spec)
        interpreted_spec.loader.exec_module(module)
        return module


interpreted = load_interpreted_kernels()

from rerankit.kernels import label_logprobs as kernels  # noqa: E402
from rerankit.kernels.label_logprobs import label_logprobs_reference  # noqa: E402


@pytest.fixture
def triton_label_logprobs(monkeypatch):
    """`label_logprobs` on the Triton path: interpreted on the CPU, or compiled where a GPU is present.

    Its torch fallback is made to fail, so a pass proves the kernels ran; inputs and output stay on the CPU.
    """
    if interpreted is not None:
        module, device = interpreted, "cpu"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif torch.cuda.is_available():
        module, device = kernels, "cuda"
    else:
        pytest.skip("triton was imported without its interpreter; test_cpu_cases_in_a_fresh_process runs this")

    def fallback_taken(*args, **kwargs):
        raise AssertionError("label_logprobs fell back to the torch reference")

    monkeypatch.setattr(module, "label_logprobs_reference", fallback_taken)

    def run(*args):
        return module.label_logprobs(*[a.to(device) if isinstance(a, torch.Tensor) else a for a in args]).cpu()

    return run


def make_inputs(n_rows, n_labels, vocab, dim, dtype, seed=0, ragged=True, bias=False):
    """Random hidden states, lm_head (and bias), label ids, and a ragged mask whose padding holds invalid ids."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_rows, dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5 * 4).to(dtype)
    lm_head_bias = torch.randn(vocab, generator=gen).to(dtype) if bias else None
    label_ids = torch.randint(0, vocab, (n_rows, n_labels), generator=gen)
    label_mask = torch.ones(n_rows, n_labels, dtype=torch.bool)
    if ragged:
        counts = torch.randint(1, n_labels + 1, (n_rows,), generator=gen)
        label_mask = torch.arange(n_labels)[None, :] < counts[:, None]
        label_ids = label_ids.masked_fill(~label_mask, -7)  # padding ids are never read
    return hidden, weight, label_ids, label_mask, lm_head_bias


@pytest.mark.parametrize("full_vocab", [False, True], ids=["labels_only", "full_vocab"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "n_rows, n_labels, vocab, dim, bias",
    [(1, 1, 300, 32, False), (5, 2, 1000, 64, True), (8, 128, 700, 48, False), (37, 3, 515, 40, True)],
)
def test_kernel_matches_reference(triton_label_logprobs, full_vocab, dtype, n_rows, n_labels, vocab, dim, bias):
    hidden, weight, label_ids, label_mask, lm_head_bias = make_inputs(n_rows, n_labels, vocab, dim, dtype, bias=bias)
    out = triton_label_logprobs(hidden, weight, label_ids, label_mask, full_vocab, lm_head_bias)
    expected = label_logprobs_reference(hidden, weight, label_ids, label_mask, full_vocab, lm_head_bias)
    assert out.dtype == torch.float32 and out.shape == (n_rows, n_labels)
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_masked_slots_are_minus_inf(triton_label_logprobs):
    hidden, weight, label_ids, label_mask, _ = make_inputs(6, 5, 400, 32, torch.float32)
    for full_vocab in (False, True):
        out = triton_label_logprobs(hidden, weight, label_ids, label_mask, full_vocab)
        assert torch.all(out[~label_mask] == float("-inf"))
        assert torch.isfinite(out[label_mask]).all()


def test_labels_only_probabilities_sum_to_one_per_row(triton_label_logprobs):
    hidden, weight, label_ids, label_mask, _ = make_inputs(7, 4, 300, 32, torch.float32)
    out = triton_label_logprobs(hidden, weight, label_ids, label_mask)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(7))


def test_full_vocab_probabilities_of_every_token_sum_to_one(triton_label_logprobs):
    # V=100 is smaller than one vocabulary tile, so the kernel sees a single, partly filled tile.
    hidden, weight, _, _, lm_head_bias = make_inputs(3, 1, 100, 32, torch.float32, bias=True)
    every_token = torch.arange(100).expand(3, 100)
    out = triton_label_logprobs(hidden, weight, every_token, None, True, lm_head_bias)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(3))


def test_strided_hidden_states(triton_label_logprobs):
    hidden, weight, label_ids, label_mask, _ = make_inputs(8, 2, 333, 32, torch.float32)
    read_rows = hidden[::2]  # read positions gathered as a strided view
    for full_vocab in (False, True):
        out = triton_label_logprobs(read_rows, weight, label_ids[::2], label_mask[::2], full_vocab)
        expected = label_logprobs_reference(read_rows, weight, label_ids[::2], label_mask[::2], full_vocab)
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.skipif(kernels._INTERPRET, reason="this process imported the kernels with TRITON_INTERPRET=1")
def test_cpu_tensors_fall_back_to_reference_without_interpreter(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "label_logprobs_reference", lambda *args: calls.append(args) or "reference")
    hidden, weight, label_ids, label_mask, _ = make_inputs(2, 2, 300, 32, torch.float32)
    assert kernels.label_logprobs(hidden, weight, label_ids, label_mask) == "reference"
    assert len(calls) == 1


@pytest.mark.skipif(
    interpreted is not None or torch.cuda.is_available(), reason="the small cases ran in this process"
)
def test_cpu_cases_in_a_fresh_process():
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-m", "not gpu", "-p", "no:cacheprovider"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("full_vocab", [False, True], ids=["labels_only", "full_vocab"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n_rows, n_labels", [(64, 2), (1, 2), (64, 128), (300, 5)])
def test_kernel_matches_reference_on_gpu_at_qwen3_vocabulary(full_vocab, dtype, n_rows, n_labels):
    hidden, weight, label_ids, label_mask, _ = make_inputs(n_rows, n_labels, 151669, 1024, dtype)
    args = [t.cuda() for t in (hidden, weight, label_ids, label_mask)]
    out = kernels.label_logprobs(*args, full_vocab=full_vocab)
    expected = label_logprobs_reference(*args, full_vocab=full_vocab)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-4)

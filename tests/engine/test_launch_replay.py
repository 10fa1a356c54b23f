"""engine.launch_replay: later layers launch what the first one launched, only where that is exact.

On the CPU the launches are stand-ins for ``direct_launch.Recorded`` (a torch function run on the launch's values);
on a GPU an eager FP8 forward with replays gives the same bits as one without."""

import dataclasses
import random
import string

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from rerankit.engine.launch_replay import ENV, LayerReplay
from rerankit.kernels import direct_launch


class FakeLaunch:
    """What ``direct_launch.Recorded`` offers a step: its values, the specialization check and a replay."""

    def __init__(self, fn, values):
        self.fn, self.values = fn, tuple(values)

    def specializes_alike(self, position, value):
        old = self.values[position]
        return type(value) is type(old) and getattr(value, "dtype", None) == getattr(old, "dtype", None)

    def replay(self, changes):
        values = list(self.values)
        for position, value in changes.items():
            values[position] = value
        _run(self.fn, values)


def _run(fn, values):
    with _disable_current_modes():  # the "kernel": not a torch operation of the step's own
        fn(*values)


def fake_launch(fn, *values):
    _run(fn, values)
    recorder = getattr(direct_launch._RECORDING, "recorder", None)
    if recorder is not None:
        recorder.append(FakeLaunch(fn, values))


@dataclasses.dataclass
class Descriptor:
    base: torch.Tensor
    block: int


def times(x, w, out):
    out.copy_(x * w)


def scaled(x, w):
    out = torch.empty_like(x)
    fake_launch(times, x, w, out)
    return out


def layers(step, inputs):
    """Run ``step`` as a forward's step over ``inputs`` (one call per layer); the results (cloned) and the replay."""
    replay, out = LayerReplay(), []
    wrapped = replay.step("scaled", step)
    for args in inputs:
        replay.next_layer()
        out.append(wrapped(*args).clone())
    return out, replay


def weights(count, size=8, dtype=torch.float32):
    return [(torch.randn(size, dtype=dtype), torch.randn(size, dtype=dtype)) for _ in range(count)]


def test_later_layers_replay_with_their_own_tensors():
    inputs = weights(4)
    out, replay = layers(scaled, inputs)
    assert replay.replayed == 3
    for (x, w), got in zip(inputs, out):
        torch.testing.assert_close(got, x * w, rtol=0, atol=0)


def test_a_descriptor_of_an_argument_is_made_again_over_the_next_layers_tensor():
    def step(x, w):
        out = torch.empty_like(x)
        fake_launch(lambda x, desc, out: out.copy_(x * desc.base), x, Descriptor(w, 4), out)
        return out

    inputs = weights(3)
    out, replay = layers(step, inputs)
    assert replay.replayed == 2
    for (x, w), got in zip(inputs, out):
        torch.testing.assert_close(got, x * w, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["conversion", "copy", "tuning", "no launch", "output is an input"])
def test_steps_that_do_more_than_launch_are_never_replayed(case):
    """A step that converts, copies, tunes (Triton's own launch) or launches nothing runs as usual in every layer."""
    def step(x, w):
        if case == "conversion":
            w = w.to(torch.float64).to(torch.float32)
        if case == "copy":
            x = x.clone()
        if case == "tuning":
            direct_launch.note_launch_elsewhere()
        if case == "no launch":
            with _disable_current_modes():
                return x * w
        out = x if case == "output is an input" else torch.empty_like(x)
        fake_launch(times, x, w, out)
        return out

    inputs = weights(3)
    expected = [x * w for x, w in inputs]
    out, replay = layers(step, inputs)
    assert replay.replayed == 0
    for want, got in zip(expected, out):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_view_of_an_argument_replays_only_for_that_very_tensor():
    def step(x, w):
        out = torch.empty(x.shape[0] - 1)
        fake_launch(times, x[1:], w[1:], out)
        return out

    shared = torch.randn(8)
    inputs = [(shared, torch.randn(8)), (shared, torch.randn(8))]
    _, replay = layers(step, inputs)
    assert replay.replayed == 0  # w is new in the second layer: its view cannot be swapped in
    inputs = [(torch.randn(8), shared), (torch.randn(8), shared), (torch.randn(8), shared)]
    out, replay = layers(step, [(x, w) for x, w in inputs])
    assert replay.replayed == 0
    other = torch.randn(8)
    out, replay = layers(step, [(shared, other)] * 3)
    assert replay.replayed == 2
    torch.testing.assert_close(out[2], shared[1:] * other[1:], rtol=0, atol=0)
    assert layers(step, [(shared, shared)] * 3)[1].replayed == 0  # one tensor given twice


@pytest.mark.parametrize("change", ["shape", "dtype", "number", "keyword", "order"])
def test_calls_unlike_the_recorded_one_run_as_usual(change):
    def step(x, w, factor=1.0, **_):
        out = torch.empty_like(x)
        fake_launch(lambda x, w, out: out.copy_(x * w * factor), x, w, out)
        return out

    replay = LayerReplay()
    wrapped, other = replay.step("scaled", step), replay.step("other", step)
    replay.next_layer()
    x, w = torch.randn(8), torch.randn(8)
    wrapped(x, w, factor=2.0)
    replay.next_layer()
    if change == "shape":
        x, w = torch.randn(9), torch.randn(9)
    if change == "dtype":
        x, w = x.double(), w.double()
    kwargs = {"factor": 3.0 if change == "number" else 2.0}
    if change == "keyword":
        kwargs["extra"] = 1
    got = (other if change == "order" else wrapped)(x, w, **kwargs)
    assert replay.replayed == 0
    torch.testing.assert_close(got, x * w * kwargs["factor"], rtol=0, atol=0)


def test_replay_is_opt_in_and_needs_the_direct_path(monkeypatch):
    from rerankit.engine import launch_replay

    monkeypatch.setattr(direct_launch, "replay_possible", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv(ENV, raising=False)
    assert not launch_replay.enabled()  # opt-in
    monkeypatch.setenv(ENV, "1")
    assert launch_replay.enabled()
    monkeypatch.setattr(direct_launch, "replay_possible", lambda: False)
    assert not launch_replay.enabled()


HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU (FP8 and the Gluon kernels)")
@pytest.mark.parametrize("projections", ["", "qkv,o,gate_up,down"], ids=["default", "all"])
def test_gpu_eager_fp8_forward_with_replays_gives_the_same_bits(tmp_path, projections, monkeypatch):
    """A model with heads of 128 (the Gluon GEMMs' shape) and a batch above 2,048 tokens, eager: the scores with
    replayed layers equal those without, bit for bit, and later layers did replay."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rerankit.engine import EmbeddedBackend
    from rerankit.engine.fp8 import PROJECTIONS_ENV
    from rerankit.schema import ScoreRequest
    from tiny_models import build_decoder_tokenizer

    monkeypatch.setenv(PROJECTIONS_ENV, projections)
    folder = tmp_path / "qwen3-reranker-wide"
    tokenizer = build_decoder_tokenizer(folder)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    rng = random.Random(0)
    docs = [" ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(rng.randint(40, 120)))
            for _ in range(48)]
    request = ScoreRequest(query="which one", items=docs)
    backend = EmbeddedBackend(str(folder), device="cuda", dtype="fp8", cuda_graphs=False)
    model = backend._runner.model
    scores = {}
    for setting in ("0", "1", "0", "1"):  # the first pair compiles and tunes
        monkeypatch.setenv(ENV, setting)
        model.replayed_steps = 0
        scores[setting] = torch.tensor(backend.score(request).scores)
        assert (model.replayed_steps > 0) == (setting == "1")
    assert torch.equal(scores["0"], scores["1"])


def test_views_of_one_buffer_replay_and_a_conversion_to_the_same_dtype_is_no_copy():
    """q/k/v as views of one projection buffer (new view objects each layer, the same memory), one of them passed as
    a further view of itself, and ``.float()`` of a float32 weight (itself): later layers replay."""
    buffer = torch.randn(3, 8)

    def step(q, k, w):
        out = torch.empty(8)
        fake_launch(lambda q, k, w, out: out.copy_(q * k * w), q, k[0], w.float(), out)
        return out

    replay, wrapped, got = LayerReplay(), None, []
    wrapped = replay.step("attention", step)
    for _ in range(3):
        replay.next_layer()
        w = torch.randn(8)
        got.append((wrapped(buffer[0], buffer[1:2], w).clone(), buffer[0] * buffer[1] * w))
    assert replay.replayed == 2
    for out, want in got:
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_a_number_of_the_layers_own_is_passed_on_and_in_place_writes_are_never_replayed():
    def step(x, w, bound):
        out = torch.empty_like(x)
        fake_launch(lambda x, w, bound, out: out.copy_(x * w * bound), x, w, float(bound), out)
        return out

    inputs = [(x, w, 0.5 + layer) for layer, (x, w) in enumerate(weights(3))]
    out, replay = layers(step, inputs)
    assert replay.replayed == 2
    for (x, w, bound), got in zip(inputs, out):
        torch.testing.assert_close(got, x * w * bound, rtol=0, atol=0)

    def in_place(x, w):
        out = torch.empty_like(x)
        x.mul_(1.0)  # a write the replay would skip
        fake_launch(times, x, w, out)
        return out

    assert layers(in_place, weights(3))[1].replayed == 0

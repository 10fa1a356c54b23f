"""launch_tuned: an autotuned kernel goes through its tuner once per key, then straight to the chosen config."""

from types import SimpleNamespace

from rerankit.kernels import MAX_TUNED_TOKENS, MIN_TUNED_TOKENS, launch_tuned, token_bucket


class FakeTuner:
    """Stands in for triton.autotune's wrapper: records how each launch was made."""

    def __init__(self, config):
        self.calls, self.best_config = [], None
        self._config = config
        tuner = self

        class Direct:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: tuner.calls.append(("direct", grid, args, kwargs))

        self.fn = Direct()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("tuner", grid, args, kwargs))
            self.best_config = self._config
        return run


def test_first_launch_tunes_later_ones_take_the_chosen_config():
    config = SimpleNamespace(kwargs={"BLOCK_M": 64}, all_kwargs=lambda: {"BLOCK_M": 64, "num_warps": 4})
    tuner, shapes = FakeTuner(config), []
    for _ in range(3):
        launch_tuned(tuner, ("key", 1), (7,), (1, 2), {"FLAG": True}, shapes.append)
    launch_tuned(tuner, ("key", 2), (7,), (3,), {}, shapes.append)  # a new key tunes again
    assert [call[0] for call in tuner.calls] == ["tuner", "direct", "direct", "tuner"]
    assert tuner.calls[1] == ("direct", (7,), (1, 2), {"FLAG": True, "BLOCK_M": 64, "num_warps": 4})
    assert shapes == [config, config]  # the block shapes are set for each direct launch


def test_token_buckets_are_powers_of_two_clamped_to_the_tuned_range():
    assert [token_bucket(t) for t in (1, 100, 2048, 2049, 5120, 8192, 26624, 65536, 10**6)] == \
        [MIN_TUNED_TOKENS, MIN_TUNED_TOKENS, 2048, 4096, 8192, 8192, 32768, 65536, MAX_TUNED_TOKENS]


def test_a_gemm_is_tuned_again_in_each_bucket_of_token_counts():
    config = SimpleNamespace(kwargs={}, all_kwargs=lambda: {})
    tuner = FakeTuner(config)
    for tokens in (256, 1900, 26624, 30000, 5000):  # buckets: 2k, 2k, 32k, 32k, 8k
        launch_tuned(tuner, ("qkv",), (1,), (tokens,), {}, lambda config: None, tokens=tokens)
    assert [(call[0], call[2][0]) for call in tuner.calls] == [
        ("tuner", 256), ("direct", 1900), ("tuner", 26624), ("direct", 30000), ("tuner", 5000)]

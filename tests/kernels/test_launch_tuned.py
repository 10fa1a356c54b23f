"""launch_tuned: an autotuned kernel goes through its tuner once per key, then straight to the chosen config."""

from types import SimpleNamespace

from rerankit.kernels import launch_tuned


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

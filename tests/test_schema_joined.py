"""ScoreResponse.joined: one response from a request's pieces (the scheduler's chunks, the replicas' shards, a remote
backend's item chunks)."""

import pytest

from rerankit.schema import ScoreResponse, ScoreResult, Usage


def piece(scores, prompt, computed, model="m"):
    return ScoreResponse(results=[ScoreResult(index=i, score=s) for i, s in enumerate(scores)], model=model,
                         usage=Usage(prompt_tokens=prompt, computed_tokens=computed))


def test_pieces_in_any_order_join_in_item_order_with_usage_summed():
    joined = ScoreResponse.joined([(3, piece([0.4], 5, 4, "second")), (0, piece([0.1, 0.2, 0.3], 9, 7, "first"))])
    assert [(r.index, r.score) for r in joined.results] == [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)]
    assert joined.usage == Usage(prompt_tokens=14, computed_tokens=11) and joined.model == "first"


@pytest.mark.parametrize("starts", [(0, 3), (0, 1)], ids=["gap", "overlap"])
def test_pieces_that_leave_a_gap_or_overlap_are_refused(starts):
    with pytest.raises(ValueError, match="must be in input order"):
        ScoreResponse.joined([(starts[0], piece([0.1, 0.2], 1, 1)), (starts[1], piece([0.3], 1, 1))])

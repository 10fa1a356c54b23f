"""Every ``RerankitError`` pickles whole: the data-parallel replicas send errors to the parent as they are."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest

from rerankit import errors
from rerankit.errors import InvalidRequest, RerankitError, shift_item_index

# Every RerankitError class errors.py defines, a subclass added later included.
ERROR_CLASSES = sorted((value for value in vars(errors).values()
                        if isinstance(value, type) and issubclass(value, RerankitError)), key=lambda cls: cls.__name__)


def build(cls: type[RerankitError]) -> RerankitError:
    """An instance of ``cls`` with a distinct value for each argument of its ``__init__``: a number where the
    annotation names int (``limit``, ``status_code``), else a string naming the argument."""
    arguments = {}
    for position, (name, parameter) in enumerate(inspect.signature(cls.__init__).parameters.items()):
        if name != "self":
            annotation = str(parameter.annotation)
            arguments[name] = 400 + position if "int" in annotation else f"{name} of {cls.__name__}"
    return cls(**arguments)


def assert_same(copied: BaseException, error: BaseException) -> None:
    assert type(copied) is type(error)
    assert copied.args == error.args and str(copied) == str(error)
    assert vars(copied) == vars(error) and vars(copied)  # message, field, reason, limit, status_code, url...
    assert (copied.status_code, copied.error_type) == (error.status_code, error.error_type)


def test_every_error_class_is_covered() -> None:
    assert len(ERROR_CLASSES) >= 10 and RerankitError in ERROR_CLASSES and InvalidRequest in ERROR_CLASSES


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_round_trips_through_pickle_with_its_attributes(cls, protocol) -> None:
    error = build(cls)
    assert_same(pickle.loads(pickle.dumps(error, protocol=protocol)), error)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_copies(cls) -> None:
    error = build(cls)
    assert_same(copy.copy(error), error)
    assert_same(copy.deepcopy(error), error)


def test_attributes_set_after_init_and_notes_travel_too() -> None:
    error = errors.RequestTooLarge("items[3].text", "is too long", 64)
    error.add_note("while scoring shard 2")
    shifted = shift_item_index(error, 10)  # built without __init__, as the replicas' merge builds it
    copied = pickle.loads(pickle.dumps(shifted))
    assert_same(copied, shifted)
    assert copied.field == "items[13].text" and copied.limit == 64 and copied.__notes__ == ["while scoring shard 2"]
    remote = errors.RemoteError("busy", status_code=503, url="http://far/rerank", body='{"error": "busy"}',
                                retry_after=7.5)
    assert_same(pickle.loads(pickle.dumps(remote)), remote)
    assert pickle.loads(pickle.dumps(remote)).retry_after == 7.5


def test_remote_errors_never_carry_a_urls_credentials():
    from rerankit.errors import RemoteError, hide_credentials

    assert hide_credentials("a http://u:p@h:1/x and https://tok@h2/y, not a@b or mailto:u@h") == \
        "a http://h:1/x and https://h2/y, not a@b or mailto:u@h"
    # a password may hold "@" (httpx splits at the last one): none of it is left
    assert hide_credentials("far http://admin:hunter2@secret@h:1 and http://a:b@c@d@e:2?x=@y is down") == \
        "far http://h:1 and http://e:2?x=@y is down"
    error = RemoteError("ConnectError (http://u:p@far:8000/v1/rerank, 2 tries)", 503, "http://u:p@far:8000/v1/rerank")
    assert "u:p" not in str(error) and error.url == "http://far:8000/v1/rerank"
    assert str(error) == "HTTP 503 from http://far:8000/v1/rerank: ConnectError (http://far:8000/v1/rerank, 2 tries)"


def test_a_url_with_whitespace_is_refused_without_echoing_it():
    from rerankit.remote import RemoteBackend

    with pytest.raises(InvalidRequest) as error:
        RemoteBackend("http://user:pa ss@far:8000")
    assert "percent-encode" in str(error.value) and "pa ss" not in str(error.value)


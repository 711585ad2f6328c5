"""Every error class crosses the wire as itself: what the broker answers for
it (status and body, the one serializer) the client turns back into that very
class, with its status and code; and each class has its own status and code,
set on the class, never on an instance."""

from __future__ import annotations

import json

import pytest
import tensordepot
from tensordepot._errors import DepotError, error_class, error_classes
from tensordepot.client._http import error
from tensordepot.service._http._gate import Gate

CLASSES = error_classes()


def test_each_class_has_its_own_status_and_code() -> None:
    keys = [(c.status, c.code) for c in CLASSES]
    assert len(keys) == len(set(keys)), keys
    assert len(CLASSES) >= 20
    for cls in CLASSES:
        assert cls is DepotError or cls.__name__ in tensordepot.__all__, cls  # exported


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_the_broker_answer_and_the_client_exception_agree(cls: type[DepotError]) -> None:
    status, body = Gate.failure(cls("what happened"))
    assert status == cls.status
    assert json.loads(body) == {"error": {"code": cls.code, "message": "what happened"}}
    back = error(status, body)
    assert type(back) is cls and back.status == status and back.code == cls.code
    assert str(back) == "what happened" and "status" not in vars(back) and "code" not in vars(back)


def test_a_code_the_client_does_not_know_falls_back_to_its_status() -> None:
    assert error_class(422, "something_new") is tensordepot.Unprocessable
    assert error_class(404, "something_new") is tensordepot.TensorNotFound
    assert error_class(599, "") is DepotError

"""The public API explains itself: docstrings on every exported class and its
public methods (the API reference is made from them, .ci/check), and
``help()`` on the answers (``Stat``, ``TensorInfo``, ``DeviceStat``) shows
what each field means rather than pydantic's machinery."""

from __future__ import annotations

import inspect
import pydoc

import pydantic
import pytest
import tensordepot
import tensordepot.checkpoint

CLASSES = [
    getattr(m, n)
    for m in (tensordepot, tensordepot.checkpoint)
    for n in m.__all__
    if inspect.isclass(getattr(m, n))
]
# Protocol methods a user calls through syntax or a library, so they are documented too.
DOCUMENTED_DUNDERS = {"__dlpack__", "__dlpack_device__", "__array__", "__enter__", "__exit__"}
ANSWERS = [tensordepot.Stat, tensordepot.TensorInfo, tensordepot.DeviceStat]
# What every pydantic model would otherwise bring into help(): BaseModel's own
# docstring, its inherited methods (their docstrings open with "Usage
# Documentation"), and the __pydantic_*__ attributes.
# ("Usage docs" opened that docstring in older pydantic releases.)
BASE_DOC = "A base class for creating Pydantic models"
SHOWN_FOR_ANY_MODEL = [
    "Usage Documentation",
    "__pydantic",
    "model_validate",
    "inherited from pydantic",
]
BOILERPLATE = [BASE_DOC, "Usage docs", *SHOWN_FOR_ANY_MODEL]


def test_the_boilerplate_markers_are_real() -> None:
    """help() on a plain pydantic model shows these, so the test below can fail."""

    class Plain(pydantic.BaseModel):
        x: int = pydantic.Field(description="an x")

    text = pydoc.render_doc(Plain, renderer=pydoc.plaintext)
    assert [m for m in SHOWN_FOR_ANY_MODEL if m not in text] == [], text[:2000]
    assert BASE_DOC in (pydantic.BaseModel.__doc__ or "")


@pytest.mark.parametrize("cls", [pytest.param(c, id=c.__name__) for c in CLASSES])
def test_every_exported_class_and_public_method_has_a_docstring(cls: type) -> None:
    assert (cls.__dict__.get("__doc__") or "").strip(), f"{cls.__name__} has no docstring"
    missing = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name not in DOCUMENTED_DUNDERS:
            continue
        func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if callable(func) and not (getattr(func, "__doc__", None) or "").strip():
            missing.append(name)
    assert not missing, f"{cls.__name__}: no docstring on {missing}"


@pytest.mark.parametrize("cls", [pytest.param(c, id=c.__name__) for c in ANSWERS])
def test_help_on_an_answer_describes_its_fields_without_pydantic_noise(cls: type) -> None:
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    fields = cls.model_fields  # type: ignore[attr-defined]
    for name, field in fields.items():
        assert field.description, f"{cls.__name__}.{name} has no description"
        assert f"``{name}``" in text and field.description in text, (name, text)
    noise = [marker for marker in BOILERPLATE if marker in text]
    assert not noise, f"help({cls.__name__}) shows pydantic's {noise}:\n{text}"


def test_answers_still_behave_as_pydantic_models() -> None:
    """Only help() changes: instances keep their methods, and validation works."""
    s = tensordepot.Stat(
        bytes_in_use=1,
        bytes_reserved=2,
        max_memory=3,
        tensors=0,
        versions=0,
        leases=0,
        sessions=0,
        segments=0,
    )
    assert "model_dump" in dir(s) and s.model_dump()["bytes_reserved"] == 2
    assert tensordepot.Stat.model_validate_json(s.model_dump_json()) == s
    with pytest.raises(pydantic.ValidationError):
        tensordepot.Stat.model_validate({"bytes_in_use": "many"})

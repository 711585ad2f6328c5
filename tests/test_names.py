"""The one name rule: ``is_name`` (string methods, for speed) says what the
documented pattern (``NAME_PATTERN``, shown in the OpenAPI schema) says,
for every character and at the length limits."""

from __future__ import annotations

import random
import re

import pytest
from tensordepot._errors import InvalidRequest, InvalidType
from tensordepot._wire import NAME_PATTERN, ManyPublish, check_name, is_name

# The pattern as the schema states it, with `$` meaning the end of the text.
_PATTERN = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))


def _by_pattern(name: str) -> bool:
    return _PATTERN.fullmatch(name) is not None


def test_every_character_alone_and_between_others() -> None:
    wrong = [
        c
        for c in range(0x110000)
        if is_name(chr(c)) != _by_pattern(chr(c))
        or is_name(f"a{chr(c)}b") != _by_pattern(f"a{chr(c)}b")
    ]
    assert not wrong, [hex(c) for c in wrong[:20]]
    assert is_name("!") and is_name("~") and is_name("model.layers.0/w")
    assert not is_name(" ") and not is_name("\x7f") and not is_name("w\n")


@pytest.mark.parametrize("n", [0, 1, 2, 511, 512, 513, 4096])
def test_the_length_limits(n: int) -> None:
    assert is_name("a" * n) == _by_pattern("a" * n) == (1 <= n <= 512)


def test_random_mixtures() -> None:
    rng = random.Random(7)
    alphabet = [chr(i) for i in range(0x100)] + ["\u2028", "\u00e9", "\U0001f600", "\ufeff"]
    for _ in range(50_000):
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        assert is_name(name) == _by_pattern(name), repr(name)


def test_check_name_says_what_is_wrong() -> None:
    assert check_name("w") == "w"
    with pytest.raises(InvalidRequest, match="not a valid tensor name"):
        check_name("w\n")
    with pytest.raises(InvalidType, match="must be a str"):
        check_name(b"w")


def test_a_batch_column_refuses_a_bad_name_with_the_same_check() -> None:
    assert ManyPublish(names=["a", "b/c"], versions=[1, 2]).names == ["a", "b/c"]
    with pytest.raises(ValueError, match="not a valid tensor name"):
        ManyPublish(names=["a", "b\tc"], versions=[1, 2])

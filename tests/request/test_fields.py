"""check_fields walks the body's own fields; its error must not depend on the body's key order."""

from __future__ import annotations

import pytest

from gateway.errors import BadRequest
from gateway.request.fields import FIELD_RULES, check_fields
from gateway.request.types import ApiKind


def _error(api: ApiKind, body: dict) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        check_fields(api, body)
    return caught.value


def test_a_wrong_field_names_itself_and_what_it_must_be():
    error = _error(ApiKind.CHAT, {"model": "m", "max_tokens": "ten"})
    assert error.param == "max_tokens"
    assert "'max_tokens' must be" in str(error) and "a string" in str(error)


def test_with_several_wrong_the_first_rule_is_named_whatever_the_body_order():
    rules = list(FIELD_RULES[ApiKind.CHAT])
    first, later = rules.index("max_tokens"), rules.index("logprobs")
    assert first < later
    for body in ({"max_tokens": "x", "logprobs": 3}, {"logprobs": 3, "max_tokens": "x"}):
        assert _error(ApiKind.CHAT, body).param == "max_tokens"


def test_nulls_unknown_fields_and_apis_without_rules_pass():
    check_fields(ApiKind.CHAT, {"max_tokens": None, "logprobs": None, "no_such_field": {"a": [1]}})
    check_fields(ApiKind.DETOKENIZE, {"tokens": "anything"})
    check_fields(ApiKind.CHAT, {"max_tokens": 16, "logprobs": True, "temperature": 0.5})

"""Filter ``role``."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from gateway.fleet.endpoint import Role
from tests.policies.helpers import endpoint, make_plugin, request


@pytest.fixture
def fleet():
    return [endpoint(1, role=Role.BOTH), endpoint(2, role=Role.PREFILL), endpoint(3, role=Role.DECODE)]


def test_default_keeps_role_both(fleet):
    assert make_plugin("role").filter(request(), fleet) == [fleet[0]]


@pytest.mark.parametrize(
    ("roles", "expected"),
    [(["prefill"], [1]), (["decode"], [2]), (["prefill", "decode"], [1, 2]), (["both", "decode"], [0, 2])],
)
def test_configured_roles(fleet, roles, expected):
    flt = make_plugin("role", {"roles": roles})
    assert flt.filter(request(), fleet) == [fleet[i] for i in expected]


def test_no_endpoint_with_the_role(fleet):
    flt = make_plugin("role", {"roles": ["prefill"]})
    assert flt.filter(request(), [fleet[0], fleet[2]]) == []


@pytest.mark.parametrize("roles", [["prefil"], "prefill", [1], ["both", None]])
def test_bad_roles_name_the_parameter(roles):
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.roles"):
        make_plugin("role", {"roles": roles})


def test_unknown_parameter():
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.role\b"):
        make_plugin("role", {"role": ["both"]})

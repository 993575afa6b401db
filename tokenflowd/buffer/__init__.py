"""The token-buffer model and the scheduling policies that consume it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from tokenflowd.buffer.andes import AndesPolicy
from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import SchedulingPolicy
from tokenflowd.buffer.tokenflow import TokenFlowPolicy
from tokenflowd.config import POLICY_NAMES

if TYPE_CHECKING:
    from tokenflowd.config import PolicyConfig

# name -> constructor from the policy parameters (`--policy NAME`)
POLICIES: dict[str, Callable[["PolicyConfig"], SchedulingPolicy]] = {
    "fcfs": lambda params: FCFSPolicy(),
    "andes": lambda params: AndesPolicy(params),
    "tokenflow": lambda params: TokenFlowPolicy(params),
}
assert tuple(POLICIES) == POLICY_NAMES, "config.py names the policies it accepts"


def make_policy(name: str, params: "PolicyConfig") -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](params)

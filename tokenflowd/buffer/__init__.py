"""The token-buffer model and the scheduling policies that consume it."""
from tokenflowd.buffer.fcfs import FCFSPolicy
from tokenflowd.buffer.policy import SchedulingPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy}

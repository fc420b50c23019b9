"""Fixtures that several unit test modules share."""

from tests.unit.node_parts import node  # noqa: F401 (a node's parts as the agent wires them)

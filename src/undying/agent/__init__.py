"""The node agent: spawns and supervises a node's workers."""

from undying.agent.agent import Agent, ManagerLink

__all__ = ["Agent", "ManagerLink"]

"""The node agent: spawns and supervises a node's workers."""

from undying.agent.agent import Agent

__all__ = ["Agent"]

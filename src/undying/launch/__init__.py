"""The assembly layer: what builds a job's parts and connects them.

``standalone`` is ``undying run`` on one node: a manager and the node's agent
in one process, talking over ``in_process`` (the same ``protocol/node_wire.py``
messages a multi-node job sends over TCP, each encoded and decoded on its way).
``manager_service`` is ``undying manager``: the manager on its own, its agents
on other hosts. What both build alike (the job dir and its token, the manager
with its log, control store and HTTP API) is ``manager_host``. Each part gets
what it needs at construction, or in one typed bind call for what exists only
later. Nothing below this layer imports it; the command line (``cli``) calls it.
"""

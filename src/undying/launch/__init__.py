"""The assembly layer: what builds a job's parts and connects them.

``standalone`` is ``undying run`` on one node: a manager and the node's agent
in one process, talking over ``in_process`` (the same ``protocol/node_wire.py``
messages a multi-node job sends over TCP, each encoded and decoded on its way).
Nothing below this layer imports it; the command line (``cli``) calls it.
"""

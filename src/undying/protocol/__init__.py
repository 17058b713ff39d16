"""The floor every role stands on: what the job's processes say to each other, and how.

- ``codec``: typed messages as tagged msgspec structs, one encode and one
  decode per channel, and ``Handlers``, a receiver's table from message class
  to handler;
- ``kinds``: the closed sets of names (fault kinds, phases) as string enums;
- ``worker_wire``: a worker's channel to its agent; ``node_wire``: the
  conversation of an agent and its manager, in every job; ``zygote_wire``: an agent's
  channel to its worker zygote (frames: ``framing``);
- ``generations``: the generation records on the control store;
- ``seams``: ``AgentHandle`` (what the manager's parts ask of a node's slot);
- the job's authenticated key-value store: its wire (``store_wire``, no
  torch), the ``torch.distributed.Store`` workers use over it
  (``store_client``), and the key a worker shows its agent (``channel_key``);
- ``judge_clock``: how any process judges a peer's silence, only over time it
  ran itself.
- the job's secrets: which derived keys a child process gets and a launcher
  refuses (``keys``), and how a manager proves the job's key to a command
  before it is shown the token (``api_proof``).

Nothing here imports a role (worker, agent, manager); the modules are
imported by name (this package imports none of them, so that ``store_client``
brings torch only where it is used).
"""

__all__ = ["codec", "kinds", "worker_wire", "node_wire", "zygote_wire", "framing", "generations",
           "seams", "store_wire", "store_client", "channel_key", "verify_wire", "judge_clock",
           "keys", "api_proof"]

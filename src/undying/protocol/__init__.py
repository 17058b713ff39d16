"""What the job's processes say to each other, and how they prove who they are.

Today it holds the job's authenticated key-value store (the c10d store every
rank's control plane and process groups stand on): its wire
(``undying.protocol.store_wire``, no torch) and the ``torch.distributed.Store``
that workers use over it (``undying.protocol.store_client``).
"""

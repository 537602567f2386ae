"""The parameter server and its client, in three layers.

- ``paramserver.wire``: the contract both sides share (the ``.proto`` and its stubs, GetChunks
  encoding, bulk frames, message limits, auth metadata, the placement ring).
- ``paramserver.server``: the ``paramserver`` process (services, chunk store, replication,
  repair, scrub, GC, heat, metrics).
- ``paramserver.client``: the one client stack (channels, cluster view, model references,
  fetch engine, pull, push) and ``paramctl``.

Nothing is imported here, so importing the ring does not import gRPC or torch.
"""

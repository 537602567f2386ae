"""The ``paramserver`` process: RPC services, bulk ports, chunk store, replication, repair, scrub,
GC, heat aggregation, metrics. Its composition root is ``paramserver.server.process``."""

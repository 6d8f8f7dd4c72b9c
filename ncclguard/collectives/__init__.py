"""Guarded collectives: ``safe_all_reduce``, ``safe_barrier``, and what they stand on (chunking,
what goes on the wire, the store rendezvous, which call each rank is in, group bookkeeping,
deadlines)."""

"""Guarded collectives: ``safe_all_reduce``, ``safe_barrier``, and what they stand on (chunking,
the store rendezvous, group bookkeeping, deadlines)."""

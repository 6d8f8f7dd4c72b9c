"""Thin adapters that wire ncclguard into a real training stack (installed as ncclguard.integrations)."""

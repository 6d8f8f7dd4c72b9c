"""Private to the step engine: the verdict on a peer that waiting ranks suspect is stuck, and its levers
(the judge bound, the world group's sequence number, the peer's supervisor)."""

"""The store layer: bounded calls (``bounded``, ``calls``), the JSON codec (``codec``), settle-once
rounds (``rounds``), a client per thread (``clients``) and the key schema (``keys``)."""

"""The store layer: bounded calls, the JSON codec, settle-once rounds and the key schema."""

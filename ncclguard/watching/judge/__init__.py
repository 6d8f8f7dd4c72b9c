"""The one judge of stuck ranks: its rules (``rules.py``) and the waiting ranks' agreement (``agreement.py``).

Every part that can act on a rank judged stuck is one of its seats and asks its rules; a lever
acts only on its acting ruling (docs/architecture.md, "The one judge").
"""
